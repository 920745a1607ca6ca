"""The packages that must stay torch-free import without torch: the gateway (any replica runs
without it), the offline tools, the block manager and scheduler, the worker's plumbing."""

from __future__ import annotations

import subprocess
import sys

import pytest

TORCH_FREE = [
    "common", "gateway", "pagedserve", "engine.kv", "engine.sched", "engine.worker", "engine.config",
    "engine.outputs", "engine.model.spec", "engine.model.fetch",
]

_PROBE = """
import importlib, pkgutil, sys
name = sys.argv[1]
module = importlib.import_module(name)
names = [name]
if hasattr(module, "__path__"):
    names += [info.name for info in pkgutil.walk_packages(module.__path__, name + ".")]
for each in names:
    importlib.import_module(each)
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(len(names), heavy)
sys.exit(1 if heavy else 0)
"""


@pytest.mark.parametrize("package", TORCH_FREE)
def test_package_imports_without_torch(package: str) -> None:
    result = subprocess.run([sys.executable, "-c", _PROBE, package], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"{package}: {result.stdout}{result.stderr}"
