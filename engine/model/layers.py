"""Small building blocks of the decoder on the fused ops: Linear, RMSNorm (with the residual add
folded in) and the SwiGLU MLP with a fused gate/up projection; under tensor parallelism the
vocab-parallel embedding, and row-parallel projections (down here, o in `llama`) whose partial
sums are all-reduced, their bias held by rank 0 alone so it is added once."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

import ops
from engine.model.execution_policy import PLAIN_ROWS, LinearRows
from engine.model.sharding import SINGLE, TPShard
from ops.policy import FASTEST, OpsPolicy

if TYPE_CHECKING:
    from engine.model.lora.slots import LoRASlots


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and checkpoint names) computed by `ops.linear`: on the CPU in fp32
    a C++ kernel streams the weight at small batch, and larger batches use a oneDNN-packed copy of
    it, made on first use (after the checkpoint is loaded) and kept alongside. Under the step's
    `rows.ops.fixed_order` every row goes through `fixed_gemm` on its own packed copy instead (one
    arithmetic per row at any batch size). It takes the step's `LinearRows` as packed linears do
    (`QuantLinear`), and computes every row alike whatever their exact rows and bf16 say."""

    packed: torch.Tensor | None = None
    fixed: torch.Tensor | None = None  # `ops.pack_fixed(weight)` under `OpsPolicy.fixed_order`
    lora: LoRASlots | None = None  # adapter slots (`engine.model.lora`), added for `rows.lora`

    def forward(self, x: torch.Tensor, rows: LinearRows = PLAIN_ROWS) -> torch.Tensor:
        out = self._base(x, rows.ops)
        return out if rows.lora is None or self.lora is None else self.lora.add(x, out, rows.lora, rows.ops)

    def _base(self, x: torch.Tensor, policy: OpsPolicy) -> torch.Tensor:
        if policy.fixed_order and x.device.type == "cpu" and x.dtype == torch.float32 and self.out_features:
            if self.fixed is None or self.fixed.shape[1] != self.in_features:
                self.fixed = ops.pack_fixed(self.weight)
            return ops.linear(x, self.weight, self.bias, fixed=self.fixed, policy=policy)
        if (self.packed is None and x.shape[0] > ops.SMALL_GEMM_MAX_ROWS and not policy.reference
                and ops.can_pack(self.weight)):
            self.packed = ops.pack_weight(self.weight)
        return ops.linear(x, self.weight, self.bias, self.packed, policy=policy)


class VocabParallelEmbedding(nn.Embedding):
    """This rank's rows `[lo, hi)` of the embedding (padded to `ceil(V / N)`): ids outside look up
    zeros, and the group's sum is the full lookup. Rank 0 of a tied model holds every row (they are
    its lm_head) and reads the first `ceil(V / N)` of them."""

    def __init__(self, num_rows: int, dim: int, vocab_range: tuple[int, int], shard: TPShard) -> None:
        super().__init__(num_rows, dim)
        self.lo, self.hi = vocab_range
        self.shard = shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inside = (ids >= self.lo) & (ids < self.hi)
        local = torch.where(inside, ids - self.lo, torch.zeros_like(ids))
        out = F.embedding(local, self.weight)
        out.masked_fill_(~inside.unsqueeze(-1), 0.0)
        return self.shard.all_reduce(out)


class VocabParallelLookup(nn.Module):
    """`VocabParallelEmbedding` around another lookup (a packed `QuantEmbedding`) of rows `[lo, hi)`."""

    def __init__(self, inner: nn.Module, vocab_range: tuple[int, int], shard: TPShard) -> None:
        super().__init__()
        self.inner = inner
        self.lo, self.hi = vocab_range
        self.shard = shard

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inside = (ids >= self.lo) & (ids < self.hi)
        out = self.inner(torch.where(inside, ids - self.lo, torch.zeros_like(ids)))
        out.masked_fill_(~inside.unsqueeze(-1), 0.0)
        return self.shard.all_reduce(out)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as HF Llama does, with an optional fused residual add."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, policy: OpsPolicy = FASTEST
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `(norm(x + residual), x + residual)`; the second is the next residual stream.

        With a residual both tensors are updated in place (`x` becomes the norm, `residual` the sum),
        so callers must own them: the model passes activations it made itself.
        """
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps, policy=policy), x
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, policy=policy)


class SwiGLU(nn.Module):
    """`down(act(gate(x)) * up(x))` with gate and up stacked in one matmul; `act` is silu (SwiGLU,
    the fused op) or gelu_pytorch_tanh (GeGLU, Gemma 3: torch's tanh-approximate GELU, as
    transformers computes it)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, shard: TPShard = SINGLE,
                 activation: str = "silu") -> None:
        """`intermediate_size` is this rank's share (the whole of it for size 1)."""
        super().__init__()
        if activation not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported activation {activation!r}")
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias and shard.rank == 0)
        self.activation = activation
        self.shard = shard

    def forward(self, x: torch.Tensor, rows: LinearRows = PLAIN_ROWS) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, rows)
        if self.activation == "silu":
            hidden = ops.silu_and_mul(gate_up, policy=rows.ops)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = F.gelu(gate, approximate="tanh") * up
        return self.shard.all_reduce(self.down_proj(hidden, rows))
