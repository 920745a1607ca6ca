"""What the GGUF-writing tests share: the decoder shape keys every llama.cpp architecture carries,
and the check that a packed model with fp32 activations gives transformers' logits."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.model.packed_experts import PackedExperts
from engine.model.quant_linear import QuantLinear
from tests.engine.model.test_sliding_window import prompt_ids
from tests.fixtures.models import PagedHarness, Seq


def add_decoder_shape(writer: Any, config: Any) -> None:
    """`{arch}.context_length`, `.embedding_length`, `.block_count`, `.feed_forward_length` and the
    attention head counts of a transformers `config` (a `gguf.GGUFWriter` names the arch)."""
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)


def assert_fp32_activation_logits_match(ours: nn.Module, hf: nn.Module) -> None:
    """With fp32 activations, the packed model's logits over a prefill and 14 decode steps are
    transformers' on the same (dequantized) weights, within 1e-4."""
    for module in ours.modules():
        if isinstance(module, (QuantLinear, PackedExperts)):
            module.int8_activations = False
    tokens = prompt_ids(24, 5)
    with torch.no_grad():
        reference = hf(torch.tensor([tokens])).logits[0]
    harness, seq = PagedHarness(ours, seed=2), Seq(tokens)
    logits = [harness.step([(seq, 10)], [])] + [harness.step([], [seq]) for _ in range(14)]
    torch.testing.assert_close(torch.cat(logits), reference, rtol=1e-4, atol=1e-4)
