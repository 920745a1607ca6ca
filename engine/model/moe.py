"""The sparse mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss) on the fused ops.

`SparseMoE` has `SwiGLU`'s contract, `x [T, hidden] -> [T, hidden]`: a router picks each token's
top-k experts and their weights exactly as transformers does for the family (`MoESpec.router`),
then the experts run grouped per step: the step's (token, expert) pairs sorted by expert, one
gate_up GEMM, activation and down GEMM per active expert over that expert's rows, each output
scaled by its routing weight and added back into its token's row (experts in ascending order, as
transformers adds them).

Arithmetic per row: on the CPU in fp32 the router and every expert GEMM go through `fixed_gemm`
(`ops.pack_fixed` copies made on first use, extra memory one copy of the expert weights), whose
rows do not depend on how many rows share the call, so a token's routing and expert outputs are
the same bits whichever other tokens are in its step (it is as fast as the default kernels at
every row count); so does Qwen2-MoE's
one-row shared-expert gate. The shared expert is a plain `SwiGLU`, batch-invariant only under
`OpsPolicy.fixed_order` like every dense linear. bf16/fp16 and CUDA tensors use `F.linear`
per expert. A GGUF's experts in a packed format replace `Experts` with
`engine.model.packed_experts.PackedExperts` (same contract).

Tensor parallelism (`TPShard`, layout in `engine.model.sharding`): each rank holds every expert's
share of the intermediate features (and of the shared expert's), routes every token itself with
the replicated router, runs its experts' partial down products exactly as above, adds the shared
expert's partial output, and the block's output is all-reduced once. The router's input is the
residual stream after an all-reduce, the same bits on every rank (gloo's and NCCL's all-reduce
compute each element's sum once and send it to every rank; tests/engine/parallel/test_tp_moe.py
compares the ranks' choices), so every rank picks the same experts with the same weights.
What differs from one process: a token's output is the sum over ranks of each rank's weighted
partial sums, so the down products' K loop is split and the k experts' contributions are added
per rank before the ranks' sums are added (rounding only: the tests' tiny fp32 models give logits
within 1e-5 of one process's and the same greedy tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import ops
from engine.model.execution_policy import PLAIN_ROWS, LinearRows
from engine.model.layers import Linear, SwiGLU
from engine.model.moe_spec import CLAMPED_SWIGLU, SOFTMAX_TOPK, MoESpec
from engine.model.sharding import SINGLE, TPShard
from engine.model.spec import UnsupportedModelError
from ops.linear import fixed_linear
from ops.moe import MOE_SOFTMAX_TOPK, MOE_TOPK_SOFTMAX, moe_route
from ops.policy import OpsPolicy


def _fixed_path(x: Tensor, policy: OpsPolicy) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32 and not policy.reference


class RouterLinear(Linear):
    """`Linear` whose fp32 CPU rows always go through `fixed_gemm` (one arithmetic per row)."""

    def forward(self, x: Tensor, rows: LinearRows = PLAIN_ROWS) -> Tensor:
        if not _fixed_path(x, rows.ops):
            return super().forward(x, rows)
        if self.fixed is None or self.fixed.shape[1] != self.in_features:
            self.fixed = ops.pack_fixed(self.weight)
        return ops.linear(x, self.weight, self.bias, fixed=self.fixed, policy=rows.ops)


def group_by_expert(experts: Tensor, weights: Tensor, num_experts: int) -> tuple[Tensor, Tensor, list[int]]:
    """`experts [T, k]` (int64 ids), `weights [T, k]` -> the pairs sorted by expert (stable: within an
    expert, in token order): `(tokens [T k] int64, weights [T k], counts per expert)`."""
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return torch.div(order, experts.shape[1], rounding_mode="floor"), weights.reshape(-1).index_select(0, order), counts


def sum_by_token(outputs: Tensor, pair_tokens: Tensor, num_tokens: int) -> Tensor:
    """`[T, H]`: each token's rows of `outputs [T k, H]` (`pair_tokens` names each row's token, every token
    `k` times) added left to right in their order there (by expert, ascending): `index_add_` into zeros'
    sum, without a parallel region per expert (on a loaded machine each waits for a descheduled thread)."""
    k = outputs.shape[0] // num_tokens
    grouped = outputs.index_select(0, torch.argsort(pair_tokens, stable=True)).view(num_tokens, k, -1)
    out = grouped[:, 0].clone()
    for j in range(1, k):
        out.add_(grouped[:, j])
    return out


def clamped_swiglu(gate_up: Tensor, alpha: float, limit: float) -> Tensor:
    """gpt-oss's activation of `gate_up [T, 2I]` (gate columns then up): `(clamp(up, ±limit) + 1) *
    g * sigmoid(alpha g)` with `g = min(gate, limit)`, in transformers' order of operations."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class Experts(nn.Module):
    """`num_experts` SwiGLU experts stacked: `gate_up_proj [E, 2I, H]` (each expert's gate rows then
    its up rows), `down_proj [E, H, I]`, and with `MoESpec.expert_bias` their biases `[E, 2I]`, `[E, H]`
    (transformers 5's parameter names and layout for Qwen and Mixtral)."""

    def __init__(self, spec: MoESpec, hidden_size: int, down_bias: bool = True) -> None:
        """`spec` is this rank's (`TPShard.local_moe`); `down_bias` False drops the down bias (a
        tensor-parallel rank other than 0: the bias is added once, by rank 0)."""
        super().__init__()
        e, i = spec.num_experts, spec.intermediate_size
        self.spec = spec
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(e, hidden_size, i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i)) if spec.expert_bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(e, hidden_size)) if spec.expert_bias and down_bias else None
        self.fixed: tuple[Tensor, Tensor] | None = None  # `ops.pack_fixed` of each expert, stacked

    def fixed_weights(self) -> tuple[Tensor, Tensor]:
        """The experts' `fixed_gemm` copies `[E, P, K, 16]`, made on first use (after loading)."""
        if self.fixed is None:
            self.fixed = (torch.stack([ops.pack_fixed(w) for w in self.gate_up_proj.detach()]),
                          torch.stack([ops.pack_fixed(w) for w in self.down_proj.detach()]))
        return self.fixed

    def _activate(self, gate_up: Tensor, policy: OpsPolicy) -> Tensor:
        if self.spec.activation == CLAMPED_SWIGLU:
            return clamped_swiglu(gate_up, self.spec.swiglu_alpha, self.spec.swiglu_limit)
        return ops.silu_and_mul(gate_up, policy=policy)

    def routed(self, x: Tensor, experts: Tensor, weights: Tensor, rows: LinearRows = PLAIN_ROWS) -> Tensor:
        """`forward` on the router's choices `experts`, `weights [T, k]` (grouped here: `group_by_expert`)."""
        return self(x, *group_by_expert(experts, weights, self.spec.num_experts), rows)

    def forward(self, x: Tensor, tokens: Tensor, weights: Tensor, counts: list[int],
                rows: LinearRows = PLAIN_ROWS) -> Tensor:
        """`x [T, H]`; `tokens`, `weights`, `counts` from `group_by_expert` -> `[T, H]`: for each token
        the sum over its experts, in ascending expert order, of weight x expert(x). `rows` is for
        `PackedExperts`' contract: fp32 experts compute every row alike."""
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        outputs = x.new_empty((tokens.shape[0], x.shape[1]))  # each pair's weighted output, in the pairs' order
        fixed = self.fixed_weights() if _fixed_path(x, rows.ops) else None
        hidden, inter = self.down_proj.shape[1], self.down_proj.shape[2]
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            picked, w = tokens[start:start + n], weights[start:start + n, None]
            start += n
            b1 = None if self.gate_up_proj_bias is None else self.gate_up_proj_bias[e]
            b2 = None if self.down_proj_bias is None else self.down_proj_bias[e]
            xe = x.index_select(0, picked)
            if fixed is not None:
                gate_up = fixed_linear(xe, fixed[0][e], 2 * inter, b1)
                y = fixed_linear(self._activate(gate_up, rows.ops), fixed[1][e], hidden, b2)
            else:
                y = F.linear(self._activate(F.linear(xe, self.gate_up_proj[e], b1), rows.ops), self.down_proj[e], b2)
            outputs[start - n:start] = y * w
        return sum_by_token(outputs, tokens, x.shape[0])


class SparseMoE(nn.Module):
    """Router, grouped experts and (Qwen2-MoE) the gated shared expert: `x [T, H] -> [T, H]`.
    Parameter names are transformers 5's: `gate` (the router), `experts.*`, `shared_expert.*`
    (its gate/up stacked as in `SwiGLU`), `shared_expert_gate`. Under tensor parallelism `spec` is
    this rank's share (`TPShard.local_moe`), `full_spec` the model's."""

    def __init__(self, spec: MoESpec, hidden_size: int, shard: TPShard = SINGLE) -> None:
        super().__init__()
        if spec.intermediate_size % shard.size or spec.shared_expert_size % shard.size:
            raise UnsupportedModelError(f"tensor_parallel_size {shard.size} does not divide the experts' intermediate "
                                        f"size {spec.intermediate_size} (shared expert: {spec.shared_expert_size})")
        self.full_spec = spec
        self.spec = spec = shard.local_moe(spec)
        self.shard = shard
        self.gate = RouterLinear(hidden_size, spec.num_experts, bias=spec.router_bias)
        self.experts = Experts(spec, hidden_size, down_bias=shard.rank == 0)
        self.shared_expert: SwiGLU | None = None
        self.shared_expert_gate: RouterLinear | None = None
        if spec.shared_expert_size:  # this rank's features; its partial output joins the block's all-reduce
            self.shared_expert = SwiGLU(hidden_size, spec.shared_expert_size, bias=False)
            self.shared_expert_gate = RouterLinear(hidden_size, 1, bias=False)

    def route(self, x: Tensor, rows: LinearRows = PLAIN_ROWS) -> tuple[Tensor, Tensor]:
        """`(weights [T, k], experts [T, k] int64)` as transformers' router of the family computes them."""
        logits = self.gate(x, LinearRows(ops=rows.ops))  # the router: no exact rows, no adapter
        k = self.spec.top_k
        if _fixed_path(logits, rows.ops):  # the same ATen ops in one call
            router = MOE_SOFTMAX_TOPK if self.spec.router == SOFTMAX_TOPK else MOE_TOPK_SOFTMAX
            weights, experts = moe_route(logits, k, router, self.spec.norm_topk_prob)
        elif self.spec.router == SOFTMAX_TOPK:
            weights, experts = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), k, dim=-1)
            if self.spec.norm_topk_prob:
                weights /= weights.sum(dim=-1, keepdim=True)
        else:
            top, experts = torch.topk(logits, k, dim=-1)
            weights = torch.softmax(top, dim=1, dtype=top.dtype)
        return (weights.to(x.dtype) if self.spec.weights_in_model_dtype else weights), experts

    def forward(self, x: Tensor, rows: LinearRows = PLAIN_ROWS) -> Tensor:
        """`rows` reach the shared expert's linears and the experts (packed ones: `PackedExperts`)."""
        weights, experts = self.route(x, rows)
        out = self.experts.routed(x, experts, weights, rows)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            gate = torch.sigmoid(self.shared_expert_gate(x, LinearRows(ops=rows.ops)))
            out = out + gate * self.shared_expert(x, rows)
        return self.shard.all_reduce(out)
