"""`ops.moe.packed_moe_experts` (csrc/cpu/packed_moe.cpp), the one-call forward of `PackedExperts`:
bit for bit the Python path (`group_by_expert`, then `PackedExperts.forward`) over token counts 1..300
with skewed routing (one expert past the 128-row crossover), on int8 rows, fp32 (`int8_activations`
False) rows and a step's exact (prompt) rows, leading or in ranges; for SiLU experts in one and in two
gate/up shards of other formats, and gpt-oss's clamped SwiGLU experts with biases."""

from __future__ import annotations

import pytest
import torch

import ops
from engine.model.execution_policy import LinearRows
from engine.model.moe import group_by_expert
from engine.model.moe_spec import CLAMPED_SWIGLU, SILU, MoESpec
from engine.model.packed_experts import PackedExperts, interleave_experts
from ops.moe import MOE_SILU, MOE_SOFTMAX_TOPK, MOE_TOPK_SOFTMAX, moe_route, packed_moe_experts
from ops.quant import FORMATS, QuantFormat
from ops.reference import quant as ref

EXPERTS = 8
SMALL, LARGE = (64, 32), (256, 256)  # (hidden, expert intermediate); K-quants need K a multiple of 256


def _stack(fmt: QuantFormat, rows: int, k: int, gen: torch.Generator) -> tuple[QuantFormat, torch.Tensor]:
    weights = [torch.randn(rows, k, generator=gen) * 0.1 for _ in range(EXPERTS)]
    return interleave_experts(fmt, torch.stack([ref.quantize(w, fmt.type_id) for w in weights]))


def _experts(gate: str, up: str | None, down: str, activation: str, top_k: int,
             size: tuple[int, int] = LARGE) -> PackedExperts:
    """Experts whose gate and up rows share format `gate` (`up` None) or are two shards."""
    gen = torch.Generator().manual_seed(7)
    hidden, inter = size
    spec = MoESpec(num_experts=EXPERTS, top_k=top_k, intermediate_size=inter, sparse_layers=(0,),
                   activation=activation, expert_bias=activation == CLAMPED_SWIGLU)
    gate_up = [_stack(FORMATS[gate], 2 * inter, hidden, gen)] if up is None else \
        [_stack(FORMATS[gate], inter, hidden, gen), _stack(FORMATS[up], inter, hidden, gen)]
    experts = PackedExperts(spec, hidden, gate_up, _stack(FORMATS[down], hidden, inter, gen))
    if spec.expert_bias:
        assert experts.gate_up_proj_bias is not None and experts.down_proj_bias is not None
        with torch.no_grad():
            experts.gate_up_proj_bias.copy_(torch.randn(EXPERTS, 2 * inter, generator=gen))
            experts.down_proj_bias.copy_(torch.randn(EXPERTS, hidden, generator=gen))
    return experts


def _routing(tokens: int, hidden: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`x [T, H]` and skewed top-k choices: expert 0 in most tokens' top-k, the others at random."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen) * 2.0
    scores = torch.randn(tokens, EXPERTS, generator=gen)
    scores[:, 0] += 2.5
    top, experts = torch.topk(scores, top_k, dim=-1)
    return x, experts, torch.softmax(top, dim=-1)


def _row_modes(tokens: int) -> list[LinearRows]:
    modes = [LinearRows(), LinearRows(exact_rows=tokens), LinearRows(exact_rows=max(1, tokens // 3))]
    if tokens >= 6:
        modes.append(LinearRows(exact_rows=tokens - 3, exact_ranges=((1, 3), (5, tokens))))
    return modes


def _check(experts: PackedExperts, tokens: int, seed: int) -> None:
    x, chosen, weights = _routing(tokens, experts.hidden_size, experts.spec.top_k, seed)
    grouped = group_by_expert(chosen, weights, EXPERTS)
    for int8 in (True, False):
        experts.int8_activations = int8
        for rows in _row_modes(tokens) if int8 else [LinearRows()]:
            with torch.inference_mode():
                python = experts(x, *grouped, rows)
                fused = experts.routed(x, chosen, weights, rows)
            assert torch.equal(fused, python), (tokens, int8, rows)


@pytest.mark.parametrize("tokens", range(1, 301))
def test_silu_q4_0_experts_are_the_python_paths_bits_at_every_count(tokens: int) -> None:
    """Small Q4_0 experts in the eight-row layout (one gate/up shard), top-4 of 8, T = 1..300."""
    _check(_q4_0_experts(), tokens, seed=tokens)


_CACHE: dict[str, PackedExperts] = {}


def _q4_0_experts() -> PackedExperts:
    if "q4_0" not in _CACHE:
        _CACHE["q4_0"] = _experts("Q4_0", None, "Q4_0", SILU, 4, SMALL)
    return _CACHE["q4_0"]


@pytest.mark.parametrize(("gate", "up", "down", "activation", "top_k"), [
    ("Q4_K", "Q8_0", "Q6_K", SILU, 2),  # two gate/up shards, K-quants
    ("Q4_1", None, "Q8_0", SILU, 1),
    ("MXFP4", None, "MXFP4", CLAMPED_SWIGLU, 4),  # gpt-oss: biases, clamped SwiGLU
    ("Q8_0", "Q5_0", "Q4_0", CLAMPED_SWIGLU, 2),
])
def test_other_formats_and_activations_are_the_python_paths_bits(gate: str, up: str | None, down: str,
                                                                   activation: str, top_k: int) -> None:
    experts = _experts(gate, up, down, activation, top_k)
    for tokens in (1, 2, 3, 5, 17, 64, 129, 300):
        _check(experts, tokens, seed=1000 + tokens)


def test_the_skewed_expert_is_past_the_crossover() -> None:
    """The routing above sends expert 0 more than 128 rows at 300 tokens (oneDNN's crossover for dense
    linears: the op must keep them on the kernel, as `quant_linear(..., per_row=True)` does)."""
    _, chosen, _ = _routing(300, SMALL[0], 4, 300)
    assert int((chosen == 0).sum()) > 128


def test_an_expert_id_out_of_range_is_refused() -> None:
    experts = _q4_0_experts()
    *gate_up, down = experts.shards()
    x, chosen, weights = _routing(4, SMALL[0], 4, 0)
    chosen[1, 2] = EXPERTS
    with pytest.raises(RuntimeError, match="out of"):
        packed_moe_experts(x, chosen, weights, gate_up, down, None, True, MOE_SILU)


def test_no_tokens_give_an_empty_output() -> None:
    experts = _q4_0_experts()
    x = torch.empty(0, SMALL[0])
    out = experts.routed(x, torch.empty(0, 4, dtype=torch.int64), torch.empty(0, 4))
    assert out.shape == (0, SMALL[0])


def test_reference_backend_keeps_the_python_path() -> None:
    """Under the reference backend `routed` groups in Python and runs `forward` (the op is not called)."""
    experts = _q4_0_experts()
    x, chosen, weights = _routing(9, SMALL[0], 4, 3)
    rows = LinearRows(ops=ops.REFERENCE)
    with torch.inference_mode():
        got = experts.routed(x, chosen, weights, rows)
        expected = experts(x, *group_by_expert(chosen, weights, EXPERTS), rows)
    assert torch.equal(got, expected)


@pytest.mark.parametrize(("router", "norm"), [(MOE_SOFTMAX_TOPK, True), (MOE_SOFTMAX_TOPK, False),
                                              (MOE_TOPK_SOFTMAX, False)])
@pytest.mark.parametrize("tokens", [1, 2, 7, 64, 300])
def test_route_op_is_the_torch_routers_bits(router: int, norm: bool, tokens: int) -> None:
    """`ops.moe.moe_route` against `SparseMoE.route`'s torch ops (ties included: rounded logits)."""
    gen = torch.Generator().manual_seed(tokens)
    logits = torch.randn(tokens, 32, generator=gen)
    logits[: tokens // 2] = (logits[: tokens // 2] * 4).round() / 4  # ties among the top-k
    k = 4
    if router == MOE_SOFTMAX_TOPK:
        weights, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
        if norm:
            weights /= weights.sum(dim=-1, keepdim=True)
    else:
        top, experts = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(top, dim=1, dtype=top.dtype)
    got_weights, got_experts = moe_route(logits, k, router, norm)
    assert torch.equal(got_experts, experts) and torch.equal(got_weights, weights)
