"""benchmarks/serving/cluster_spread.py in a tiny configuration (a real 3-master Redis Cluster,
fake engines of two models through the real engine worker, two real gateways, all with
`--redis-cluster`): every request completes, and every master carries part of the load (the
models', gateways' and engines' slots land on different masters)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUESTS, MAX_TOKENS = 16, 8

pytestmark = pytest.mark.slow


def test_a_fleet_on_a_cluster_spreads_over_its_masters() -> None:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serving.cluster_spread", "--models", "2",
                           "--gateways", "2", "--engines-per-model", "1", "--requests", str(REQUESTS),
                           "--concurrency", "8", "--max-tokens", str(MAX_TOKENS), "--settle-s", "0.5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (line["completed"], line["failed"], line["tokens"]) == (REQUESTS, 0, REQUESTS * MAX_TOKENS)
    # each master serves some of the keys written per token (not just the script's own INFO reads)
    assert len(line["command_share"]) == 3 and min(line["command_share"]) > 0.01
    assert abs(sum(line["command_share"]) - 1) < 0.01
