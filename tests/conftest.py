"""Shared pytest setup. Fixtures live in tests/fixtures/, one module per area.

Under pytest-xdist (`-n N`, as scripts/test.sh runs the suite) worker k of N keeps to its share of
the ports (common/ports.py), it and every process it starts, so two workers never
start servers on the same port."""

import os
from collections.abc import Iterator

import pytest

import ops
from common.ports import PARTITION_ENV

_worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ... in a worker
if _worker.startswith("gw"):
    os.environ[PARTITION_ENV] = f"{int(_worker[2:])}/{os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1')}"

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.redis",
    "tests.fixtures.redis_cluster",
]


@pytest.fixture(autouse=True)
def _process_wide_arithmetic() -> Iterator[None]:
    """Each test starts with the process-wide kernel choices of a fresh process: an engine sets
    deterministic mode (`ops.set_fixed_order`) for the process, and a module-level test after it
    would otherwise run the other arithmetic, depending on which tests ran before it."""
    ops.set_fixed_order(False)
    ops.set_backend("auto")
    yield
    ops.set_fixed_order(False)
    ops.set_backend("auto")
