"""Greedy tokens with PEFT LoRA adapters equal transformers + PEFT's fp32 generate(), token for
token: each adapter alone, and eight adapters mixed in one step with base-model requests."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model.lora import LoRARequest
from tests.engine.lora.adapters import hf_greedy, make_adapter
from tests.fixtures.models import make_tiny_model_dir

NEW = 12
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 250 for j in range(9 + 5 * i)] for i in range(8)]
# (rank, alpha, targets, options) per adapter: ranks 1 to 16, subsets of the projections, rsLoRA
SHAPES = [
    (8, 16, None, {}), (4, 8, ["q_proj", "v_proj"], {}), (16, 8, ["gate_proj", "up_proj", "down_proj"], {}),
    (2, 4, ["o_proj", "k_proj"], {}), (8, 32, None, {"use_rslora": True}), (1, 2, ["down_proj"], {}),
    (6, 6, ["q_proj", "k_proj", "v_proj", "o_proj"], {}), (12, 24, ["up_proj", "v_proj"], {}),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("lora-base"), seed=4)


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("lora-adapters")
    return [make_adapter(model_dir, root / f"a{i}", seed=10 + i, r=r, alpha=alpha, targets=targets, **options)
            for i, (r, alpha, targets, options) in enumerate(SHAPES)]


@pytest.fixture(scope="module")
def expected(model_dir: Path, adapters: list[Path]) -> dict[tuple[int | None, int], list[int]]:
    """HF + PEFT's tokens per (adapter index or None, prompt index) the tests ask for."""
    wanted = [(i, i) for i in range(len(adapters))] + [(None, i) for i in range(len(PROMPTS))] + [(0, 3), (5, 0)]
    return {(a, p): hf_greedy(model_dir, None if a is None else adapters[a], PROMPTS[p], NEW) for a, p in wanted}


def test_adapters_change_the_output(expected: dict[tuple[int | None, int], list[int]]) -> None:
    """Guard: each random adapter's tokens differ from the base model's on its prompt."""
    assert all(expected[(i, i)] != expected[(None, i)] for i in range(len(SHAPES)))


def test_each_adapter_alone_matches_peft(model_dir: Path, adapters: list[Path],
                                         expected: dict[tuple[int | None, int], list[int]]) -> None:
    with LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2,
             max_lora_rank=16) as llm:
        for i, path in enumerate(adapters):
            out = llm.generate([PROMPTS[i]], PARAMS, lora_request=LoRARequest(f"a{i}", i + 1, str(path)))
            assert out[0].outputs[0].token_ids == expected[(i, i)], f"adapter {i}"


def test_eight_adapters_and_base_in_one_step(model_dir: Path, adapters: list[Path],
                                             expected: dict[tuple[int | None, int], list[int]]) -> None:
    """Eight adapters and base requests share every step (max_loras 8: all fit at once); the same
    adapter on two prompts, and the base model, give their own answers."""
    lora_modules = {f"a{i}": str(p) for i, p in enumerate(adapters)}
    with LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=8, max_lora_rank=16,
             lora_modules=lora_modules) as llm:
        prompts: list[list[int]] = []
        loras: list[LoRARequest | None] = []
        keys: list[tuple[int | None, int]] = []
        for i in range(len(adapters)):
            prompts.append(PROMPTS[i])
            loras.append(LoRARequest(f"a{i}"))
            keys.append((i, i))
        for a, p in [(None, 1), (0, 3), (None, 6), (5, 0), (None, 0)]:
            prompts.append(PROMPTS[p])
            loras.append(None if a is None else LoRARequest(f"a{a}"))
            keys.append((a, p))
        outs = llm.generate(prompts, PARAMS, lora_request=loras)
        assert llm.engine.last_step_decodes == len(prompts)  # every request decoded together
        for key, out in zip(keys, outs, strict=True):
            assert out.outputs[0].token_ids == expected[key], key


def test_more_adapters_than_slots_are_scheduled_apart(model_dir: Path, adapters: list[Path],
                                                      expected: dict[tuple[int | None, int], list[int]]) -> None:
    """max_loras 2 with eight adapters queued: steps never hold more than two adapters, slots are
    reused, and every answer is still PEFT's."""
    with LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=3,
             max_lora_rank=16) as llm:
        engine = llm.engine
        seen: list[int] = []
        step = engine.runner.prepare

        def counting(scheduled, sched=None):
            seen.append(len({s.lora_name for s in scheduled if s.lora_name}))
            return step(scheduled, sched)

        engine.runner.prepare = counting  # type: ignore[method-assign]
        loras: list[LoRARequest | None] = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
        outs = llm.generate(PROMPTS[: len(adapters)], PARAMS, lora_request=loras)
        assert max(seen) == 2
        for i, out in enumerate(outs):
            assert out.outputs[0].token_ids == expected[(i, i)], i
