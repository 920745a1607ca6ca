"""Small building blocks of the decoder on the fused ops: Linear, RMSNorm (with the residual add
folded in) and the SwiGLU MLP with a fused gate/up projection."""

from __future__ import annotations

import torch
from torch import nn

import ops


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and checkpoint names) computed by `ops.linear`: on the CPU in fp32
    a C++ kernel streams the weight at small batch, and larger batches use a oneDNN-packed copy of
    it, made on first use (after the checkpoint is loaded) and kept alongside."""

    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.packed is None and x.shape[0] > ops.SMALL_GEMM_MAX_ROWS and ops.get_backend() == "auto"
                and ops.can_pack(self.weight)):
            self.packed = ops.pack_weight(self.weight)
        return ops.linear(x, self.weight, self.bias, self.packed)


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as HF Llama does, with an optional fused residual add."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return `(norm(x + residual), x + residual)`; the second is the next residual stream.

        With a residual both tensors are updated in place (`x` becomes the norm, `residual` the sum),
        so callers must own them: the model passes activations it made itself.
        """
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps), x
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))` with gate and up stacked in one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))
