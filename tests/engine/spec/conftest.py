"""A tiny model whose greedy output soon cycles (attention and MLP outputs scaled down, so the
next token depends mostly on the current one), so n-gram proposals are accepted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.fixtures.models import make_tiny_model_dir


@pytest.fixture(scope="session")
def looping_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    path = make_tiny_model_dir(tmp_path_factory.mktemp("looping-llama"), seed=3)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.15)
            layer.mlp.down_proj.weight.mul_(0.15)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def markov_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The next token's distribution depends only on the current token (attention and MLP outputs
    zeroed), peaked (lm_head x 3): sampling often follows the prompt's cycle, and not always."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model_dir(tmp_path_factory.mktemp("markov-llama"), seed=3)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.mul_(3.0)
    model.save_pretrained(str(path))
    return path
