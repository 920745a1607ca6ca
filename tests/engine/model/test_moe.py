"""`SparseMoE` against transformers' own MoE blocks (Qwen3-MoE, Qwen2-MoE with its shared expert,
Mixtral, gpt-oss) on random weights: outputs and routing, balanced and skewed routing, with and
without renormalised top-k; a token's output does not depend on the rest of its step; the config
parse and the checkpoint names."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import ops
from engine.model.execution_policy import LinearRows
from engine.model.moe import SparseMoE, group_by_expert
from engine.model.moe_spec import MoEConfigError, MoESpec, moe_spec_from_hf_config
from engine.model.moe_weights import expected_moe_pieces, load_moe_tensor
from engine.model.sharding import TPShard
from engine.model.spec import UnsupportedModelError

HIDDEN = 64


def hf_config(model_type: str, **overrides: Any) -> Any:
    from transformers import AutoConfig

    sizes: dict[str, Any] = {
        "qwen3_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48},
        "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 48,
                      "shared_expert_intermediate_size": 80},
        "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48},
        "gpt_oss": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48,
                    "swiglu_limit": 1.5},  # a low limit, so the clamps bite on these activations
    }[model_type]
    base = {"hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = AutoConfig.for_model(model_type, **{**base, **sizes, **overrides})
    config._experts_implementation = "eager"
    return config


def hf_block(config: Any, seed: int) -> nn.Module:
    """transformers' MoE block of the family with random weights (it allocates them uninitialised)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cls = {"qwen3_moe": Qwen3MoeSparseMoeBlock, "qwen2_moe": Qwen2MoeSparseMoeBlock,
           "mixtral": MixtralSparseMoeBlock, "gpt_oss": GptOssMLP}[config.model_type]
    block = cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.5 if "gate.weight" in name or "router" in name else 0.1))
    return block


def ours(config: Any, block: nn.Module) -> SparseMoE:
    spec = moe_spec_from_hf_config(config)
    assert spec is not None
    moe = SparseMoE(spec, HIDDEN)
    filled: set[str] = set()
    with torch.no_grad():
        for name, tensor in block.state_dict().items():
            filled |= load_moe_tensor(moe, name, tensor)
    assert filled == expected_moe_pieces(moe)
    return moe.eval()


def hf_forward(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = block(x.unsqueeze(0))
    return (out[0] if isinstance(out, tuple) else out).squeeze(0)


def hf_experts(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
    router = getattr(block, "gate", None) or block.router
    return router(x)[2].sort(dim=-1).values


def inputs(tokens: int, seed: int, skew: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    if not skew:
        return torch.randn(tokens, HIDDEN, generator=gen)
    base = torch.randn(HIDDEN, generator=gen)
    return base + 0.3 * torch.randn(tokens, HIDDEN, generator=gen)


def skew_router(block: nn.Module, x: torch.Tensor, expert: int) -> None:
    """Tilt the router towards `expert` along the inputs' common direction."""
    router = getattr(block, "gate", None) or block.router
    mean = x.mean(0)
    with torch.no_grad():
        router.weight[expert] += 4.0 * mean / mean.norm()


FAMILIES = [
    pytest.param("qwen3_moe", {"norm_topk_prob": True}, id="qwen3_moe-renorm"),
    pytest.param("qwen3_moe", {"norm_topk_prob": False}, id="qwen3_moe-no-renorm"),
    pytest.param("qwen3_moe", {"num_experts_per_tok": 4, "norm_topk_prob": True}, id="qwen3_moe-top4"),
    pytest.param("qwen2_moe", {"norm_topk_prob": False}, id="qwen2_moe-shared"),
    pytest.param("mixtral", {}, id="mixtral"),
    pytest.param("gpt_oss", {}, id="gpt_oss"),
]


@pytest.mark.parametrize(("model_type", "overrides"), FAMILIES)
@pytest.mark.parametrize("skew", [False, True], ids=["balanced", "skewed"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_transformers_block(model_type: str, overrides: dict[str, Any], skew: bool, seed: int) -> None:
    config = hf_config(model_type, **overrides)
    block = hf_block(config, seed)
    x = inputs(61, seed, skew)
    if skew:
        skew_router(block, x, expert=seed % 8)
    moe = ours(config, block)
    with torch.inference_mode():
        expected, got = hf_forward(block, x), moe(x)
        experts = moe.route(x)[1].sort(dim=-1).values
        assert torch.equal(experts, hf_experts(block, x))
    if skew:  # the tilted expert takes (nearly) every token
        assert (experts == seed % 8).any(dim=-1).float().mean() > 0.9
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got.abs().max() > 0.05  # not a vacuous comparison of near-zero outputs


@pytest.mark.parametrize(("model_type", "overrides"), FAMILIES[:1] + FAMILIES[3:])
def test_matches_transformers_block_bf16(model_type: str, overrides: dict[str, Any]) -> None:
    config = hf_config(model_type, **overrides)
    block = hf_block(config, 5)
    moe = ours(config, block).to(torch.bfloat16)
    x = inputs(23, 5, skew=False).to(torch.bfloat16)
    with torch.inference_mode():
        expected, got = hf_forward(block.to(torch.bfloat16), x), moe(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize(("model_type", "overrides"), FAMILIES)
def test_token_output_independent_of_its_step(model_type: str, overrides: dict[str, Any]) -> None:
    """Each row of a 40-token step equals the same token run alone and in another step, bit for bit
    (the shared expert's dense linears only under fixed order, as every dense linear)."""
    config = hf_config(model_type, **overrides)
    moe = ours(config, hf_block(config, 3))
    x = inputs(40, 3, skew=True)
    other = torch.cat([inputs(70, 4, skew=False)[:30], x[7:8], x[:5]])
    fixed = moe.shared_expert is not None
    rows = LinearRows(ops=ops.OpsPolicy(fixed_order=fixed))
    with torch.inference_mode():
        step = moe(x, rows)
        for i in (0, 7, 39):
            assert torch.equal(moe(x[i:i + 1], rows)[0], step[i])
        mixed = moe(other, rows)
    assert torch.equal(mixed[30], step[7])
    assert torch.equal(mixed[31:], step[:5])


def test_reference_backend_matches() -> None:
    config = hf_config("qwen3_moe", norm_topk_prob=True)
    block = hf_block(config, 0)
    moe = ours(config, block)
    x = inputs(19, 0, skew=False)
    with torch.inference_mode():
        got = moe(x, LinearRows(ops=ops.REFERENCE))
    with torch.inference_mode():
        torch.testing.assert_close(got, hf_forward(block, x), rtol=1e-5, atol=1e-5)


def test_per_expert_checkpoint_names_load_like_stacked() -> None:
    """`experts.{e}.gate_proj/up_proj/down_proj.weight` (Qwen) and `w1/w3/w2` (Mixtral) fill the same
    stacked parameters as transformers' in-memory `experts.gate_up_proj` / `down_proj`."""
    config = hf_config("qwen3_moe", norm_topk_prob=True)
    block = hf_block(config, 1)
    stacked = ours(config, block)
    spec = stacked.spec
    size = spec.intermediate_size
    for names in (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")):
        moe = SparseMoE(spec, HIDDEN)
        filled: set[str] = set()
        with torch.no_grad():
            filled |= load_moe_tensor(moe, "gate.weight", block.gate.weight)
            for e in range(spec.num_experts):
                gate_up = block.experts.gate_up_proj[e]
                filled |= load_moe_tensor(moe, f"experts.{e}.{names[0]}.weight", gate_up[:size])
                filled |= load_moe_tensor(moe, f"experts.{e}.{names[1]}.weight", gate_up[size:])
                filled |= load_moe_tensor(moe, f"experts.{e}.{names[2]}.weight", block.experts.down_proj[e])
        assert filled == expected_moe_pieces(moe)
        assert torch.equal(moe.experts.gate_up_proj, stacked.experts.gate_up_proj)
        assert torch.equal(moe.experts.down_proj, stacked.experts.down_proj)


def test_bad_checkpoint_names_and_shapes_raise() -> None:
    spec = MoESpec(num_experts=4, top_k=2, intermediate_size=16, sparse_layers=(0,))
    moe = SparseMoE(spec, HIDDEN)
    with pytest.raises(KeyError, match="expert 4 of 4"):
        load_moe_tensor(moe, "experts.4.gate_proj.weight", torch.zeros(16, HIDDEN))
    with pytest.raises(KeyError, match="no place"):
        load_moe_tensor(moe, "experts.gate_up_proj_blocks", torch.zeros(1))
    with pytest.raises(ValueError, match="shape mismatch"):
        load_moe_tensor(moe, "experts.0.down_proj.weight", torch.zeros(16, HIDDEN))
    assert "experts.3.2" in expected_moe_pieces(moe)


def test_group_by_expert_is_stable_and_counts() -> None:
    experts = torch.tensor([[2, 0], [0, 1], [2, 3], [0, 2]])
    weights = torch.arange(8, dtype=torch.float32).view(4, 2)
    tokens, w, counts = group_by_expert(experts, weights, 5)
    assert counts == [3, 1, 3, 1, 0]
    assert tokens.tolist() == [0, 1, 3, 1, 0, 2, 3, 2]
    assert w.tolist() == [1.0, 2.0, 6.0, 3.0, 0.0, 4.0, 7.0, 5.0]


def test_empty_step() -> None:
    moe = ours(hf_config("mixtral"), hf_block(hf_config("mixtral"), 0))
    with torch.inference_mode():
        assert moe(torch.zeros(0, HIDDEN)).shape == (0, HIDDEN)


def test_spec_from_configs() -> None:
    qwen3 = moe_spec_from_hf_config(hf_config("qwen3_moe", num_hidden_layers=6, decoder_sparse_step=2,
                                              mlp_only_layers=[3], norm_topk_prob=True))
    assert qwen3 is not None
    assert (qwen3.num_experts, qwen3.top_k, qwen3.intermediate_size) == (8, 2, 48)
    assert qwen3.sparse_layers == (1, 5) and qwen3.norm_topk_prob and not qwen3.shared_expert_size
    qwen2 = moe_spec_from_hf_config(hf_config("qwen2_moe"))
    assert qwen2 is not None and qwen2.shared_expert_size == 80 and qwen2.sparse_layers == (0, 1)
    mixtral = moe_spec_from_hf_config(hf_config("mixtral"))
    assert mixtral is not None and mixtral.norm_topk_prob and not mixtral.weights_in_model_dtype
    gpt_oss = moe_spec_from_hf_config(hf_config("gpt_oss"))
    assert gpt_oss is not None and gpt_oss.router_bias and gpt_oss.expert_bias and gpt_oss.swiglu_limit == 1.5
    from transformers import LlamaConfig

    assert moe_spec_from_hf_config(LlamaConfig()) is None
    with pytest.raises(MoEConfigError, match="num_experts_per_tok 9"):
        moe_spec_from_hf_config(hf_config("mixtral", num_experts_per_tok=9))


def test_tensor_parallel_split_must_divide_the_experts() -> None:
    """Sharded blocks: tests/engine/parallel/test_tp_moe.py; a size that does not divide is refused."""
    with pytest.raises(UnsupportedModelError, match="tensor_parallel_size 3 does not divide the experts'"):
        SparseMoE(MoESpec(num_experts=4, top_k=2, intermediate_size=16, sparse_layers=(0,)), HIDDEN, TPShard(rank=0,
                                                                                                             size=3))
    half = SparseMoE(MoESpec(num_experts=4, top_k=2, intermediate_size=16, sparse_layers=(0,),
                             shared_expert_size=8), HIDDEN, TPShard(rank=1, size=2))
    assert half.experts.gate_up_proj.shape == (4, 16, HIDDEN) and half.shared_expert is not None
    assert half.shared_expert.intermediate_size == 4 and half.full_spec.intermediate_size == 16
