"""Shared pytest setup. Fixtures live in tests/fixtures/, one module per area.

Under pytest-xdist (`-n N`, as scripts/test.sh runs the suite, a file per worker at a time):

- worker k of N keeps to its share of the loopback ports (common/ports.py), it and every process
  it starts, so two workers never start servers on the same port;
- the files that take longest (the slow suite, the end-to-end tests, real SmolLM2 weights) form one
  xdist group, run by one worker one after another, while the other worker takes the many short
  files (kernel grids, the gateway against a scripted engine) a file at a time
  (`--dist loadgroup`). Two long files side by side oversubscribe the two cores (each runs torch,
  or engines, on both), and the kernels' OpenMP barriers wait for descheduled threads: measured,
  that was slower than one long file at a time; and scheduling by file alone ended the run on a
  lone end-to-end file while the other worker idled."""

from __future__ import annotations

import os

import pytest

from common.ports import PARTITION_ENV

_worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ... in a worker
if _worker.startswith("gw"):
    os.environ[PARTITION_ENV] = f"{int(_worker[2:])}/{os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1')}"

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.redis",
]

_LONG_FIXTURES = {"smollm2_dir", "sentinel_group"}
_LONG_NAMES = ("smollm2", "gguf", "sentinel", "parallel", "greedy")


def _expected_length(item: pytest.Item) -> int:
    """0 for what takes longest, 3 for the rest (only an order: a wrong guess costs balance)."""
    path = item.path.as_posix()
    if item.get_closest_marker("slow") is not None:
        return 0
    if "/tests/e2e/" in path:
        return 1
    if _LONG_FIXTURES & set(getattr(item, "fixturenames", ())) or any(n in path for n in _LONG_NAMES):
        return 2
    return 3


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """One xdist group for the files whose tests take longest, one group per file for the rest."""
    file_rank: dict[str, int] = {}
    for item in items:
        key = item.path.as_posix()
        file_rank[key] = min(file_rank.get(key, 3), _expected_length(item))
    for item in items:
        key = item.path.as_posix()
        item.add_marker(pytest.mark.xdist_group("long-running" if file_rank[key] < 3 else key))
