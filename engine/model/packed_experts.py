"""A sparse MoE block's experts kept in their GGUF blocks (`ops.quant`), run by the dense layers' kernel.

`PackedExperts` is `engine.model.moe.Experts` with each expert's gate/up rows and down rows packed
(`[E, rows, row_bytes]` uint8 per shard, Q4_0 / Q4_1 in the kernel's eight-row layout as
`QuantLinear` holds them): memory is the file's, not 4 bytes per weight. The grouped step runs each
active expert's rows through `ops.quant.quant_linear(..., per_row=True)`, the packed linears' kernel at every
row count, so a token's expert outputs are the same bits whether its expert got 1 row or 500 (the
dense `quant_linear` hands more than `QUANT_GEMV_MAX_ROWS` rows to oneDNN). Activations as in
`QuantLinear`: int8 per 32-block, except a step's exact rows (`LinearRows`: its prompt tokens),
which keep fp32 ones. bf16 linears (`LinearRows.bf16`) do not reach the experts: they keep those kernels.
gpt-oss's experts (`MoESpec.expert_bias`, `CLAMPED_SWIGLU`) carry biases, `Experts`' parameters
`gate_up_proj_bias [E, 2I]` (gate then up) and `down_proj_bias [E, H]`, added to the kernel's outputs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import ops
from engine.model.execution_policy import PLAIN_ROWS, LinearRows
from engine.model.moe import clamped_swiglu, group_by_expert, sum_by_token
from engine.model.moe_spec import ACTIVATIONS, SILU, MoESpec
from ops.moe import MOE_CLAMPED_SWIGLU, MOE_SILU, packed_moe_experts
from ops.policy import OpsPolicy
from ops.quant import QuantFormat, interleave

Shard = tuple[QuantFormat, Tensor]  # a format and its rows of every expert, [E, rows, row_bytes] uint8


def exact_row_mask(rows: LinearRows, count: int) -> Tensor | None:
    """Which of a step's `count` rows keep fp32 activations (`LinearRows.exact_rows` / `exact_ranges`),
    None when none do."""
    if not rows.exact_rows or count == 0:
        return None
    mask = torch.zeros(count, dtype=torch.bool)
    for start, end in rows.exact_ranges or ((0, rows.exact_rows),):
        mask[start:min(end, count)] = True
    return mask


def interleave_experts(fmt: QuantFormat, data: Tensor) -> Shard:
    """`[E, rows, row_bytes]` packed rows in the kernel's eight-row layout where `fmt` has one."""
    parts = [interleave(expert, fmt) for expert in data]
    return parts[0][1], torch.stack([p for p, _ in parts])


class PackedExperts(nn.Module):
    """SwiGLU experts on packed rows: `gate_up` shards (each expert's gate rows then up rows: one shard
    when their formats agree, else two) and `down` (`[E, hidden, row_bytes]`); with `spec.expert_bias`
    the biases as `Experts` names them (zeros until loaded). `forward` has `Experts`' contract plus the
    step's `LinearRows`."""

    def __init__(self, spec: MoESpec, hidden_size: int, gate_up: list[Shard], down: Shard,
                 int8_activations: bool = True) -> None:
        super().__init__()
        if spec.activation not in ACTIVATIONS:
            raise ValueError(f"packed experts implement {', '.join(ACTIVATIONS)}; got {spec.activation!r}")
        self.spec, self.hidden_size = spec, hidden_size
        e = spec.num_experts
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * spec.intermediate_size), requires_grad=False) \
            if spec.expert_bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(e, hidden_size), requires_grad=False) \
            if spec.expert_bias else None
        self.int8_activations = int8_activations  # False: fp32 activations (exact, slower)
        self.formats = [fmt for fmt, _ in gate_up] + [down[0]]
        rows = sum(t.shape[1] for _, t in gate_up)
        if rows != 2 * spec.intermediate_size or down[1].shape[1] != hidden_size:
            raise ValueError(f"packed experts have {rows} gate/up rows and {down[1].shape[1]} down rows; "
                             f"expected {2 * spec.intermediate_size} and {hidden_size}")
        for i, (fmt, t) in enumerate([*gate_up, down]):
            k = spec.intermediate_size if i == len(gate_up) else hidden_size
            if t.dim() != 3 or t.shape[0] != spec.num_experts:
                raise ValueError(f"packed expert shard {i} must be [{spec.num_experts}, rows, bytes]; "
                                 f"got {tuple(t.shape)}")
            ops.quant.check_qweight(t[0], fmt, k)
            self.register_buffer(f"shard{i}", t.contiguous())

    def shards(self) -> list[Shard]:
        """The gate/up shards, then down."""
        return [(fmt, getattr(self, f"shard{i}")) for i, fmt in enumerate(self.formats)]

    def dequantized(self) -> tuple[Tensor, Tensor]:
        """fp32 `(gate_up [E, 2I, H], down [E, H, I])`, `Experts`' parameters (for tests and tools)."""
        *gate_up, (fmt, down) = self.shards()
        i, h = self.spec.intermediate_size, self.hidden_size
        stacked = torch.stack([torch.cat([ops.dequantize(t[e], f, h) for f, t in gate_up])
                               for e in range(self.spec.num_experts)])
        return stacked, torch.stack([ops.dequantize(d, fmt, i) for d in down])

    def forward(self, x: Tensor, tokens: Tensor, weights: Tensor, counts: list[int],
                rows: LinearRows = PLAIN_ROWS) -> Tensor:
        """`x [T, H]`; `tokens`, `weights`, `counts` from `group_by_expert` -> `[T, H]`: each token's sum,
        in ascending expert order, of weight x expert(x); its rows in `rows`' exact set on fp32 activations."""
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        exact = exact_row_mask(rows, x.shape[0]) if self.int8_activations else None
        *gate_up, down = self.shards()
        outputs = x.new_empty((tokens.shape[0], x.shape[1]))  # each pair's weighted output, in the pairs' order
        pair_tokens = tokens if exact is None else tokens.clone()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            picked, w = tokens[start:start + n], weights[start:start + n, None]
            num_exact = n if not self.int8_activations else 0
            if exact is not None:
                fp32_rows = exact.index_select(0, picked)
                num_exact = int(fp32_rows.sum())
                if 0 < num_exact < n:  # the kernel takes exact rows as a leading count
                    order = torch.argsort((~fp32_rows).to(torch.uint8), stable=True)
                    picked, w = picked.index_select(0, order), w.index_select(0, order)
                    pair_tokens[start:start + n] = picked
            xe = x.index_select(0, picked)
            parts = [self._linear(xe, fmt, t[e], num_exact, rows.ops) for fmt, t in gate_up]
            h = self._activate(parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1), e, rows.ops)
            y = self._linear(h, down[0], down[1][e], num_exact, rows.ops)
            if self.down_proj_bias is not None:
                y += self.down_proj_bias[e]
            torch.mul(y, w, out=outputs[start:start + n])
            start += n
        return sum_by_token(outputs, pair_tokens, x.shape[0])

    def routed(self, x: Tensor, experts: Tensor, weights: Tensor, rows: LinearRows = PLAIN_ROWS) -> Tensor:
        """`forward` on the router's choices `experts`, `weights [T, k]`: on the CPU kernels (fp32) one
        C++ call, `ops.moe.packed_moe_experts`, the same bits; elsewhere grouped here, then `forward`."""
        if rows.ops.reference or not x.is_cpu or x.dtype != torch.float32 or weights.dtype != torch.float32:
            return self(x, *group_by_expert(experts, weights, self.spec.num_experts), rows)
        exact = exact_row_mask(rows, x.shape[0]) if self.int8_activations else None
        *gate_up, down = self.shards()
        activation = MOE_SILU if self.spec.activation == SILU else MOE_CLAMPED_SWIGLU
        return packed_moe_experts(x.contiguous(), experts, weights, gate_up, down, exact, self.int8_activations,
                                  activation, self.spec.swiglu_alpha, self.spec.swiglu_limit,
                                  self.gate_up_proj_bias, self.down_proj_bias)

    def _activate(self, gate_up: Tensor, e: int, policy: OpsPolicy) -> Tensor:
        """Expert `e`'s activation of its gate/up outputs `[n, 2I]` (its bias added first)."""
        if self.gate_up_proj_bias is not None:
            gate_up += self.gate_up_proj_bias[e]
        if self.spec.activation == SILU:
            return ops.silu_and_mul(gate_up, policy=policy)
        return clamped_swiglu(gate_up, self.spec.swiglu_alpha, self.spec.swiglu_limit)

    def _linear(self, x: Tensor, fmt: QuantFormat, qweight: Tensor, exact_rows: int, policy: OpsPolicy) -> Tensor:
        return ops.quant.quant_linear(x, qweight, fmt, None, self.int8_activations, checked=True, exact_rows=exact_rows,
                                      per_row=True, policy=policy)

    def extra_repr(self) -> str:
        return (f"experts={self.spec.num_experts}, hidden={self.hidden_size}, "
                f"intermediate={self.spec.intermediate_size}, formats={','.join(f.name for f in self.formats)}")
