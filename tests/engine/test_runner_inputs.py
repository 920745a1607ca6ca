"""The runner's bulk inputs: positions, slots and block tables computed from the scheduler's
output equal the per-token formula, and the block-table tensor kept across steps equals a fresh
one after tables grow, blocks are copied on write, and the batch changes."""

from __future__ import annotations

import torch

from common.sampling_params import SamplingParams
from engine.model.runner import BlockTableBuffer, ModelRunner
from engine.sched.output import ScheduledSeq
from engine.sched.sequence import Request, Sequence

BS = 4


def _seq(length: int, prompt: int = 1) -> Sequence:
    """A sequence of `length` tokens, the first `prompt` of them its prompt (one-token items past
    the prompt are decode rows)."""
    request = Request(request_id=f"r{length}", prompt_token_ids=list(range(prompt)), params=SamplingParams())
    return Sequence(request=request, index=0, token_ids=list(range(length)), num_prompt_tokens=prompt)


def _item(seq: Sequence, start: int, count: int, table: list[int], write_from: int = 0) -> ScheduledSeq:
    tokens = seq.token_ids[start : start + count]
    return ScheduledSeq(seq=seq, token_ids=tokens, start=start, block_table=table,
                        sample=start + count == len(seq.token_ids), write_from=write_from)


def _fresh(items: list[ScheduledSeq]) -> torch.Tensor:
    width = max(len(s.block_table) for s in items)
    return torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in items], dtype=torch.int32)


def test_persistent_block_tables_follow_growth_cow_and_batch_changes() -> None:
    a, b, c = _seq(8), _seq(3), _seq(5)
    ta, tb, tc = [5, 7], [9], [2, 3]
    buffer = BlockTableBuffer()
    step = [_item(a, 7, 1, ta), _item(b, 2, 1, tb)]
    first = buffer.build(step)
    assert torch.equal(first[:, :2], _fresh(step))
    ta.append(11)  # a crossed a block boundary
    tb[-1] = 12  # b's last block was copied on write
    again = buffer.build(step)
    assert again is first  # patched in place, not rebuilt
    assert torch.equal(again[:, :3], _fresh(step))
    changed = [_item(c, 4, 1, tc), *step]
    assert torch.equal(buffer.build(changed)[:, :3], _fresh(changed))


def test_positions_slots_and_metadata_match_the_per_token_formula() -> None:
    runner = ModelRunner(None, [], [], BS, torch.device("cpu"))  # type: ignore[arg-type]
    long, chunked, decode = _seq(6), _seq(11), _seq(9)
    items = [
        _item(decode, 8, 1, [4, 1, 8]),
        _item(long, 0, 6, [2, 6], write_from=4),  # the first block came from the prefix cache
        _item(chunked, 4, 5, [7, 3, 10]),  # a middle chunk: no sample
    ]
    batch = runner.prepare(items)
    order = [items[1], items[2], items[0]]  # prefills first
    want_pos = [p for s in order for p in range(s.start, s.start + len(s.token_ids))]
    want_slots = [-1 if p < s.write_from else s.block_table[p // BS] * BS + p % BS
                  for s in order for p in range(s.start, s.start + len(s.token_ids))]
    assert batch.positions.tolist() == want_pos
    assert batch.meta.slot_mapping.tolist() == want_slots
    assert batch.input_ids.tolist() == [t for s in order for t in s.token_ids]
    assert batch.meta.prefill_query_start == [0, 6, 11]
    assert batch.meta.prefill_context_lens == [6, 9]
    assert batch.meta.decode_context_lens.tolist() == [9]
    assert batch.sampling == [items[1], items[0]]
    assert batch.sample_rows is not None and batch.sample_rows.tolist() == [5, 11]


def _spec_item(seq: Sequence, proposals: list[int], table: list[int]) -> ScheduledSeq:
    return ScheduledSeq(seq=seq, token_ids=[seq.token_ids[-1], *proposals], start=len(seq.token_ids) - 1,
                        block_table=table, sample=False, num_spec=len(proposals))


def test_a_speculative_row_attends_as_decode_rows_over_its_table() -> None:
    runner = ModelRunner(None, [], [], BS, torch.device("cpu"))  # type: ignore[arg-type]
    verified, decode, prompt = _seq(9), _seq(6), _seq(5)
    items = [_spec_item(verified, [70, 71, 72], [4, 1, 8]), _item(decode, 5, 1, [2, 6]), _item(prompt, 0, 5, [3, 7])]
    batch = runner.prepare(items)
    assert batch.meta.num_prefills == 1 and batch.meta.num_prefill_tokens == 5  # the prompt only
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11, 5]
    assert batch.meta.decode_context_lens.tolist() == [9, 10, 11, 12, 6]  # one row per verified position
    tables = batch.meta.decode_block_tables[:, :3].tolist()
    assert tables[:4] == [[4, 1, 8]] * 4 and tables[4][:2] == [2, 6]
    assert batch.spec_rows is not None and batch.spec_rows.tolist() == [5, 6, 7, 8]
    assert batch.sampling == [items[2], items[1]]
    assert batch.sample_rows is not None and batch.sample_rows.tolist() == [4, 9]


def test_verified_positions_attend_bit_for_bit_as_plain_decode_steps() -> None:
    """Position j of a speculative row gets exactly the attention output the decode step at that
    position gives (the prefill kernel's sums run in another order: near ties could flip)."""
    from engine.model.attention import PagedAttention

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 9, 3, 64
    key_cache, value_cache = (torch.randn(12, kv_heads, BS, dim, generator=gen) for _ in range(2))
    attention = PagedAttention(heads, kv_heads, dim, dim**-0.5)
    seq, table = _seq(23), [9, 2, 5, 11, 0, 7, 3]  # 22 cached tokens, 5 verified positions over 27 slots
    proposals = [80, 81, 82, 83]
    query = torch.randn(1 + len(proposals), heads, dim, generator=gen)
    runner = ModelRunner(None, [], [], BS, torch.device("cpu"))  # type: ignore[arg-type]
    meta = runner.prepare([_spec_item(seq, proposals, table)]).meta
    verified = attention(query, query, query, (key_cache, value_cache), meta)
    for j in range(len(proposals) + 1):
        step = _seq(23 + j)
        plain = runner.prepare([_item(step, 22 + j, 1, table)]).meta
        alone = attention(query[j : j + 1], query, query, (key_cache, value_cache), plain)
        assert torch.equal(verified[j : j + 1], alone), j


def test_prompt_rows_are_the_exact_rows_a_recompute_keeps_its_decode_rows() -> None:
    """Exact (fp32-activation) rows are the prompt positions: a recomputed sequence's generated
    tokens leave them, as in the decode steps that made them; a one-token chunk at a prompt position
    (what chunked prefill can leave) is a prefill row, not a decode."""
    runner = ModelRunner(None, [], [], BS, torch.device("cpu"))  # type: ignore[arg-type]
    recomputed, fresh, last, decode = _seq(9, prompt=5), _seq(6, prompt=6), _seq(7, prompt=7), _seq(4, prompt=3)
    items = [_item(decode, 3, 1, [1]), _item(recomputed, 0, 9, [2, 3, 4]), _item(fresh, 0, 6, [5, 6]),
             _item(last, 6, 1, [7, 8])]
    batch = runner.prepare(items)
    assert batch.meta.num_prefills == 3 and batch.meta.prefill_query_start == [0, 9, 15, 16]
    assert batch.inputs.prefill_exact_lens == [5, 6, 1]
    assert batch.inputs.exact_ranges == ((0, 5), (9, 16))
    assert runner.prepare(items[2:]).inputs.exact_ranges is None  # every prefill row a prompt row
