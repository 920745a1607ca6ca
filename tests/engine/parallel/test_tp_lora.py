"""LoRA adapters at tensor parallelism 2 on the CPU (gloo, a spawned rank 1), with the KV heads
split and replicated: greedy tokens equal transformers + PEFT's fp32 generate() for adapters
placed one after another in two slots (each placement replacing another on both ranks) and mixed
with base rows in one step; an adapter added at run time (and one removed, its name then serving
another folder) reaches rank 1; bad adapters are refused with the codes one process gives and the
group goes on; each rank's slots hold its part of an adapter (the planner's figure)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model.lora import LoRARequest
from engine.model.spec import lora_slot_elements
from engine.sched.admission import RequestRejected
from pagedserve.plan.model_shape import lora_slot_bytes, read_model_dir
from tests.engine.lora.adapters import hf_greedy, make_adapter
from tests.fixtures.models import make_tiny_model_dir

NEW = 10
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
PROMPTS = [[(7 * i + 3 * j) % 250 for j in range(9 + 5 * i)] for i in range(4)]
# (rank, alpha, targets, options): every projection; the column-parallel attention ones; the
# row-parallel ones alone; the column-parallel MLP ones with rsLoRA
SHAPES = [(8, 16, None, {}), (4, 8, ["q_proj", "k_proj", "v_proj"], {}), (6, 12, ["o_proj", "down_proj"], {}),
          (16, 32, ["gate_proj", "up_proj"], {"use_rslora": True})]
MIXED = [(0, 0), (1, 1), (None, 2), (None, 3), (1, 0), (0, 2)]  # two adapters and the base model in one step
DYNAMIC = ("dyn1", "dyn2")
Expected = dict[tuple[int | str | None, int], list[int]]


@pytest.fixture(scope="module", params=[2, 1], ids=["kv-split", "kv-replicated"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tp-lora-base"), seed=5, num_key_value_heads=request.param)


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int | str, Path]:
    root = tmp_path_factory.mktemp("tp-lora-adapters")
    made: dict[int | str, Path] = {i: make_adapter(model_dir, root / f"a{i}", seed=20 + i, r=r, alpha=alpha,
                                                   targets=targets, **options)
                                   for i, (r, alpha, targets, options) in enumerate(SHAPES)}
    for k, name in enumerate(DYNAMIC):
        made[name] = make_adapter(model_dir, root / name, seed=60 + k, r=8)
    return made


@pytest.fixture(scope="module")
def expected(model_dir: Path, adapters: dict[int | str, Path]) -> Expected:
    """HF + PEFT's tokens per (adapter or None, prompt index) the tests ask for."""
    wanted = ({(i, i) for i in range(len(SHAPES))} | {(None, p) for p in range(len(PROMPTS))} | set(MIXED)
              | {(name, 1) for name in DYNAMIC})
    return {(a, p): hf_greedy(model_dir, None if a is None else adapters[a], PROMPTS[p], NEW) for a, p in wanted}


@pytest.fixture(scope="module")
def tp2(model_dir: Path, adapters: dict[int | str, Path]) -> Iterator[LLM]:
    modules = {f"a{i}": str(adapters[i]) for i in range(len(SHAPES))}
    with LLM(str(model_dir), dtype="float32", tensor_parallel_size=2, tensor_parallel_threads=1,
             kv_cache_memory=8 << 20, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16,
             lora_modules=modules) as llm:
        yield llm


def _lora(adapter: int | str | None) -> LoRARequest | None:
    return None if adapter is None else LoRARequest(adapter if isinstance(adapter, str) else f"a{adapter}")


def _generate(llm: LLM, keys: list[tuple[int | str | None, int]]) -> list[list[int]]:
    outs = llm.generate([PROMPTS[p] for _, p in keys], PARAMS, lora_request=[_lora(a) for a, _ in keys])
    return [out.outputs[0].token_ids for out in outs]


def test_adapters_change_the_output(expected: Expected) -> None:
    """Guard: each adapter's tokens differ from the base model's on its prompt (and the two run-time
    adapters' from each other)."""
    assert all(expected[(i, i)] != expected[(None, i)] for i in range(len(SHAPES)))
    assert len({tuple(expected[(name, 1)]) for name in DYNAMIC} | {tuple(expected[(None, 1)])}) == 3


def test_each_adapter_alone_matches_peft(tp2: LLM, expected: Expected) -> None:
    """Four adapters through two slots: the third and fourth replace the first two on both ranks."""
    for i in range(len(SHAPES)):
        assert _generate(tp2, [(i, i)]) == [expected[(i, i)]], f"adapter {i}"
    lora = tp2.engine.lora
    assert lora is not None and sorted(n for n in lora.placed if n) == ["a2", "a3"]


def test_adapters_and_base_rows_in_one_step(tp2: LLM, expected: Expected) -> None:
    assert _generate(tp2, MIXED) == [expected[key] for key in MIXED]
    assert tp2.engine.last_step_decodes == len(MIXED)  # every request decoded together
    every = [(i, i) for i in range(len(SHAPES))] + [(None, 0)]  # more adapters than slots: scheduled apart
    assert _generate(tp2, every) == [expected[key] for key in every]


def test_adapter_added_at_run_time_reaches_rank_1(tp2: LLM, adapters: dict[int | str, Path],
                                                  expected: Expected) -> None:
    engine = tp2.engine
    assert engine.add_lora(LoRARequest("dyn", 1, str(adapters["dyn1"])))
    assert _generate(tp2, [("dyn", 1)]) == [expected[("dyn1", 1)]]
    assert engine.remove_lora("dyn") and "dyn" not in engine.lora_names()
    assert engine.add_lora(LoRARequest("dyn", 2, str(adapters["dyn2"])))  # the name now serves another folder
    assert _generate(tp2, [("dyn", 1)]) == [expected[("dyn2", 1)]]
    assert engine.remove_lora("dyn")


def test_bad_adapters_are_refused_as_with_one_rank(tp2: LLM, model_dir: Path, tmp_path: Path,
                                                   expected: Expected) -> None:
    other = make_tiny_model_dir(tmp_path / "other", seed=1, hidden_size=32, intermediate_size=64)
    cases = {
        "lora_invalid": make_adapter(other, tmp_path / "other-base", seed=2, r=4),  # another base's shapes
        "lora_rank_too_large": make_adapter(model_dir, tmp_path / "wide", seed=3, r=32),
        "lora_not_found": tmp_path / "nowhere",
    }
    for code, path in cases.items():
        with pytest.raises(RequestRejected) as info:
            tp2.engine.add_request(f"bad-{code}", PROMPTS[0], PARAMS, lora_request=LoRARequest(code, 1, str(path)))
        assert info.value.code == code
    assert _generate(tp2, [(0, 0), (None, 0)]) == [expected[(0, 0)], expected[(None, 0)]]  # the group goes on


def test_slots_hold_one_ranks_part(tp2: LLM, model_dir: Path) -> None:
    lora = tp2.engine.lora
    assert lora is not None
    allocated = sum(s.a.numel() + sum(b.numel() for b in s.b) for s in lora.linears.values()) * 4
    assert allocated == 2 * lora.slot_bytes == lora_slot_bytes(read_model_dir(model_dir), 2, 16, 2)
    assert lora.slot_bytes == lora_slot_elements(tp2.engine.hf_config, 16, 2) * 4
    assert lora.slot_bytes < lora_slot_elements(tp2.engine.hf_config, 16) * 4
