"""benchmarks/serving/redis_cost.py in a tiny configuration (a real redis-server, one fake engine
through the real engine worker, one real gateway, four streams): the JSON lines it prints and the
counts that do not depend on timing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
REQUESTS, MAX_TOKENS = 4, 5


def _run(*args: str) -> list[dict[str, Any]]:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.serving.redis_cost", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def test_fake_engine_run_reports_costs_per_request_and_token() -> None:
    lines = _run("--fake-engines", "1", "--engine-tok-s", "2000", "--gateways", "1", "--requests", str(REQUESTS),
                 "--concurrency", str(REQUESTS), "--max-tokens", str(MAX_TOKENS), "--idle-s", "0.5",
                 "--settle-s", "0.5")
    assert [line["phase"] for line in lines] == ["idle", "burst"]
    idle, burst = lines
    assert idle["engines"] == "fake" and idle["engine_count"] == 1 and idle["engine_tok_s"] == 2000.0
    assert idle["seconds"] > 0 and {"commands", "by_source", "cpu_us", "net_in_bytes"} <= set(idle["per_s"])
    assert "info" not in idle["per_s"]["commands"]  # the script's own readings are left out
    assert (burst["completed"], burst["failed"], burst["tokens"]) == (REQUESTS, 0, REQUESTS * MAX_TOKENS)
    per_request, per_token = burst["per_request"], burst["per_token"]
    # one message per token; each but the last leaves a checkpoint (the end deletes it instead)
    assert per_request["commands"]["rpush"] == MAX_TOKENS - 1
    assert per_request["commands"]["evalsha"] >= 1  # the submit script
    for source in ("submission", "output_entries", "checkpoints", "acks", "transactions"):
        assert per_token["by_source"][source]["calls"] > 0, source
    for key in ("net_in_bytes", "net_out_bytes", "cpu_us", "cpu_main_thread_us", "calls"):
        assert isinstance(per_token[key], float | int), key
    assert abs(per_token["calls"] * MAX_TOKENS - per_request["calls"]) < 1e-2
    for key in ("tok_s", "duration_s", "redis_cpu_share", "saturation_tok_s", "engines_per_master"):
        assert key in burst, key
