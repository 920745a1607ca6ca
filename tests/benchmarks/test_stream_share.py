"""benchmarks/kernels/stream_share_bench.py runs and reports what it says, on a tiny configuration."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stream_share_prints_one_line_per_format() -> None:
    out = subprocess.run([sys.executable, "benchmarks/kernels/stream_share_bench.py", "--formats", "Q4_0,Q6_K",
                          "--n", "64", "--k", "512", "--weights", "2", "--rounds", "1"],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["format"] for line in lines] == ["Q4_0", "Q6_K"]
    for line in lines:
        # two 64 x 512 weights: Q4_0 18 bytes per 32 weights, Q6_K 210 per 256
        per_weight = 64 * 512 * (18 / 32 if line["format"] == "Q4_0" else 210 / 256)
        assert line["weight_bytes"] == 2 * per_weight
        assert line["kernel_gb_s"] > 0 and line["read_gb_s"] > 0
        assert abs(line["share"] - line["kernel_gb_s"] / line["read_gb_s"]) < 0.01 * line["share"] + 0.01
