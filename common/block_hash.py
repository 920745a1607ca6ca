"""The prefix-cache key of a KV block, shared by engines (which cache blocks under it) and
gateways (which route a prompt to the engine holding its longest cached prefix)."""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The key of a full block: the previous block's key chained with its tokens.

    A stable hash (blake2b over the parent key and the token ids as little-endian int64), not
    Python's per-process `hash()`: the same prefix has the same keys in every process."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(b"root" if parent_hash is None else parent_hash.to_bytes(8, "little"))
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


def adapter_root(lora_name: str | None) -> int | None:
    """The parent key of a sequence's first block: None for the base model; for a LoRA adapter a
    key of its own name, so the same tokens under two adapters (or none) never share K/V."""
    if not lora_name:
        return None
    digest = hashlib.blake2b(b"lora:" + lora_name.encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")


def prefix_keys(token_ids: Sequence[int], block_size: int, lora_name: str | None = None) -> list[int]:
    """Keys of the leading blocks an engine may reuse for this prompt: every full block except
    that the last prompt token is always computed (the engine's own `_prefix_keys` rule); under
    adapter `lora_name` they chain from its `adapter_root`."""
    keys: list[int] = []
    parent = adapter_root(lora_name)
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        keys.append(parent)
    return keys
