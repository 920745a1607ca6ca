"""The step message: pack/unpack is the identity on every field (LoRA slots per row included),
and the broadcast over a real gloo group (a spawned rank 1) delivers one-part and two-part
messages and a LoRA placement unchanged."""

from __future__ import annotations

import multiprocessing

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from common.ports import free_port
from engine.model.lora.mirror import encode
from engine.model.step_inputs import StepInputs
from engine.parallel.channel import Rendezvous, join
from engine.parallel.step_message import FIRST_PART, Command, control, control_payload, header, pack, unpack


def _inputs(num_prefill_chunks: list[int], num_decodes: int, width: int, moves: int, seed: int,
            lora: bool = False) -> StepInputs:
    g = torch.Generator().manual_seed(seed)
    tokens = sum(num_prefill_chunks) + num_decodes
    starts = [0]
    for n in num_prefill_chunks:
        starts.append(starts[-1] + n)

    def pairs(n: int) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in torch.randint(0, 1000, (n, 2), generator=g)]

    return StepInputs(
        input_ids=torch.randint(0, 50_000, (tokens,), generator=g),
        positions=torch.randint(0, 4096, (tokens,), generator=g),
        slots=torch.randint(-1, 10_000, (tokens,), generator=g), prefill_query_start=starts,
        prefill_context_lens=[n + 7 for n in num_prefill_chunks],
        block_tables=torch.randint(0, 600, (len(num_prefill_chunks) + num_decodes, width), generator=g,
                                   dtype=torch.int32),
        decode_context_lens=torch.randint(1, 4096, (num_decodes,), generator=g, dtype=torch.int32),
        swap_out=pairs(moves), swap_in=pairs(moves // 2), copy=pairs(moves % 3),
        prefill_exact_lens=[int(torch.randint(0, n + 1, (), generator=g)) for n in num_prefill_chunks] or None,
        lora_slots=torch.randint(-1, 8, (tokens,), generator=g) if lora and tokens else None)


def _same(a: StepInputs, b: StepInputs) -> None:
    for name in StepInputs.__slots__:  # type: ignore[attr-defined]
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), name
        else:
            assert x == y, name


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 64), max_size=4), st.integers(0, 40), st.integers(0, 70), st.integers(0, 9),
       st.integers(0, 2**31), st.booleans())
def test_unpack_inverts_pack(chunks: list[int], decodes: int, width: int, moves: int, seed: int, lora: bool) -> None:
    inputs = _inputs(chunks, decodes, width, moves, seed, lora)
    message = pack(inputs)
    assert header(message)["length"] == message.shape[0]
    _same(unpack(message), inputs)


def _echo_rank(rendezvous: Rendezvous, count: int) -> None:
    """Rank 1: receive `count` messages, broadcast each back from rank 1 (its length first)."""
    groups = join(rendezvous, 1)
    for _ in range(count):
        message = groups.receive()
        dist.broadcast(torch.tensor([message.shape[0]]), src=1, group=groups.control)
        dist.broadcast(message.contiguous(), src=1, group=groups.control)
    groups.close()


def test_broadcast_round_trip_over_gloo() -> None:
    small = pack(_inputs([5, 9], 3, 8, 2, seed=1, lora=True))
    large = pack(_inputs([512], 300, 40, 4, seed=2))  # past FIRST_PART: a second broadcast
    assert small.shape[0] < FIRST_PART < large.shape[0]
    weights = {(0, "q_proj"): (torch.randn(4, 64), torch.randn(64, 4))}
    placement = control(Command.LORA, encode(1, weights))
    assert header(placement)["length"] == placement.shape[0]
    assert torch.equal(control_payload(placement), encode(1, weights))
    messages = [small, large, placement, control(Command.SHUTDOWN)]
    rendezvous = Rendezvous(master_addr="127.0.0.1", master_port=free_port("127.0.0.1"), world_size=2, backend="gloo",
                            timeout_s=30.0)
    proc = multiprocessing.get_context("spawn").Process(target=_echo_rank, args=(rendezvous, len(messages)))
    proc.start()
    try:
        groups = join(rendezvous, 0)
        for message in messages:
            groups.send(message)
            length = torch.zeros(1, dtype=torch.int64)
            dist.broadcast(length, src=1, group=groups.control)
            echoed = torch.empty(int(length), dtype=torch.int64)
            dist.broadcast(echoed, src=1, group=groups.control)
            assert torch.equal(echoed, message)
        _same(unpack(small), unpack(pack(unpack(small))))
        groups.close()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0
