"""Capacity planning (`pagedserve plan`): a model's KV bytes per token from flags or a
config.json, blocks in a memory budget, and paged against contiguous concurrency.

Torch-free and transformers-free (reads plain JSON), so the command starts instantly."""
