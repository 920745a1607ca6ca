"""Each rank's part of the model, read from the checkpoint, against the full model's weights:
the ranks' column slices stack back to the full q/k/v and gate/up, their row slices to o and
down, their vocab rows to the embedding; replicated KV heads are the ones each rank's query heads
read. Slicing a safetensors file (`get_slice`) and cutting full tensors give the same parts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.llama import LlamaForCausalLM
from engine.model.loader import _iter_directory_weights, load_model
from engine.model.sharding import TPShard
from engine.model.spec import UnsupportedModelError
from tests.fixtures.models import make_tiny_model_dir


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Biases on q/k/v (qwen2), a vocabulary 3 does not divide, tied embeddings, 6 heads / 3 KV heads."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-qwen"), "qwen2", vocab_size=322, num_attention_heads=6,
                               num_key_value_heads=3, hidden_size=96, intermediate_size=192, tie_word_embeddings=True)


def _parts(model: LlamaForCausalLM, layer: int = 0) -> dict[str, torch.Tensor]:
    attn, mlp = model.model.layers[layer].self_attn, model.model.layers[layer].mlp
    q, k, v = attn.qkv_proj.weight.split([attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim,
                                          attn.num_kv_heads * attn.head_dim])
    gate, up = mlp.gate_up_proj.weight.chunk(2)
    parts = {"q": q, "k": k, "v": v, "o": attn.o_proj.weight, "gate": gate, "up": up, "down": mlp.down_proj.weight,
             "embed": model.model.embed_tokens.weight, "norm": model.model.norm.weight}
    if attn.qkv_proj.bias is not None:
        parts["qkv_bias"] = attn.qkv_proj.bias
    return parts


def _ranks(path: Path, size: int) -> list[LlamaForCausalLM]:
    return [load_model(path, "float32", shard=TPShard(rank, size)) for rank in range(size)]


@pytest.mark.parametrize(("model", "size"), [("tiny", 2), ("tiny", 4), ("qwen", 3)])
def test_rank_slices_stack_back_to_the_full_weights(model: str, size: int, tiny_llama_dir: Path,
                                                    qwen_dir: Path) -> None:
    path = tiny_llama_dir if model == "tiny" else qwen_dir
    full = load_model(path, "float32")
    spec = full.spec
    ranks = _ranks(path, size)
    whole, parts = _parts(full), [_parts(r) for r in ranks]
    split_kv = ("k", "v") if spec.num_kv_heads >= size else ()  # else replicated: the next test
    for name in ("q", *split_kv, "gate", "up"):
        torch.testing.assert_close(torch.cat([p[name] for p in parts]), whole[name], rtol=0, atol=0)
    for name in ("o", "down"):
        torch.testing.assert_close(torch.cat([p[name] for p in parts], dim=1), whole[name], rtol=0, atol=0)
    for p in parts:
        torch.testing.assert_close(p["norm"], whole["norm"], rtol=0, atol=0)
    per = -(-spec.vocab_size // size)
    rows = [p["embed"][:per] for p in parts]  # rank 0 of a tied model holds every row; it reads the first `per`
    torch.testing.assert_close(torch.cat(rows)[: spec.vocab_size], whole["embed"], rtol=0, atol=0)
    assert torch.cat(rows)[spec.vocab_size :].abs().sum() == 0  # the last rank's padding
    torch.testing.assert_close(ranks[0].lm_head.weight, full.lm_head.weight, rtol=0, atol=0)
    assert all(r.lm_head.weight.shape[0] == 0 for r in ranks[1:])
    if "qkv_bias" in whole:
        q_size = spec.num_heads * spec.head_dim
        q_bias = torch.cat([p["qkv_bias"][: q_size // size] for p in parts])
        torch.testing.assert_close(q_bias, whole["qkv_bias"][:q_size], rtol=0, atol=0)


def test_kv_heads_replicate_past_their_count(tiny_llama_dir: Path) -> None:
    """4 ranks over 2 KV heads: ranks 0-1 hold KV head 0, ranks 2-3 head 1 (their query heads' group)."""
    full = _parts(load_model(tiny_llama_dir, "float32"))
    head_dim = full["k"].shape[0] // 2
    for rank, part in enumerate(_parts(r) for r in _ranks(tiny_llama_dir, 4)):
        kv_head = rank * 2 // 4
        torch.testing.assert_close(part["k"], full["k"][kv_head * head_dim : (kv_head + 1) * head_dim], rtol=0, atol=0)
        torch.testing.assert_close(part["v"], full["v"][kv_head * head_dim : (kv_head + 1) * head_dim], rtol=0, atol=0)


def test_reading_slices_equals_cutting_full_tensors(qwen_dir: Path) -> None:
    shard = TPShard(1, 3)
    sliced = load_model(qwen_dir, "float32", shard=shard)  # safetensors get_slice
    cut = LlamaForCausalLM(sliced.spec, shard)
    cut.load_weights(_iter_directory_weights(qwen_dir))  # whole tensors, narrowed in load_weights
    for (name, a), (_, b) in zip(sliced.state_dict().items(), cut.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_a_split_that_does_not_divide_the_heads_is_refused(tiny_llama_dir: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size 3 does not divide num_attention_heads 4"):
        load_model(tiny_llama_dir, "float32", shard=TPShard(0, 3))
