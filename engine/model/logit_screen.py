"""Greedy tokens through a bf16 screen of the lm_head, decided in fp32 (`ops.screened_argmax`).

The lm_head is the largest GEMM of a small model (a fifth of SmolLM2's decode FLOPs, four fifths
of a 2-layer model's). Where the CPU has bf16 dot products, greedy rows run it in bf16 (several
times faster), and the few tokens that could still be the maximum get their exact fp32 logit. The token
is the fp32 argmax: greedy decoding is unchanged. The price is a bf16 copy of the lm_head weight
(half its fp32 bytes; 57 MB for SmolLM2).
"""

from __future__ import annotations

import torch
from torch import Tensor

import ops
from ops.policy import FASTEST, OpsPolicy

SCREEN_GROUP_BYTES = 24 << 20  # bf16 screen logits of one group of rows: under a 32 MiB L3


class LogitScreen:
    """The screen of one fp32 CPU lm_head weight `[vocab, hidden]`: its packed bf16 copy and row norms;
    its ops run under `policy` (the model's `ExecutionPolicy.ops`)."""

    def __init__(self, weight: Tensor, policy: OpsPolicy = FASTEST) -> None:
        self.weight = weight.detach().contiguous()
        self.policy = policy
        self.packed = ops.pack_screen_weight(self.weight)
        self.norms = ops.weight_norms(self.weight)

    @staticmethod
    def usable(weight: Tensor, policy: OpsPolicy = FASTEST) -> bool:
        """An fp32 CPU weight, the compiled kernels selected (`policy`), and a CPU with bf16 dot products."""
        return not policy.reference and ops.can_pack(weight) and ops.native_bf16()

    def argmax(self, hidden: Tensor) -> Tensor:
        """int64 `[rows]`: the first maximum of each row's fp32 logits `hidden @ weight.T`."""
        group = max(1, SCREEN_GROUP_BYTES // (2 * self.weight.shape[0]))
        parts = [self._argmax(part) for part in hidden.split(group)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _argmax(self, hidden: Tensor) -> Tensor:
        hidden = hidden.contiguous()
        tokens = ops.screened_argmax(ops.screen_logits(hidden, self.packed), hidden, self.weight, self.norms,
                                     policy=self.policy)
        unscreened = (tokens < 0).nonzero().squeeze(1)
        if unscreened.numel():  # a non-finite value: the full fp32 logits decide, as without the screen
            rows = hidden.index_select(0, unscreened)
            tokens[unscreened] = ops.linear(rows, self.weight, policy=self.policy).max(dim=-1).indices
        return tokens
