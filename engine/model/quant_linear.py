"""Modules on GGUF-quantized weights kept in their packed blocks (`ops.quant`).

`QuantLinear` is a linear layer whose weight is one or more row shards (q/k/v, gate/up stacked
as in `Linear`), each a packed uint8 buffer in its own format, or an fp32 weight for a shard the
file stores unquantized. `QuantEmbedding` looks rows up in a packed embedding, dequantizing only
the rows a step needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

import ops
from engine.model.execution_policy import PLAIN_ROWS, LinearRows
from ops.quant import QuantFormat

if TYPE_CHECKING:
    from engine.model.lora.slots import LoRASlots


class QuantLinear(nn.Module):
    """`y = x @ W.T + b` with W the row-wise concatenation of `shards`: `(format, packed uint8)` or
    `(None, fp32 [rows, in_features])`. One shard (the common case) is one kernel call. Each call
    says which rows compute how (`LinearRows`: the step's exact rows, bf16, LoRA adapters, whose
    products are added to the quantized product's output)."""

    lora: LoRASlots | None = None  # adapter slots (`engine.model.lora`), added for `rows.lora`

    def __init__(self, in_features: int, shards: list[tuple[QuantFormat | None, torch.Tensor]],
                 bias: torch.Tensor | None = None, int8_activations: bool = True) -> None:
        super().__init__()
        self.in_features = in_features
        self.formats = [fmt for fmt, _ in shards]
        for i, (fmt, tensor) in enumerate(shards):
            if fmt is not None:
                ops.quant.check_qweight(tensor, fmt, in_features)
            elif tensor.dim() != 2 or tensor.shape[1] != in_features:
                raise ValueError(f"shard {i}: fp32 weight must be [rows, {in_features}]; got {tuple(tensor.shape)}")
            self.register_buffer(f"shard{i}", tensor.contiguous())
        self.out_features = sum(t.shape[0] for _, t in shards)
        if bias is not None and (bias.shape != (self.out_features,) or bias.dtype != torch.float32):
            raise ValueError(f"bias must be fp32 [{self.out_features}]; got {tuple(bias.shape)} {bias.dtype}")
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.int8_activations = int8_activations  # False: fp32 activations (exact, slower)

    def shards(self) -> list[tuple[QuantFormat | None, torch.Tensor]]:
        """The weight's row shards, in order."""
        return [(fmt, getattr(self, f"shard{i}")) for i, fmt in enumerate(self.formats)]

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 `[out_features, in_features]` (for tests and tools; the forward never builds it)."""
        return torch.cat([t if fmt is None else ops.dequantize(t, fmt, self.in_features)
                          for fmt, t in self.shards()])

    def forward(self, x: torch.Tensor, rows: LinearRows = PLAIN_ROWS) -> torch.Tensor:
        out = self._base(x, rows)
        return out if rows.lora is None or self.lora is None else self.lora.add(x, out, rows.lora, rows.ops)

    def _base(self, x: torch.Tensor, rows: LinearRows) -> torch.Tensor:
        if len(self.formats) == 1:  # the common case, kept short: a decode step runs ~120 of these
            return self._shard(x, self.formats[0], self._buffers["shard0"], self.bias, rows)
        out = torch.cat([self._shard(x, fmt, t, None, rows) for fmt, t in self.shards()], dim=-1)
        return out if self.bias is None else out + self.bias

    def _shard(self, x: torch.Tensor, fmt: QuantFormat | None, t: torch.Tensor | None,
               bias: torch.Tensor | None, rows: LinearRows) -> torch.Tensor:
        assert t is not None
        policy = rows.ops
        if fmt is None:
            return ops.linear(x, t, bias, policy=policy)
        if rows.bf16 and fmt.name in ops.quant.BF16_FORMATS:  # others: as with fp32 linears
            if ops.quant.bf16_all_rows(policy) or x.dim() != 2:
                return ops.quant.quant_linear(x, t, fmt, bias, checked=True, bf16=True, policy=policy)
            return self._bf16_prompt_rows(x, fmt, t, bias, rows)
        exact = rows.exact_rows
        ranges = rows.exact_ranges if exact else None
        if ranges is not None and x.dim() == 2:
            return _by_ranges(x, ranges, lambda part, n: ops.quant.quant_linear(
                part, t, fmt, bias, self.int8_activations, checked=True, exact_rows=n, policy=policy))
        return ops.quant.quant_linear(x, t, fmt, bias, self.int8_activations, checked=True,  # checked in __init__
                                      exact_rows=exact, policy=policy)

    def _bf16_prompt_rows(self, x: torch.Tensor, fmt: QuantFormat, t: torch.Tensor,
                          bias: torch.Tensor | None, rows: LinearRows) -> torch.Tensor:
        """A step's exact rows (`LinearRows.exact_rows` / `exact_ranges`: its prompt tokens) in bf16,
        the others on the kernel's int8 rows (fp32 ones without `int8_activations`), each segment
        written straight into one output: a concatenation copied a mixed step's decode rows per linear."""
        count = x.shape[0]
        exact = min(rows.exact_rows, count)
        given = rows.exact_ranges if exact else ()  # (): a step with no prompt rows
        ranges = [(a, b) for a, b in (((0, exact),) if given is None else given) if b > a]
        out = x.new_empty((count, t.shape[0]))
        row = 0
        for start, end in [*ranges, (count, count)]:
            if start > row and self.int8_activations:
                ops.quant.quant_linear(x[row:start], t, fmt, bias, checked=True, per_row=True, out=out[row:start],
                                       policy=rows.ops)
            elif start > row:  # fp32 activations for every row (`int8_activations` off)
                ops.quant.quant_linear(x[row:start], t, fmt, bias, False, checked=True, out=out[row:start],
                                       policy=rows.ops)
            if end > start:
                ops.quant.quant_linear(x[start:end], t, fmt, bias, checked=True, bf16=True, out=out[start:end],
                                       policy=rows.ops)
            row = max(row, end)
        return out

    def extra_repr(self) -> str:
        names = ",".join("F32" if f is None else f.name for f in self.formats)
        return f"in_features={self.in_features}, out_features={self.out_features}, formats={names}"


def _by_ranges(x: torch.Tensor, ranges: tuple[tuple[int, int], ...],
               linear: Callable[[torch.Tensor, int], torch.Tensor]) -> torch.Tensor:
    """`linear(part, exact_rows)` over consecutive row segments of `x`, each wholly inside or
    outside `ranges` (sorted, disjoint), joined: the kernel's exact rows are a leading count."""
    parts, row = [], 0
    for start, end in ranges:
        if end <= start:
            continue
        if start > row:
            parts.append(linear(x[row:start], 0))
        parts.append(linear(x[start:end], end - start))
        row = end
    if row < x.shape[0]:
        parts.append(linear(x[row:], 0))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def all_linears_quantized(model: nn.Module) -> bool:
    """Whether every linear layer of `model` is a `QuantLinear` with only packed shards (its steps
    of up to `ops.quant.QUANT_GEMV_MAX_ROWS` rows then run no oneDNN GEMM), MoE routers aside (fp32
    on `fixed_gemm` at every row count: `engine.model.moe.RouterLinear`)."""
    from engine.model.moe import RouterLinear

    linears = [m for m in model.modules()
               if isinstance(m, (nn.Linear, QuantLinear)) and not isinstance(m, RouterLinear)]
    return bool(linears) and all(isinstance(m, QuantLinear) and None not in m.formats for m in linears)


class QuantEmbedding(nn.Module):
    """Token embedding over a packed `[vocab, hidden]` weight: `forward(ids)` dequantizes the looked-up rows."""

    def __init__(self, fmt: QuantFormat, qweight: torch.Tensor, embedding_dim: int) -> None:
        super().__init__()
        ops.quant.check_qweight(qweight, fmt, embedding_dim)
        self.fmt = fmt
        self.embedding_dim = embedding_dim
        self.qweight: torch.Tensor
        self.register_buffer("qweight", qweight.contiguous())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight.index_select(0, ids.reshape(-1))
        return ops.dequantize(rows, self.fmt, self.embedding_dim).view(*ids.shape, self.embedding_dim)
