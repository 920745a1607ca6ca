"""Tensor-parallel shard arithmetic: which heads, MLP columns and vocabulary rows one rank holds,
and which slice of each checkpoint tensor it reads.

Layout (Megatron's, as in vLLM): q/k/v and gate/up are column-parallel (rank r holds a contiguous
range of heads / MLP features), o and down are row-parallel (rank r holds the matching input
columns; the partial sums are all-reduced), the embedding is vocab-parallel (contiguous rows,
`ceil(V / N)` per rank, the last rank padded), norms and rotary are replicated. KV heads are split
when `N <= num_kv_heads`, else replicated: rank r keeps KV head `r * num_kv_heads // N`, the one its
query heads read. Rank 0 also owns a full lm_head (`owns_lm_head`): sampling stays on rank 0, see
`engine.parallel`. `size == 1` is the single-process model (every slice is the whole tensor).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from engine.model.spec import ModelSpec, UnsupportedModelError

# checkpoint shard name -> how it is split (column: rows of the weight; row: its input columns)
_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_ROW = {"o_proj": "q", "down_proj": "mlp"}


@dataclass(frozen=True, slots=True)
class TPShard:
    """Rank `rank` of `size`; `group` is its torch.distributed process group for the all-reduces
    (None for size 1, or in a test that only slices)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    @property
    def owns_lm_head(self) -> bool:
        """Rank 0 holds the full lm_head and samples; the others stop at the final norm."""
        return self.rank == 0

    def check(self, spec: ModelSpec) -> None:
        """Raise UnsupportedModelError when the model cannot be split `size` ways."""
        n = self.size
        if n > 1 and spec.moe is not None:
            raise UnsupportedModelError(
                f"{spec.model_type}: tensor parallelism of mixture-of-experts models is not implemented (experts "
                "are not sharded); use tensor_parallel_size 1")
        problems = []
        if spec.num_heads % n:
            problems.append(f"num_attention_heads {spec.num_heads}")
        if spec.num_kv_heads % n and n % spec.num_kv_heads:
            problems.append(f"num_key_value_heads {spec.num_kv_heads} (nor is {n} a multiple of it)")
        if spec.intermediate_size % n:
            problems.append(f"intermediate_size {spec.intermediate_size}")
        if problems:
            raise UnsupportedModelError(f"tensor_parallel_size {n} does not divide {', '.join(problems)}")

    # ----- local sizes --------------------------------------------------------------------
    def local_heads(self, spec: ModelSpec) -> int:
        return spec.num_heads // self.size

    def local_kv_heads(self, spec: ModelSpec) -> int:
        return max(1, spec.num_kv_heads // self.size)

    def local_intermediate(self, spec: ModelSpec) -> int:
        return spec.intermediate_size // self.size

    def vocab_per_rank(self, spec: ModelSpec) -> int:
        return -(-spec.vocab_size // self.size)

    def vocab_range(self, spec: ModelSpec) -> tuple[int, int]:
        """Token ids `[lo, hi)` of this rank's embedding rows (hi - lo may be short on the last rank)."""
        per = self.vocab_per_rank(spec)
        return min(self.rank * per, spec.vocab_size), min((self.rank + 1) * per, spec.vocab_size)

    def kv_spec(self, spec: ModelSpec) -> ModelSpec:
        """The spec of this rank's KV cache and attention: its own heads and KV heads only."""
        return dataclasses.replace(spec, num_heads=self.local_heads(spec), num_kv_heads=self.local_kv_heads(spec))

    # ----- checkpoint slices ----------------------------------------------------------------
    def _range(self, spec: ModelSpec, kind: str) -> tuple[int, int]:
        """(start, length) in units of features along the split dimension."""
        d = spec.head_dim
        if kind == "q":
            per = self.local_heads(spec) * d
            return self.rank * per, per
        if kind == "kv":
            if spec.num_kv_heads >= self.size:
                per = self.local_kv_heads(spec) * d
                return self.rank * per, per
            return (self.rank * spec.num_kv_heads // self.size) * d, d
        per = self.local_intermediate(spec)
        return self.rank * per, per

    def weight_slice(self, name: str, shape: tuple[int, ...], spec: ModelSpec) -> tuple[int, int, int] | None:
        """`(dim, start, length)` of checkpoint tensor `name` (of `shape`) this rank reads, or None
        to skip it (the lm_head on ranks other than 0). The whole tensor is `(0, 0, shape[0])`."""
        whole = (0, 0, shape[0]) if shape else (0, 0, 0)
        if self.size == 1:
            return whole
        leaf = name.rsplit(".", 2)
        module, what = (leaf[-2], leaf[-1]) if len(leaf) >= 2 else ("", name)
        if module in _COLUMN:
            start, length = self._range(spec, _COLUMN[module])
            return 0, start, length
        if module in _ROW:
            if what == "bias":
                return whole if self.rank == 0 else None  # added once: rank 0 holds it
            start, length = self._range(spec, _ROW[module])
            return 1, start, length
        if name == "model.embed_tokens.weight":
            if spec.tie_word_embeddings and self.owns_lm_head:
                return whole  # rank 0's lm_head is the full tied matrix; its embedding uses the first rows
            lo, hi = self.vocab_range(spec)
            return 0, lo, hi - lo
        if name == "lm_head.weight":
            return whole if self.owns_lm_head else None
        return whole

    def narrow(self, name: str, tensor: torch.Tensor, spec: ModelSpec) -> torch.Tensor | None:
        """`tensor` cut to this rank's slice (a view), or None when the rank skips it."""
        cut = self.weight_slice(name, tuple(tensor.shape), spec)
        if cut is None:
            return None
        dim, start, length = cut
        return tensor if length == tensor.shape[dim] else tensor.narrow(dim, start, length)

    # ----- collectives -------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` in place over the group (nothing for size 1); returns it."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor, group=self.group)
        return tensor


SINGLE = TPShard()
