"""Multi-token decode on CUDA (issue 25): a speculative row's 1 + k positions run as decode rows
(engine/model/runner.py); a chunk of 1 + k tokens over a cached context through the prefill kernel
must agree with them too: against the reference, and row i of the chunk against the decode kernel at context
``context_len - k + i`` (what plain decoding would have computed one token at a time). Float and
int8 caches. Runs when a GPU is lent (gpu-marked)."""

from __future__ import annotations

import pytest
import torch

import ops
from ops.reference.kv_quant import quantize_rows
from tests.ops.paged_inputs import HEAD_PAIRS, TOLERANCE, make_prefill

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
pytestmark = [pytest.mark.gpu, needs_cuda]


def spec_batch(block_size: int) -> list[tuple[int, int]]:
    """(1 + k, context_len) rows of a verification step, plain decode rows (k = 0) among them."""
    return [(5, 40), (1, 17), (9, 9 + 3 * block_size), (2, block_size + 1), (8, 600), (1, 1), (4, block_size)]


@pytest.mark.parametrize("cache", ["float", "int8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_chunk_over_cached_context_is_plain_decode_token_by_token(head_size: int, dtype: torch.dtype,
                                                                  cache: str) -> None:
    for block_size in (8, 16, 32):
        for heads in HEAD_PAIRS:
            pairs = spec_batch(block_size)
            query, key_cache, value_cache, tables, starts, lens = make_prefill(
                pairs, heads, head_size, block_size, torch.float32, "cpu", head_size + block_size)
            if cache == "int8":
                key_cache, value_cache = quantize_rows(key_cache), quantize_rows(value_cache)
            else:
                key_cache, value_cache = key_cache.to(dtype), value_cache.to(dtype)
            args = [t.cuda() for t in (query.to(dtype), key_cache, value_cache, tables, starts, lens)]
            scale = head_size**-0.5
            chunk = ops.paged_prefill_attention(*args, scale)
            tol = TOLERANCE[dtype]
            torch.testing.assert_close(chunk.float(), ops.reference.paged_prefill_attention(*args, scale).float(),
                                       atol=tol, rtol=tol)
            # every row alone, as the decode kernel sees it: its own position is the context's last
            rows = torch.cat([torch.arange(q_len) for q_len, _ in pairs])
            seq_of_row = torch.cat([torch.full((q_len,), s) for s, (q_len, _) in enumerate(pairs)])
            row_lens = torch.tensor([ctx - q_len + 1 + int(i) for (q_len, ctx), i in
                                     zip((pairs[s] for s in seq_of_row.tolist()), rows, strict=True)],
                                    dtype=torch.int32, device="cuda")
            decode = ops.paged_attention(args[0].contiguous(), args[1], args[2], args[3][seq_of_row.cuda()],
                                         row_lens, scale)
            torch.testing.assert_close(chunk.float(), decode.float(), atol=tol, rtol=tol)
    ops.raise_device_errors(sync=True)
