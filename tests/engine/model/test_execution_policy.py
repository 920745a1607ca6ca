"""A model's execution policy is fixed at construction: frozen, not reassignable, and the flags it
replaced cannot be set on the model (they would change nothing)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.model.execution_policy import ExecutionPolicy
from engine.model.loader import ModelLoadError, load_model


def test_policy_is_given_at_construction_and_cannot_change(tiny_llama_dir: Path) -> None:
    policy = ExecutionPolicy(logit_screen=False, fused_decoder=False)
    model = load_model(tiny_llama_dir, policy=policy)
    assert model.policy is policy
    with pytest.raises(dataclasses.FrozenInstanceError):
        model.policy.logit_screen = True  # type: ignore[misc]
    with pytest.raises(AttributeError):
        model.policy = ExecutionPolicy()  # type: ignore[misc]
    for retired in ("use_logit_screen", "exact_prompt_rows", "bf16_linears", "use_fused_decoder"):
        with pytest.raises(AttributeError, match="ExecutionPolicy"):
            setattr(model, retired, True)
    assert model.policy is policy and model.logit_screen() is None and model.fused_decoder() is None


def test_load_model_keeps_dtype_and_policy_consistent(tiny_llama_dir: Path) -> None:
    assert load_model(tiny_llama_dir, "bfloat16").policy.dtype == torch.bfloat16  # the default policy in dtype
    assert next(load_model(tiny_llama_dir, policy=ExecutionPolicy(dtype=torch.bfloat16)).parameters()).dtype \
        == torch.bfloat16
    with pytest.raises(ModelLoadError, match="disagrees"):
        load_model(tiny_llama_dir, "float32", policy=ExecutionPolicy(dtype=torch.bfloat16))
