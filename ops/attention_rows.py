"""Prefill attention computed row by row with the decode kernel's arithmetic.

Under ``OpsPolicy.fixed_order`` (:mod:`ops.policy`) a prompt row's attention must be the bits decoding would
give the same token: then a chunked prefill equals a whole one, a recomputed sequence (recompute
preemption) writes the K/V its decode steps wrote, and a row's answer does not depend on what
else its step holds. The decode kernel attends each (sequence, kv head) over its context in one
fixed order, so each prefill row is handed to it as a one-token "sequence" whose context ends at
that row's position (``context_len - q_len + i + 1``) through its sequence's block table.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

DecodeAttention = Callable[..., torch.Tensor]


def rows_as_sequences(block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                      context_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tables [T, max_blocks], lengths [T])`` int32: each prefill row as a decode sequence."""
    starts = query_start_loc.to(torch.int64)
    q_lens = starts[1:] - starts[:-1]
    seq_of_row = torch.repeat_interleave(torch.arange(q_lens.shape[0]), q_lens)
    within = torch.arange(int(starts[-1]) - int(starts[0])) - (starts[:-1] - starts[0])[seq_of_row]
    lengths = context_lens.to(torch.int64)[seq_of_row] - q_lens[seq_of_row] + within + 1
    return block_tables.index_select(0, seq_of_row).contiguous(), lengths.to(torch.int32)


def prefill_as_decode(decode: DecodeAttention, query: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                      context_lens: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """``paged_prefill_attention``'s result through ``decode`` (``ops.paged_attention`` with the
    layer's options) one row at a time: same contract, decode's per-row bits."""
    tables, lengths = rows_as_sequences(block_tables, query_start_loc, context_lens)
    first = int(query_start_loc[0])
    rows = slice(first, first + lengths.shape[0])
    decode(query[rows], key_cache, value_cache, tables, lengths, scale, out=out[rows])
    return out
