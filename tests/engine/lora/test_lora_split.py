"""How an adapter is split over tensor-parallel ranks (`engine.model.lora.placement`) and sent to
them (`engine.model.lora.mirror`): a column-parallel target's part on a rank gives exactly that
rank's output rows of the whole product (its own heads, or the KV head it replicates), the ranks'
parts of a row-parallel target sum to the whole product, and the wire message round-trips bit for
bit (an empty one empties a slot)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from engine.model.lora.mirror import decode, encode
from engine.model.lora.placement import ROW_PARALLEL, TARGETS, Weights, full_shape, shard_weights
from engine.model.sharding import TPShard
from engine.model.spec import ModelSpec

HEAD_DIM = 16  # hidden 64 over 4 heads


def _spec(kv_heads: int) -> ModelSpec:
    return ModelSpec.from_hf_config(LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=2, num_attention_heads=4,
                                                num_key_value_heads=kv_heads))


def _adapter(spec: ModelSpec, rank: int = 3, seed: int = 0) -> Weights:
    g = torch.Generator().manual_seed(seed)
    weights: Weights = {}
    for layer in range(spec.num_layers):
        for module in TARGETS:
            out, into = full_shape(spec, module)
            weights[(layer, module)] = (torch.randn(rank, into, generator=g), torch.randn(out, rank, generator=g))
    return weights


def _rows(module: str, rank: int, kv_heads: int) -> tuple[int, int]:
    """The output rows `[lo, hi)` rank `rank` of 2 holds of a column-parallel target, written out
    from the layout (4 query heads, 2 per rank; KV heads split, or head 0 on both ranks when there
    is one; 64 MLP features per rank)."""
    if module == "q_proj":
        return rank * 2 * HEAD_DIM, (rank + 1) * 2 * HEAD_DIM
    if module in ("k_proj", "v_proj"):
        head = rank if kv_heads == 2 else 0
        return head * HEAD_DIM, (head + 1) * HEAD_DIM
    return rank * 64, (rank + 1) * 64


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_rank_parts_give_the_whole_product(kv_heads: int) -> None:
    spec = _spec(kv_heads)
    weights = _adapter(spec)
    parts = [shard_weights(weights, TPShard(r, 2), spec) for r in range(2)]
    g = torch.Generator().manual_seed(1)
    for key, (a, b) in weights.items():
        module = key[1]
        x = torch.randn(5, a.shape[1], generator=g, dtype=torch.float64)
        whole = x @ a.double().T @ b.double().T
        if module in ROW_PARALLEL:  # A's input columns split evenly, B whole; the partial sums add up
            width = a.shape[1] // 2
            total = torch.zeros_like(whole)
            for r, part in enumerate(parts):
                pa, pb = part[key]
                assert pa.shape == (a.shape[0], width) and torch.equal(pb, b)
                total += x[:, r * width : (r + 1) * width] @ pa.double().T @ pb.double().T
            torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)
        else:  # A whole, B's rows of the rank's output slice
            for r, part in enumerate(parts):
                pa, pb = part[key]
                lo, hi = _rows(module, r, kv_heads)
                assert torch.equal(pa, a) and pb.shape == (hi - lo, b.shape[1])
                torch.testing.assert_close(x @ pa.double().T @ pb.double().T, whole[:, lo:hi], rtol=1e-12, atol=1e-12)


def test_one_rank_keeps_the_adapter_as_it_is() -> None:
    spec = _spec(2)
    weights = _adapter(spec)
    assert shard_weights(weights, TPShard(), spec) is weights


def test_the_message_round_trips() -> None:
    weights = _adapter(_spec(2), rank=5, seed=3)
    weights[(1, "down_proj")] = (torch.randn(1, 3), torch.randn(2, 1))  # an odd number of values in all
    slot, back = decode(encode(2, weights))
    assert slot == 2 and sorted(back) == sorted(weights)
    for key, (a, b) in weights.items():
        assert torch.equal(back[key][0], a) and torch.equal(back[key][1], b), key
    assert decode(encode(1, {})) == (1, {})  # empties slot 1
