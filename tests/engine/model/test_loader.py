"""Loading: clear errors for bad paths and architectures, dtypes, and the KV cache arithmetic."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model import (
    ModelLoadError,
    UnsupportedModelError,
    allocate_kv_caches,
    kv_bytes_per_block,
    load_model,
    resolve_dtype,
)
from tests.fixtures.models import PagedHarness, Seq


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"does not exist.*fetch-model"):
        load_model(tmp_path / "nowhere")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        load_model(tmp_path)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf"):
        load_model(tmp_path / "weights.bin")


def test_non_llama_architecture_is_rejected(tmp_path: Path) -> None:
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match=r"unsupported model architecture 'gpt2'.*llama"):
        load_model(tmp_path)


def test_missing_weights_are_reported(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    (tmp_path / "config.json").write_bytes((tiny_llama_dir / "config.json").read_bytes())
    weights = load_file(str(tiny_llama_dir / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"lacks 1 weights.*layers\.1\.mlp\.gate_up_proj"):
        load_model(tmp_path)


def test_unknown_dtype() -> None:
    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype("float16") is torch.float16
    with pytest.raises(ModelLoadError, match="unsupported dtype 'int8'"):
        resolve_dtype("int8")


def test_bf16_model_runs_close_to_fp32(tiny_llama_dir: Path) -> None:
    tokens = torch.randint(0, 320, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    fp32 = PagedHarness(load_model(tiny_llama_dir)).step([(Seq(tokens), 20)], [])
    model = load_model(tiny_llama_dir, dtype="bf16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    harness = PagedHarness(model)
    assert harness.kv_caches[0][0].dtype is torch.bfloat16
    bf16 = harness.step([(Seq(tokens), 20)], [])
    assert bf16.dtype is torch.float32
    assert (bf16.argmax(-1) == fp32.argmax(-1)).float().mean() > 0.8


def test_kv_cache_shapes_and_bytes(tiny_llama_dir: Path) -> None:
    model = load_model(tiny_llama_dir)
    caches = allocate_kv_caches(model, 7, 16, torch.float16, "cpu")
    assert len(caches) == 2
    assert caches[0][0].shape == (7, 2, 16, 16) and caches[0][1].dtype is torch.float16
    per_block = sum(k.nbytes + v.nbytes for k, v in caches) // 7
    assert kv_bytes_per_block(model, 16, torch.float16) == per_block == 2 * 2 * 16 * 2 * 16 * 2
