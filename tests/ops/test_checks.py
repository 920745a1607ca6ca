"""Argument checks: wrong shapes, dtypes and devices fail in Python with messages a user can act on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ops


def attention_args(**overrides: torch.Tensor) -> dict[str, torch.Tensor]:
    args = {
        "query": torch.randn(2, 8, 64),
        "key_cache": torch.randn(4, 2, 16, 64),
        "value_cache": torch.randn(4, 2, 16, 64),
        "block_tables": torch.zeros(2, 2, dtype=torch.int32),
        "context_lens": torch.ones(2, dtype=torch.int32),
    }
    return {**args, **overrides}


@pytest.mark.parametrize(
    ("override", "error", "message"),
    [
        ({"query": torch.randn(2, 8)}, ValueError, "query must be 3-D"),
        ({"query": torch.randn(2, 8, 32)}, ValueError, "head_size 32"),
        ({"query": torch.randn(2, 7, 64)}, ValueError, "multiple of num_kv_heads"),
        ({"query": torch.randn(2, 8, 64).half()}, TypeError, "differs from the cache dtype"),
        ({"block_tables": torch.zeros(2, 2, dtype=torch.int64)}, TypeError, "block_tables must have dtype int32"),
        ({"context_lens": torch.ones(3, dtype=torch.int32)}, ValueError, "num_seqs=2"),
        ({"context_lens": torch.full((2,), 33, dtype=torch.int32)}, ValueError, r"lie in \[0, 32\]"),
        ({"key_cache": torch.randn(4, 16, 2, 64).transpose(1, 2)}, ValueError, "must be contiguous"),
        ({"value_cache": torch.randn(4, 2, 8, 64)}, ValueError, "must match in shape"),
        ({"key_cache": torch.randn(4, 2, 16, 64).int()}, TypeError, "key_cache must have dtype"),
    ],
)
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_paged_attention_rejects(backend: str, override: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        ops.paged_attention(**attention_args(**override), scale=1.0, policy=ops.OpsPolicy.of(backend))


def test_paged_attention_rejects_wrong_out() -> None:
    with pytest.raises(ValueError, match="out must match query"):
        ops.paged_attention(**attention_args(), scale=1.0, out=torch.empty(2, 8, 32))


def test_mixed_devices_are_named() -> None:
    args = attention_args(context_lens=torch.ones(2, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="context_lens on meta"):
        ops.paged_attention(**args, scale=1.0)


def test_reshape_and_cache_rejects() -> None:
    key_cache, value_cache = torch.zeros(4, 2, 16, 64), torch.zeros(4, 2, 16, 64)
    key = torch.randn(3, 2, 64)
    with pytest.raises(TypeError, match="slot_mapping must have dtype int64"):
        ops.reshape_and_cache(key, key, key_cache, value_cache, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="does not fit the cache"):
        ops.reshape_and_cache(torch.randn(3, 4, 64), key, key_cache, value_cache, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="same number of tokens"):
        ops.reshape_and_cache(key, key, key_cache, value_cache, torch.zeros(2, dtype=torch.int64))


def test_copy_and_swap_reject() -> None:
    cache = torch.zeros(4, 2, 16, 64)
    with pytest.raises(ValueError, match=r"block_mapping must be \[n, 2\]"):
        ops.copy_blocks([cache], [cache], torch.zeros(2, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="1 key caches but 0 value caches"):
        ops.copy_blocks([cache], [], torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="share block shape"):
        ops.swap_blocks(cache, torch.zeros(4, 2, 8, 64), torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="must be on the CPU"):
        ops.swap_blocks(cache, cache.clone(), torch.zeros(1, 2, dtype=torch.int64, device="meta"))


def test_out_of_range_block_is_an_error_not_a_crash() -> None:
    args = attention_args(block_tables=torch.full((2, 2), 99, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="out of range"):
        ops.paged_attention(**args, scale=1.0)


def test_unknown_backend() -> None:
    with pytest.raises(ValueError, match="unknown attention backend"):
        ops.OpsPolicy.of("flash")


def test_build_error_carries_compiler_output(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from ops import build

    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    broken = tmp_path / "csrc"
    (broken / "cpu").mkdir(parents=True)
    (broken / "cpu" / "broken.cpp").write_text("this is not C++;\n")
    monkeypatch.setattr(build, "CSRC", broken)
    with pytest.raises(build.KernelBuildError, match="this is not C"):
        build._load("cpu", ("cpu/broken.cpp",), extra_cflags=["-O0"])
    assert build.cache_root() == tmp_path / "kernels"


def prefill_args(**overrides: torch.Tensor) -> dict[str, torch.Tensor]:
    args = {
        "query": torch.randn(5, 8, 64),
        "key_cache": torch.randn(4, 2, 16, 64),
        "value_cache": torch.randn(4, 2, 16, 64),
        "block_tables": torch.zeros(2, 2, dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 2, 5], dtype=torch.int32),
        "context_lens": torch.tensor([2, 20], dtype=torch.int32),
    }
    return {**args, **overrides}


@pytest.mark.parametrize(
    ("override", "error", "message"),
    [
        ({"query_start_loc": torch.tensor([0, 2, 5])}, TypeError, "query_start_loc must have dtype int32"),
        ({"query_start_loc": torch.tensor([0, 5], dtype=torch.int32)}, ValueError, "num_seqs=2"),
        ({"query_start_loc": torch.tensor([0, 3, 2], dtype=torch.int32)}, ValueError, "non-decreasing"),
        ({"query_start_loc": torch.tensor([0, 2, 6], dtype=torch.int32)}, ValueError, "non-decreasing"),
        ({"context_lens": torch.tensor([1, 20], dtype=torch.int32)}, ValueError, "cover its query tokens"),
        ({"context_lens": torch.tensor([2, 33], dtype=torch.int32)}, ValueError, "32 slots"),
        ({"query": torch.randn(5, 8, 32)}, ValueError, "head_size 32"),
        ({"block_tables": torch.zeros(3, 2, dtype=torch.int32)}, ValueError, "num_seqs=2"),
    ],
)
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_paged_prefill_attention_rejects(backend: str, override: dict, error: type[Exception], message: str) -> None:
    """Length errors come from the C++ kernel (auto) or from Python (reference), with one message."""
    with pytest.raises(error, match=message):
        ops.paged_prefill_attention(**prefill_args(**override), scale=1.0, policy=ops.OpsPolicy.of(backend))


def test_fused_ops_reject() -> None:
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="weight must be a contiguous \\[64\\]"):
        ops.rms_norm(x, torch.ones(63), 1e-5)
    with pytest.raises(ValueError, match="residual"):
        ops.fused_add_rms_norm(x, torch.randn(3, 32), torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="even last dimension"):
        ops.silu_and_mul(torch.randn(3, 7))
    q, k = torch.randn(2, 4, 8), torch.randn(2, 2, 8)
    empty = torch.empty(0, 2, 4, 8)
    with pytest.raises(TypeError, match="cos_sin must have dtype float32"):
        ops.rotary_embedding_and_cache(torch.zeros(2, dtype=torch.int64), q, k, k, torch.randn(9, 8).double(),
                                       empty, empty, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="positions \\(3\\) and query \\(2\\)"):
        ops.rotary_embedding_and_cache(torch.zeros(3, dtype=torch.int64), q, k, k, torch.randn(9, 8), empty, empty,
                                       torch.zeros(2, dtype=torch.int64))


def test_a_dead_builders_lock_is_removed_and_a_live_builder_waited_for(tmp_path: Path) -> None:
    """torch's `lock` file left by a killed builder goes once the flock is ours; a live builder's
    flock (here another process holding it) is waited for, and released when that process dies."""
    import subprocess
    import sys
    import time

    from ops.build import _builder_lock

    (tmp_path / "lock").touch()
    with _builder_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(600)"), str(tmp_path / "builder.flock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        import fcntl
        with (tmp_path / "builder.flock").open("a") as probe, pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the live holder has it
        holder.kill()  # dies holding it, as a killed build would
        holder.wait()
        started = time.monotonic()
        with _builder_lock(tmp_path):
            pass
        assert time.monotonic() - started < 30
    finally:
        holder.kill()
