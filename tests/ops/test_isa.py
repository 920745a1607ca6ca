"""PAGEDSERVE_CPU_ISA: the cap's logic on synthetic CPUs, and on this machine every lower level it
can run: the kernel library built without the higher extensions (no zmm register in it under
avx2), the kernel and engine tests green there, and fixed_gemm's and the Q4 layouts' fp32 rows' bits the
same at every level."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ops import isa

ZEN3 = {"avx2", "fma", "f16c", "vaes"}
ZEN5 = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi", "avx512_bf16", "avx_vnni"}
XEON = ZEN5 | {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16"}
CASCADE_LAKE = ZEN3 | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
COOPER_LAKE = CASCADE_LAKE | {"avx512_bf16"}  # no VBMI: the bf16 kernel's byte permutes are missing
LOWER = isa.machine_levels()[:-1]  # the machine's own level is what the rest of the suite runs
ROOT = Path(__file__).resolve().parents[2]
# What a capped run checks: the kernels against the reference, the linears (the bf16 ones on
# `vdpbf16ps` at avx512_bf16, the only level that runs that kernel here), the screens, and the
# engine's bit-for-bit invariance on the tiny model (about a minute a level on one core, after the
# library's build, which scripts/test.sh does beforehand); the oracle against HF and the GGUF model's
# invariance run at the machine's own level in the rest of the suite.
CAPPED_TESTS = ["tests/ops/test_attention.py", "tests/ops/test_prefill_attention.py", "tests/ops/test_kv_int8.py",
                "tests/ops/test_linear.py", "tests/ops/test_fused.py", "tests/ops/test_quant_linear.py",
                "tests/ops/test_kquant_linear.py", "tests/ops/test_quant_linear_bf16.py",
                "tests/ops/test_screen.py", "tests/engine/model/test_gguf_screen.py",
                "tests/ops/test_window_attention.py::test_cpu_decode_half_precision",
                "tests/ops/test_window_attention.py::test_cpu_prefill_other_shapes",
                "tests/ops/test_window_attention.py::test_cpu_int8_cache_with_a_window",
                "tests/engine/test_batch_invariance.py::test_one_request_gets_the_same_bits_in_any_step",
                "tests/engine/test_batch_invariance.py::test_preemption_changes_no_bit"]


def test_levels_of_known_cpus() -> None:
    assert isa.level_of(ZEN3) == "avx2" and isa.level_of(ZEN5) == "avx512_bf16" and isa.level_of(XEON) == "amx"
    assert isa.level_of({"sse2"}) is None
    assert isa.level_of(CASCADE_LAKE) == "avx512" and isa.level_of(COOPER_LAKE) == "avx512"
    assert isa.capped_flags(XEON, "avx512") == CASCADE_LAKE
    # below amx the Xeon's AVX512-FP16 and AVX-VNNI go too (Zen 4 has neither)
    assert isa.capped_flags(XEON, "avx512_bf16") == ZEN5 - {"avx_vnni"}
    assert isa.capped_flags(ZEN5, "avx2") == ZEN3
    assert isa.capped_flags(ZEN5, None) == ZEN5


def test_a_cap_above_the_cpu_or_unknown_is_refused() -> None:
    assert isa.cap_from_env("avx512", ZEN5) == "avx512" and isa.cap_from_env(None, ZEN5) is None
    assert isa.cap_from_env("avx512", CASCADE_LAKE) == "avx512"
    with pytest.raises(isa.IsaCapError, match="above this CPU"):
        isa.cap_from_env("amx", ZEN5)
    with pytest.raises(isa.IsaCapError, match="not a level"):
        isa.cap_from_env("sse4", ZEN5)


def _capped(level: str, code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, isa.ENV: level, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=1200, check=False)


@pytest.mark.skipif(not LOWER, reason="this CPU has no level below its own")
@pytest.mark.parametrize("preset", [None, "AVX"])
def test_a_cap_reaches_onednn_and_mkl_unless_set(preset: str | None) -> None:
    """torch's fp32 GEMMs run on MKL, which reads its own variable, not oneDNN's: both follow the cap,
    and a value already in the environment stays."""
    level = LOWER[0]
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    env |= {isa.ENV: level} | ({"MKL_ENABLE_INSTRUCTIONS": preset} if preset else {})
    code = "import os, ops; print(os.environ['ONEDNN_MAX_CPU_ISA'], os.environ.get('MKL_ENABLE_INSTRUCTIONS'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert out == [isa.ONEDNN_ISA[level], preset or str(isa.MKL_ISA[level])]


FIXED_GEMM = """
import sys, torch, ops
from ops.build import cpu_library
from tests.ops.test_isa import q4_exact_rows
g = torch.Generator().manual_seed(1)
w, x, b = torch.randn(200, 96, generator=g), torch.randn(37, 96, generator=g), torch.randn(200, generator=g)
out = ops.linear(x, w, b, fixed=ops.pack_fixed(w))
torch.save([out, *q4_exact_rows()], sys.argv[-1] if len(sys.argv) > 1 else "/dev/null")
print(cpu_library())
"""


def q4_exact_rows() -> list[torch.Tensor]:
    """The Q4 eight-row layouts' fp32 (exact) rows on 37 rows and 25 groups, bias included: one FMA
    chain per output over k, the same bits at every level (the capped run imports this)."""
    from ops.quant import Q4_0, Q4_1, interleave, quant_linear
    from ops.reference import quant as ref
    g = torch.Generator().manual_seed(2)
    w, x, b = torch.randn(200, 96, generator=g), torch.randn(37, 96, generator=g), torch.randn(200, generator=g)
    outs = []
    for fmt in (Q4_0, Q4_1):
        r8, r8_fmt = interleave(ref.quantize(w, fmt.type_id), fmt)
        outs.append(quant_linear(x, r8, r8_fmt, b, True, exact_rows=37))
    return outs


@pytest.mark.skipif(not LOWER, reason="this CPU has no level below its own")
@pytest.mark.parametrize("level", LOWER)
def test_capped_library_and_fixed_gemm_bits(level: str, tmp_path: Path) -> None:
    code = FIXED_GEMM.replace('sys.argv[-1] if len(sys.argv) > 1 else "/dev/null"', repr(str(tmp_path / "out.pt")))
    done = _capped(level, code)
    assert done.returncode == 0, done.stderr[-3000:]
    library = done.stdout.strip().splitlines()[-1]
    disassembly = subprocess.run(["objdump", "-d", "--no-show-raw-insn", library], capture_output=True, text=True,
                                 check=True).stdout
    if level == "avx2":
        assert "zmm" not in disassembly, "an avx2-capped library holds AVX-512 code"
    mnemonics = set(re.findall(r"^\s*[0-9a-f]+:\s+(?:\{vex\}\s+)?([a-z][a-z0-9]*)", disassembly, re.MULTILINE))
    assert not {m for m in mnemonics if m.startswith(("tdp", "tile"))}, "below amx: no tile instruction"
    fp16 = {m for m in mnemonics if m == "vmovw" or (re.fullmatch(r"v\w+(ph|sh)x?", m) and m != "vcvtps2ph")}
    assert not fp16, f"below amx: no AVX512-FP16 instruction (Zen 4/5 and Ice Lake lack it): {sorted(fp16)[:5]}"
    assert "{vex} vpdp" not in disassembly, "below amx: no AVX-VNNI (Zen 4 and Ice Lake lack it)"
    if isa.LEVELS.index(level) < isa.LEVELS.index("avx512_bf16"):
        assert "vdpbf16ps" not in disassembly, "a library capped below avx512_bf16 holds bf16 dot products"
        vbmi = mnemonics & {"vpermb", "vpermi2b", "vpermt2b", "vpmultishiftqb"}
        assert not vbmi, f"below avx512_bf16: no VBMI instruction (Cascade Lake lacks it): {sorted(vbmi)}"
    import ops
    g = torch.Generator().manual_seed(1)
    w, x, b = torch.randn(200, 96, generator=g), torch.randn(37, 96, generator=g), torch.randn(200, generator=g)
    capped = torch.load(tmp_path / "out.pt")
    assert torch.equal(capped[0], ops.linear(x, w, b, fixed=ops.pack_fixed(w)))
    for got, want in zip(capped[1:], q4_exact_rows(), strict=True):
        assert torch.equal(got, want), "the Q4 r8 fp32 rows differ from this machine's level"


@pytest.mark.skipif(not LOWER, reason="this CPU has no level below its own")
@pytest.mark.parametrize("level", LOWER)
def test_kernel_and_engine_tests_pass_at_a_lower_level(level: str) -> None:
    code = ("import sys, pytest; sys.exit(pytest.main(['-q', '-x', '-p', 'no:cacheprovider', '-p', 'no:xdist', "
            f"*{CAPPED_TESTS!r}]))")
    done = _capped(level, code)
    assert done.returncode == 0, (done.stdout[-4000:], done.stderr[-2000:])
