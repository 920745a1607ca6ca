"""pagedserve's benchmarks: scripts printing JSON lines (benchmarks/README.md). Importing the package bounds
OpenMP's idle spin before a script imports torch, as the engine does (common/openmp_env.py)."""

from common.openmp_env import bound_openmp_spin

bound_openmp_spin()
