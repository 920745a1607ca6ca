"""RoPE scaling variants agree with transformers' own definitions; unsupported ones fail clearly."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.model.rope import RotaryEmbedding, rope_inv_freq
from engine.model.spec import ModelSpec

CASES: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    "yarn-mscale": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 4096,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
}


def _config(params: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig(hidden_size=1024, num_attention_heads=8, max_position_embeddings=131072,
                       rope_parameters={"rope_theta": 500000.0, **params})


@pytest.mark.parametrize("case", sorted(CASES))
def test_inverse_frequencies_match_transformers(case: str) -> None:
    config = _config(CASES[case])
    expected, expected_scale = ROPE_INIT_FUNCTIONS[CASES[case]["rope_type"]](config, "cpu")
    spec = ModelSpec.from_hf_config(config)
    inv_freq, scale = rope_inv_freq(spec.rope, spec.head_dim, spec.max_position_embeddings)
    torch.testing.assert_close(inv_freq, expected.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(expected_scale)
    default, _ = rope_inv_freq({"rope_theta": 500000.0}, spec.head_dim, spec.max_position_embeddings)
    assert not torch.equal(inv_freq, default)


def test_v4_style_rope_scaling_is_read() -> None:
    legacy: dict[str, Any] = {"rope_theta": 1234.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, **legacy)
    rope = ModelSpec.from_hf_config(config).rope
    assert rope["rope_type"] == "linear" and rope["rope_theta"] == 1234.0 and rope["factor"] == 2.0


@pytest.mark.parametrize("rope_type", ["made-up", "su"])
def test_unsupported_rope_types_are_rejected(rope_type: str) -> None:
    with pytest.raises(ValueError, match=f"unsupported rope_scaling type '{rope_type}'.*linear"):
        RotaryEmbedding({"rope_type": rope_type, "factor": 2.0}, 64, 2048)


def test_rotation_keeps_norms_and_relative_positions() -> None:
    rope = RotaryEmbedding({"rope_theta": 10000.0}, 32, 512)
    gen = torch.Generator().manual_seed(0)  # seeded: fp32 at position 3000 is close to the tolerance
    q, k = torch.randn(1, 2, 32, generator=gen).expand(6, 2, 32), torch.randn(1, 1, 32, generator=gen).expand(6, 1, 32)
    positions = torch.tensor([0, 5, 100, 105, 3000, 3005])  # past the initial cache: it grows
    rq, rk = rope(positions, q, k)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    dots = (rq[[0, 2, 4]] * rk[[1, 3, 5]]).sum(-1)  # same offset 5 at three absolute positions
    torch.testing.assert_close(dots, dots[:1].expand_as(dots), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["default", *sorted(CASES)])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_fused_rope_matches_apply_rotary(case: str, backend: str) -> None:
    """The model's table through the fused kernel rotates exactly as the HF-style cos/sin path."""
    import ops

    rope = RotaryEmbedding({"rope_theta": 500000.0, **CASES.get(case, {})}, 64, 131072)
    positions = torch.tensor([0, 1, 7, 4095, 4096, 9000, 131071])
    query, key = torch.randn(7, 6, 64), torch.randn(7, 2, 64)
    want_q, want_k = rope(positions, query, key)
    got_q, got_k = query.clone(), key.clone()
    empty = torch.empty(0, 2, 16, 64)
    ops.rotary_embedding_and_cache(positions, got_q, got_k, key.clone(), rope.table(positions), empty, empty,
                                   torch.full((7,), -1), policy=ops.OpsPolicy.of(backend))
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
