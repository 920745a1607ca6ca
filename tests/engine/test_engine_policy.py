"""Each engine computes under its own arithmetic (`ops.policy.OpsPolicy`), built once from its
config and bound to its model and sampler: engines of different policies in one process, stepped
in turn, each give the answers it gives alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import ops
from common.sampling_params import SamplingParams
from engine.llm import LLM, _merge
from engine.model.execution_policy import ExecutionPolicy, LinearRows
from engine.outputs import RequestOutput
from tests.engine.helpers import assert_no_leaks
from tests.fixtures.models import make_tiny_model_dir

PROMPTS = [list(range(3, 40)), list(range(50, 61)), [7, 1, 9, 4] * 9]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1),
          SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True, logprobs=2)]
# reference ops; the kernels in fixed order (deterministic); the kernels' fastest arithmetic
CONFIGS: dict[str, dict[str, Any]] = {
    "reference": {"attention_backend": "reference", "deterministic": False},
    "fixed": {"attention_backend": "auto", "deterministic": True},
    "fastest": {"attention_backend": "auto", "deterministic": False},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("policy"), hidden_size=96, intermediate_size=200,
                               num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2, seed=4)


def _llm(model_dir: Path, name: str) -> LLM:
    return LLM(str(model_dir), dtype="float32", kv_cache_memory=16 << 20, **CONFIGS[name])


def _answers(outs: list[RequestOutput]) -> list[tuple[Any, ...]]:
    return [(c.token_ids, c.logprobs, c.cumulative_logprob, out.prompt_logprobs)
            for out in outs for c in out.outputs]


def _alone(model_dir: Path, name: str) -> list[tuple[Any, ...]]:
    llm = _llm(model_dir, name)
    try:
        return _answers(llm.generate([*PROMPTS, *PROMPTS], [PARAMS[0]] * 3 + [PARAMS[1]] * 3))
    finally:
        llm.close()


def _in_turn(llms: dict[str, LLM]) -> dict[str, list[tuple[Any, ...]]]:
    """Every engine's answers to the same requests, the engines stepped one after the other until
    each is done (no engine re-sets anything between another's steps)."""
    results: dict[str, dict[str, RequestOutput]] = {}
    for name, llm in llms.items():
        results[name] = {}
        for i, (prompt, params) in enumerate(zip([*PROMPTS, *PROMPTS], [PARAMS[0]] * 3 + [PARAMS[1]] * 3,
                                                 strict=True)):
            request_id = f"{name}-{i}"
            llm.engine.add_request(request_id, prompt, params)
            results[name][request_id] = RequestOutput(request_id=request_id, prompt_token_ids=prompt)
    while any(llm.engine.has_unfinished_requests() for llm in llms.values()):
        for name, llm in llms.items():
            if llm.engine.has_unfinished_requests():
                for delta in llm.engine.step():
                    _merge(results[name][delta.request_id], delta)
    return {name: _answers(list(outs.values())) for name, outs in results.items()}


def test_engines_keep_their_own_arithmetic_in_one_process(model_dir: Path) -> None:
    alone = {name: _alone(model_dir, name) for name in CONFIGS}
    assert alone["reference"] != alone["fixed"]  # the arithmetic differs (else the test could not fail)
    assert alone["fixed"] != alone["fastest"]
    llms = {name: _llm(model_dir, name) for name in CONFIGS}  # built before any runs: the last built sets nothing
    try:
        assert {name: llm.engine.model.policy.ops for name, llm in llms.items()} == {
            "reference": ops.REFERENCE, "fixed": ops.FIXED_ORDER, "fastest": ops.FASTEST}
        together = _in_turn(llms)
        for llm in llms.values():
            assert_no_leaks(llm)
    finally:
        for llm in llms.values():
            llm.close()
    for name in CONFIGS:
        assert together[name] == alone[name], name


def test_a_models_ops_follow_its_policy_not_the_last_built(model_dir: Path) -> None:
    """Two models of one checkpoint: the reference one's lm_head gives the reference bits and the
    kernels one the kernels', though the reference one was built last."""
    import torch

    from engine.model import load_model

    kernels = load_model(model_dir)
    reference = load_model(model_dir, policy=ExecutionPolicy(ops=ops.REFERENCE))
    hidden = torch.randn(2, 96, generator=torch.Generator().manual_seed(0))  # rows on the C++ GEMV
    weight = kernels.lm_head.weight
    assert torch.equal(reference.compute_logits(hidden), ops.reference.linear(hidden, weight))
    assert torch.equal(kernels.compute_logits(hidden), ops.linear(hidden, weight))
    assert torch.equal(reference.lm_head(hidden, LinearRows(ops=ops.REFERENCE)), reference.compute_logits(hidden))
