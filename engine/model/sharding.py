"""Tensor-parallel shard arithmetic: which heads, MLP columns and vocabulary rows one rank holds,
and which slice of each checkpoint tensor it reads.

Layout (Megatron's, as in vLLM): q/k/v and gate/up are column-parallel (rank r holds a contiguous
range of heads / MLP features), o and down are row-parallel (rank r holds the matching input
columns; the partial sums are all-reduced), the embedding is vocab-parallel (contiguous rows,
`ceil(V / N)` per rank, the last rank padded), norms and rotary are replicated. KV heads are split
when `N <= num_kv_heads`, else replicated: rank r keeps KV head `r * num_kv_heads // N`, the one its
query heads read. Rank 0 also owns a full lm_head (`owns_lm_head`): sampling stays on rank 0, see
`engine.parallel`. `size == 1` is the single-process model (every slice is the whole tensor).

Mixture-of-experts blocks (`engine.model.moe`): every expert's intermediate features are split like
a dense MLP's (rank r: features `[r I/N, (r+1) I/N)` of each expert's gate and up rows, the same
input columns of its down; gpt-oss's interleaved gate/up columns `[2 r I/N, 2 (r+1) I/N)`), Qwen2-MoE's
shared expert likewise with its own size; the router and the shared expert's gate are replicated; a
bias added after a row-parallel product (o_proj's, the experts' down bias) is held by rank 0 only.
gpt-oss's attention sinks (one per query head) follow the query heads.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

import torch

from engine.model.moe_spec import CLAMPED_SWIGLU, MoESpec
from engine.model.spec import ModelSpec, UnsupportedModelError

# checkpoint shard name -> how it is split (column: rows of the weight; row: its input columns)
_COLUMN = {"q_proj": "q", "k_proj": "kv", "v_proj": "kv", "gate_proj": "mlp", "up_proj": "mlp"}
_ROW = {"o_proj": "q", "down_proj": "mlp"}
# a MoE block's per-expert / shared-expert checkpoint modules (Qwen names, Mixtral's w1/w3/w2)
_MOE_COLUMN = ("gate_proj", "up_proj", "w1", "w3")
_MOE_ROW = ("down_proj", "w2")
_PER_EXPERT = re.compile(r"\.experts\.\d+\.\w+\.weight$")
MXFP4_BLOCK = 32  # weights per MXFP4 scale (gpt-oss's `*_blocks` / `*_scales` checkpoints)


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
        problems = []
        if spec.num_heads % n:
            problems.append(f"num_attention_heads {spec.num_heads}")
        if spec.num_kv_heads % n and n % spec.num_kv_heads:
            problems.append(f"num_key_value_heads {spec.num_kv_heads} (nor is {n} a multiple of it)")
        if spec.intermediate_size % n:
            problems.append(f"intermediate_size {spec.intermediate_size}")
        if spec.moe is not None and spec.moe.intermediate_size % n:
            problems.append(f"the experts' intermediate size {spec.moe.intermediate_size}")
        if spec.moe is not None and spec.moe.shared_expert_size % n:
            problems.append(f"shared_expert_intermediate_size {spec.moe.shared_expert_size}")
        if problems:
            raise UnsupportedModelError(f"tensor_parallel_size {n} does not divide {', '.join(problems)}")

    # ----- local sizes --------------------------------------------------------------------
    def local_heads(self, spec: ModelSpec) -> int:
        return spec.num_heads // self.size

    def local_kv_heads(self, spec: ModelSpec) -> int:
        return max(1, spec.num_kv_heads // self.size)

    def local_intermediate(self, spec: ModelSpec) -> int:
        return spec.intermediate_size // self.size

    def local_moe(self, moe: MoESpec) -> MoESpec:
        """The MoE record of this rank's part of a sparse block: each expert's (and the shared expert's)
        intermediate features divided by `size`, routing unchanged."""
        if self.size == 1:
            return moe
        return dataclasses.replace(moe, intermediate_size=moe.intermediate_size // self.size,
                                   shared_expert_size=moe.shared_expert_size // self.size)

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
        if spec.moe is not None and (".experts." in name or ".shared_expert." in name):
            return self._moe_slice(name, module, shape, spec.moe)
        if name.endswith("self_attn.sinks"):  # gpt-oss: one logit per query head
            per = self.local_heads(spec)
            return 0, self.rank * per, per
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

    def _moe_slice(self, name: str, module: str, shape: tuple[int, ...], moe: MoESpec) -> tuple[int, int, int] | None:
        """`weight_slice` of a sparse block's expert or shared-expert tensor (module docstring). Qwen's
        stacked `experts.gate_up_proj [E, 2I, H]` is read whole: its rank rows are two ranges, cut by
        `engine.model.moe_weights`."""
        whole = (0, 0, shape[0])
        shared = ".shared_expert." in name
        size = moe.shared_expert_size if shared else moe.intermediate_size
        per = size // self.size
        start = self.rank * per
        if shared or _PER_EXPERT.search(name):
            if module in _MOE_COLUMN:  # per expert: `experts.{e}.gate_proj.weight [I, H]`
                return 0, start, per
            if module in _MOE_ROW:
                return 1, start, per
        stacked = name.rsplit(".", 1)[-1]
        gpt_oss = moe.activation == CLAMPED_SWIGLU
        if stacked in ("gate_up_proj", "gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias"):
            if not gpt_oss:
                return whole
            # gpt-oss interleaves gate and up features: this rank's are one range of twice its share
            dim = 2 if stacked == "gate_up_proj" else 1
            return dim, 2 * start, 2 * per
        if stacked == "down_proj":  # gpt-oss [E, I, H]; Qwen stacked [E, H, I]
            return (1 if gpt_oss else 2), start, per
        if stacked in ("down_proj_blocks", "down_proj_scales"):  # [E, H, I / 32, (16)]
            if start % MXFP4_BLOCK or per % MXFP4_BLOCK:
                raise UnsupportedModelError(
                    f"{name}: tensor_parallel_size {self.size} gives each rank {per} of the experts' {size} "
                    f"intermediate features, not a multiple of MXFP4's {MXFP4_BLOCK}-weight blocks")
            return 2, start // MXFP4_BLOCK, per // MXFP4_BLOCK
        if stacked == "down_proj_bias":
            return whole if self.rank == 0 else None  # added once: rank 0 holds it
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
