"""`pagedserve plan`: the capacity arithmetic, the 8B walk-through, config.json input, bad flags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.sizes import parse_size
from pagedserve.cli import main
from pagedserve.plan.model_shape import KVShape, PlanError, read_model_dir
from pagedserve.plan.planner import kv_pool_bytes, plan_capacity

GIB = 1 << 30
EIGHT_B = ["--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "fp16"]
EIGHT_B_BUDGET = ["--gpu-memory", "80GiB", "--gpu-memory-utilization", "0.9", "--weights", "16GiB",
                  "--workspace", "0", "--block-size", "16", "--avg-tokens", "512", "--max-model-len", "8192"]


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors (a non-integer --layers) exit 2 the same way
        return int(exc.code or 0)


@pytest.mark.parametrize(("text", "expected"), [
    ("80GiB", 80 * GIB), ("16G", 16 * GIB), ("512MiB", 512 << 20), ("4096", 4096),
    ("1.5GB", 1_500_000_000), ("2k", 2048), ("0", 0), ("1e3", 1000),
])
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["-1GiB", "lots", "", "5 parsecs", "Gi"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)


def test_pool_arithmetic_is_exact() -> None:
    # 0.9 x 80 GiB in floating point is one ulp short of 72 GiB; the planner must not lose a block.
    assert kv_pool_bytes(80 * GIB, 0.9, 16 * GIB, 0) == 56 * GIB


def test_eight_b_walkthrough_via_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *EIGHT_B, *EIGHT_B_BUDGET, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["block_bytes"] == 2 * (1 << 20)
    assert plan["num_blocks"] == 28672
    assert plan["blocks_per_seq"] == 32
    assert plan["max_seqs_paged"] == 896
    assert plan["max_seqs_contiguous"] == 56
    assert plan["gain"] == 16.0


def test_text_report_names_the_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *EIGHT_B, *EIGHT_B_BUDGET]) == 0
    out = capsys.readouterr().out
    assert "28672" in out and "paged 896" in out and "contiguous 56" in out and "16.0x" in out


def test_partial_last_block_and_fp32() -> None:
    shape = KVShape(num_layers=2, num_kv_heads=1, head_dim=4, dtype_bytes=4)  # 64 B per token
    plan = plan_capacity(shape, gpu_memory=64 * 100, utilization=1.0, weights=0, workspace=0,
                         block_size=4, avg_tokens=9, max_model_len=20)
    assert plan.block_bytes == 256 and plan.num_blocks == 25
    assert plan.blocks_per_seq == 3  # 9 tokens need 3 blocks of 4
    assert plan.max_seqs_paged == 8 and plan.max_seqs_contiguous == 5


def test_model_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
              "hidden_size": 576, "torch_dtype": "bfloat16", "max_position_embeddings": 2048}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 1000)
    info = read_model_dir(tmp_path)
    assert info.shape == KVShape(30, 3, 64, 2) and info.weights == 1000 and info.max_model_len == 2048
    assert main(["plan", "--model", str(tmp_path), "--gpu-memory", "1GiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["bytes_per_token"] == 2 * 30 * 3 * 64 * 2 and plan["max_model_len"] == 2048
    assert plan["pool_bytes"] == int(0.9 * GIB) - 1000


def test_flags_override_model_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 30, "num_attention_heads": 9, "hidden_size": 576, "head_dim": 64}))
    assert main(["plan", "--model", str(tmp_path), "--layers", "2", "--dtype", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shape"] == {
        "num_layers": 2, "num_kv_heads": 9, "head_dim": 64, "dtype_bytes": 1, "scale_bytes": 0}


def test_int8_kv_cache_counts_the_row_scales(capsys: pytest.CaptureFixture[str]) -> None:
    """pagedserve's int8 rows end in a 2-byte fp16 scale: SmolLM2 costs 66 bytes per (token, head)
    row instead of bf16's 128, so the same pool holds 1.94x the tokens."""
    base = ["plan", "--layers", "30", "--kv-heads", "3", "--head-dim", "64", "--gpu-memory", "1GiB", "--json"]
    assert main([*base, "--kv-cache-dtype", "int8"]) == 0
    int8 = json.loads(capsys.readouterr().out)
    assert main([*base, "--kv-cache-dtype", "bf16"]) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert int8["bytes_per_token"] == 2 * 30 * 3 * (64 + 2) and int8["shape"]["scale_bytes"] == 2
    assert bf16["bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert int8["num_blocks"] / bf16["num_blocks"] >= 1.9


@pytest.mark.parametrize(("extra", "message"), [
    (["--layers", "-32"], "--layers must be a positive"),
    (["--block-size", "0"], "--block-size must be a positive"),
    (["--gpu-memory=-80GiB"], "negative"),
    (["--weights", "lots"], "invalid size"),
    (["--weights", "80GiB"], "smaller than one block"),
    (["--gpu-memory", "1MiB", "--weights", "0"], "smaller than one block"),
    (["--gpu-memory-utilization", "1.5"], "must be in (0, 1]"),
    (["--avg-tokens", "9000"], "exceeds --max-model-len"),
    (["--dtype", "fp12"], "unknown dtype"),
])
def test_bad_flags_exit_2_with_a_message(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(["plan", *EIGHT_B, *EIGHT_B_BUDGET, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_shape_and_unreadable_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(["plan", "--kv-heads", "8"]) == 2
    assert "--layers is required" in capsys.readouterr().err
    assert _exit_code(["plan", "--model", str(tmp_path / "nowhere")]) == 2
    assert "cannot read model config" in capsys.readouterr().err
    with pytest.raises(PlanError):
        KVShape(0, 1, 1, 2)
