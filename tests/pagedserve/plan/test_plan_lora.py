"""`pagedserve plan --max-loras N --max-lora-rank R`: the adapter slots come out of the KV pool,
sized by the model's projections (the formula the engine's slots follow:
tests/engine/lora/test_lora_memory.py checks the two agree)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.cli import main

CONFIG = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64,
          "intermediate_size": 128, "torch_dtype": "float32", "max_position_embeddings": 512}


def _plan(tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, int]:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert main(["plan", "--model", str(tmp_path), "--gpu-memory", "1GiB", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_lora_slots_come_out_of_the_pool(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = _plan(tmp_path, capsys)
    lora = _plan(tmp_path, capsys, "--max-loras", "3", "--max-lora-rank", "8")
    # per layer and rank: qkv (3 x 64 in, 64 + 2 x 32 out), o (64, 64), gate_up (2 x 64, 2 x 128), down (128, 64)
    per_rank = (3 * 64 + 64 + 64) + (64 + 64) + (2 * 64 + 256) + (128 + 64)
    assert lora["lora_bytes"] == 3 * 2 * 8 * per_rank * 4
    assert plain["pool_bytes"] - lora["pool_bytes"] == lora["lora_bytes"]


def test_tensor_parallel_slots_are_one_ranks_part(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = _plan(tmp_path, capsys, "--tensor-parallel-size", "2")
    lora = _plan(tmp_path, capsys, "--tensor-parallel-size", "2", "--max-loras", "3", "--max-lora-rank", "8")
    # per layer and rank on one of 2 ranks: qkv (3 x 64 in, 32 + 2 x 16 out), o (32 in, 64 out),
    # gate_up (2 x 64 in, 2 x 64 out), down (64 in, 64 out)
    per_rank = (3 * 64 + 32 + 2 * 16) + (32 + 64) + (2 * 64 + 128) + (64 + 64)
    assert lora["lora_bytes"] == 3 * 2 * 8 * per_rank * 4
    assert plain["pool_bytes"] - lora["pool_bytes"] == lora["lora_bytes"]


def test_lora_needs_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--layers", "2", "--kv-heads", "2", "--head-dim", "16", "--max-loras", "2"]) == 2
    assert "--max-loras needs --model" in capsys.readouterr().err
