"""AMX-INT8 tiles for the int8 rows of the Q4_0r8 / Q4_1r8 / Q8_0r8 kernels (csrc/cpu/quant_int8_amx.cpp): bit for
bit the VNNI path's output (``torch.equal``) at every row count, tile-partial ones included, with and
without bias and fp32 ``exact_rows`` ahead of the int8 ones. ``PAGEDSERVE_INT8_AMX`` (read at every
call) forces the path: ``0`` the VNNI kernel, ``all`` the tiles for every row (partial tiles too);
unset, whole tiles from 16 int8 rows, a last partial tile from 8 rows, the other rows on VNNI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ops.build import cpu_ops
from ops.quant import INTERLEAVED, Q4_0, Q4_1, Q8_0, QuantFormat, interleave
from ops.reference import quant as ref

ROWS = range(1, 71)  # 15, 16, 17, 31, 32, 33 and 64 among them: partial and whole tiles
ENV = "PAGEDSERVE_INT8_AMX"


def _has_amx_int8() -> bool:
    return bool(cpu_ops().int8_amx_available())


pytestmark = pytest.mark.skipif(not _has_amx_int8(), reason="no AMX-INT8 in this build or on this CPU")


def _weight(base: QuantFormat, n: int, k: int, seed: int) -> tuple[torch.Tensor, QuantFormat]:
    gen = torch.Generator().manual_seed(seed)
    packed, fmt = interleave(ref.quantize(torch.randn(n, k, generator=gen) * 0.05, base.type_id), base)
    assert fmt == INTERLEAVED[base]
    return packed, fmt


def _kernel(x: torch.Tensor, w: torch.Tensor, fmt: QuantFormat, bias: torch.Tensor | None, exact: int,
            mode: str) -> torch.Tensor:
    """The kernel itself (no routing) with `ENV` = `mode` for this call."""
    out = x.new_empty((x.shape[0], w.shape[0]))
    previous = os.environ.get(ENV)
    os.environ[ENV] = mode
    try:
        cpu_ops().quant_linear(out, x, w, fmt.type_id, bias, True, exact)
    finally:
        if previous is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = previous
    return out


def _inputs(m: int, k: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[:, 5] *= 30  # an outlier in every row's first block
    x[::3, -1] *= 1e-3  # and some tiny rows' last values
    return x, torch.randn(n, generator=gen)


@pytest.mark.parametrize("base", [Q4_0, Q4_1, Q8_0], ids=lambda f: f.name)
@pytest.mark.parametrize("k", [32, 64, 576, 1536])
@pytest.mark.parametrize("n", [8, 16, 24, 576])
def test_tiles_equal_vnni_bit_for_bit(base: QuantFormat, k: int, n: int) -> None:
    """Every row count 1..70, bias or none, no exact rows or some: the tiles (forced for every row,
    and the default split between tiles and VNNI rows) give exactly the VNNI kernel's bits."""
    w, fmt = _weight(base, n, k, n * k)
    x, bias = _inputs(max(ROWS) + 3, k, n, n + k)
    for m in ROWS:
        for b in (None, bias):
            for exact in (0, 3):
                rows = x[:m + exact]
                vnni = _kernel(rows, w, fmt, b, exact, "0")
                assert torch.equal(_kernel(rows, w, fmt, b, exact, "all"), vnni), (m, exact, b is None)
                assert torch.equal(_kernel(rows, w, fmt, b, exact, "auto"), vnni), (m, exact, b is None)


@pytest.mark.parametrize("base", [Q4_0, Q4_1, Q8_0], ids=lambda f: f.name)
def test_tiles_equal_vnni_threaded(base: QuantFormat) -> None:
    """Two threads split the weight into chunks of group pairs (an odd weight: 71 groups): the same bits."""
    w, fmt = _weight(base, 8 * 71, 576, 7)
    x, bias = _inputs(40, 576, 8 * 71, 8)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(_kernel(x, w, fmt, bias, 0, "all"), _kernel(x, w, fmt, bias, 0, "0"))
    finally:
        torch.set_num_threads(threads)


def test_tiles_equal_avx512_build(tmp_path: Path) -> None:
    """The tiles against a build capped at ``PAGEDSERVE_CPU_ISA=avx512`` (no AMX compiled in), run
    in a subprocess: the same bits for Q4_0r8, Q4_1r8 and Q8_0r8 at 1, 17 and 64 rows."""
    if os.environ.get("PAGEDSERVE_SLOW_TESTS") != "1":
        pytest.skip("builds the kernels a second time (minutes): PAGEDSERVE_SLOW_TESTS=1")
    root = Path(__file__).resolve().parents[2]
    script = (
        "import sys, torch\n"
        "from ops.build import cpu_ops\n"
        "assert not cpu_ops().int8_amx_available()\n"
        "x, w, bias, type_ids = torch.load(sys.argv[1])\n"
        "outs = []\n"
        "for wt, type_id in zip(w, type_ids):\n"
        "    for m in (1, 17, 64):\n"
        "        out = x.new_empty((m, wt.shape[0]))\n"
        "        cpu_ops().quant_linear(out, x[:m], wt, type_id, bias, True, 0)\n"
        "        outs.append(out)\n"
        "torch.save(outs, sys.argv[2])\n"
    )
    x, bias = _inputs(64, 576, 576, 1)
    weights = [_weight(base, 576, 576, 2) for base in (Q4_0, Q4_1, Q8_0)]
    torch.save((x, [w for w, _ in weights], bias, [f.type_id for _, f in weights]), tmp_path / "in.pt")
    env = {**os.environ, "PAGEDSERVE_CPU_ISA": "avx512", "PYTHONPATH": str(root)}
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")], env=env,
                   check=True, cwd=root, timeout=1800)
    expected = torch.load(tmp_path / "out.pt")
    got = [_kernel(x[:m], w, f, bias, 0, "all") for w, f in weights for m in (1, 17, 64)]
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
