"""OpenMP's idle spin is bounded before torch loads libgomp (common/openmp_env.py): by importing
`engine` or `benchmarks` first, never over the user's own choice, and flagged when too late.
Each case is a fresh interpreter, since libgomp reads its environment once per process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.openmp_env import SPIN_COUNT, USER_CHOICES

ROOT = Path(__file__).resolve().parents[2]

_PROBE = """
import os, sys
for name in sys.argv[1].split(","):
    __import__(name)
from common.openmp_env import openmp_spin_note
print(os.environ.get("GOMP_SPINCOUNT"), os.environ.get("OMP_WAIT_POLICY"), openmp_spin_note() is not None)
"""


def probe(imports: str, **env: str) -> list[str]:
    """GOMP_SPINCOUNT, OMP_WAIT_POLICY and whether the warning would be logged, after `imports`."""
    clean = {k: v for k, v in os.environ.items() if k not in USER_CHOICES}
    result = subprocess.run([sys.executable, "-c", _PROBE, imports], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env={**clean, "PYTHONPATH": str(ROOT), **env})
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.parametrize("first", ["engine", "benchmarks", "engine.llm", "engine.kv"])
def test_a_project_import_before_torch_bounds_the_spin(first: str) -> None:
    assert probe(f"{first},torch") == [str(SPIN_COUNT), "None", "False"]


def test_torch_first_keeps_the_default_and_is_flagged() -> None:
    assert probe("torch,engine,ops") == ["None", "None", "True"]


@pytest.mark.parametrize("env", [{"GOMP_SPINCOUNT": "7"}, {"OMP_WAIT_POLICY": "active"}])
def test_the_users_choice_is_kept(env: dict[str, str]) -> None:
    spin, policy, flagged = probe("engine,torch", **env)
    assert (spin, policy) == (env.get("GOMP_SPINCOUNT", "None"), env.get("OMP_WAIT_POLICY", "None"))
    assert flagged == "False"


_PEER_PROBE = """
import os, benchmarks
from common.openmp_env import peer_environ
print(os.environ.get("GOMP_SPINCOUNT"), peer_environ().get("GOMP_SPINCOUNT"))
"""


@pytest.mark.parametrize(("preset", "expected"), [(None, [str(SPIN_COUNT), "None"]),
                                                  (str(SPIN_COUNT), [str(SPIN_COUNT)] * 2)])
def test_peers_get_the_environment_without_our_bound(preset: str | None, expected: list[str]) -> None:
    """A peer (vLLM, llama.cpp: libgomp too) runs its OpenMP as its users would; a user's own value stays."""
    clean = {k: v for k, v in os.environ.items() if k not in USER_CHOICES}
    env = {**clean, "PYTHONPATH": str(ROOT)} | ({"GOMP_SPINCOUNT": preset} if preset else {})
    result = subprocess.run([sys.executable, "-c", _PEER_PROBE], capture_output=True, text=True, timeout=120,
                            cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == expected
