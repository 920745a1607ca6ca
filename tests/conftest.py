"""Shared pytest setup. Fixtures live in tests/fixtures/, one module per area.

Under pytest-xdist (`-n N`, as scripts/test.sh runs the suite) worker k of N keeps to its share of
the ports (common/ports.py), it and every process it starts, so two workers never
start servers on the same port."""

import os

import ops  # noqa: F401  (PAGEDSERVE_CPU_ISA caps oneDNN on import, before a test's first GEMM)
from common.ports import PARTITION_ENV

_worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ... in a worker
if _worker.startswith("gw"):
    os.environ[PARTITION_ENV] = f"{int(_worker[2:])}/{os.environ.get('PYTEST_XDIST_WORKER_COUNT', '1')}"

pytest_plugins = [
    "tests.fixtures.models",
    "tests.fixtures.redis",
    "tests.fixtures.redis_cluster",
]
