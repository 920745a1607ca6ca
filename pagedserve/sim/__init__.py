"""The offline memory simulator (`pagedserve simulate`): request traces replayed through a
contiguous allocator and through the real paged `engine.kv.BlockManager`, with figures,
a report and plots.

Torch-free: imports `engine.kv`, the standard library, and matplotlib (for plots only)."""
