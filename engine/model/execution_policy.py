"""How a model computes, fixed when it is built (`ExecutionPolicy`), and which arithmetic each row of
one step gets in the packed linears (`LinearRows`, made by the model's forward from its policy and
the step's `AttentionMetadata`, handed to every linear as an argument)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ops.policy import FASTEST, OpsPolicy

if TYPE_CHECKING:
    from engine.model.lora.slots import LoRARows


@dataclass(frozen=True, slots=True)
class ExecutionPolicy:
    """The execution modes of one model, given to its constructor (`load_model(..., policy=)`) and
    never changed afterwards; the engine builds it from its config (`capacity.engine_policy`)."""

    dtype: torch.dtype = torch.float32  # parameters, activations and the default KV cache dtype
    # greedy rows through the lm_head's bf16 screen (`LogitScreen`, `QuantLogitScreen`) where it applies
    logit_screen: bool = True
    # quantized linears with int8 activations: a step's prompt rows keep fp32 ones (the dequantized
    # model's prompt logits and first token); False rounds them to int8 too (faster prefill on the
    # eight-row Q4 layouts; near-ties of the first token may then flip: `--int8-prompt-activations`)
    exact_prompt_rows: bool = True
    # quantized linears in bf16 (dtype bfloat16 on a GGUF): steps of many rows run every linear on AMX
    # tiles (`ops.quant.bf16_step`), or (AVX512-BF16, deterministic mode) a step's prompt rows compute
    # in bf16 at any count; the other rows keep the int8 / fp32 kernels
    bf16_linears: bool = False
    fused_decoder: bool = True  # the decoder layers in one C++ call where `FusedDecoder` applies
    # kernels or the torch reference, fastest or fixed-order arithmetic: passed to every op the model
    # calls (through `LinearRows.ops` in a step), so models of two engines in one process keep their own
    ops: OpsPolicy = FASTEST


@dataclass(frozen=True, slots=True)
class LinearRows:
    """One step's arithmetic in the packed linears (`QuantLinear`); other linears ignore it.

    `exact_rows`: leading rows that keep fp32 activations under `int8_activations` (the step's prompt
    tokens, where the policy keeps `exact_prompt_rows`): a prompt's first token and logprobs are
    then the dequantized model's, whatever the step's size. `exact_ranges`: where those rows are not
    simply the leading prefill rows, their sorted `[start, end)` ranges (a recomputed sequence's
    prefill holds its generated tokens after its prompt, which keep the int8 activations their
    decode steps had: `StepInputs.exact_ranges`); None otherwise, and always None without exact
    rows. `bf16`: the linears compute in bf16 (`ops.quant.quant_linear(..., bf16=True)`): every row where
    `ops.quant.bf16_all_rows()`, else the exact rows in bf16 and the others on int8 activations.
    `lora`: the step's rows with a LoRA adapter; every linear holding adapter slots adds their
    products (`engine.model.lora`), whatever its kind. `ops`: the model's `ExecutionPolicy.ops`, what
    every op of the step is passed (the norms, rotary and attention take it from here too)."""

    exact_rows: int = 0
    exact_ranges: tuple[tuple[int, int], ...] | None = None
    bf16: bool = False
    lora: LoRARows | None = None
    ops: OpsPolicy = FASTEST


PLAIN_ROWS = LinearRows()  # no exact rows, no bf16, the fastest kernels: every row on the linear's own kernel
