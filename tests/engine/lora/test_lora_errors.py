"""Adapters that cannot be served exactly are refused with a typed error and a code (the server's
400), never approximated: missing or malformed folders, ranks above max_lora_rank, DoRA, biases,
modules_to_save, embedding / lm_head targets, layers or shapes the model lacks; and a request's
adapter on an engine without LoRA (tensor parallelism gives the same refusals:
tests/engine/parallel/test_tp_lora.py)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.llm import LLM
from engine.model.lora import LoRAError, LoRARequest
from engine.model.lora.loader import load_adapter
from engine.sched.admission import RequestRejected
from tests.engine.lora.adapters import make_adapter
from tests.fixtures.models import make_tiny_model_dir

PARAMS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("lora-err-base"), seed=4)


@pytest.fixture(scope="module")
def good(base: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(base, tmp_path_factory.mktemp("good") / "a", seed=1, r=4)


@pytest.fixture(scope="module")
def llm(base: Path) -> Iterator[LLM]:
    with LLM(str(base), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
             kv_cache_memory=8 << 20) as engine:
        yield engine


def _edited(good: Path, tmp_path: Path, **changes: Any) -> Path:
    """A copy of `good` with its adapter_config.json's keys changed."""
    folder = tmp_path / "edited"
    shutil.copytree(good, folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return folder


def _refused(path: Path | str, max_rank: int = 8) -> LoRAError:
    with pytest.raises(LoRAError) as info:
        load_adapter("x", str(path), max_rank)
    return info.value


def test_the_good_adapter_loads(good: Path) -> None:
    adapter = load_adapter("a", str(good), 8)
    assert adapter.rank == 4 and adapter.scale == 16 / 4 and len(adapter.weights) == 2 * 7


def test_missing_and_malformed_folders(good: Path, tmp_path: Path) -> None:
    assert _refused(tmp_path / "nowhere").code == "lora_not_found"
    (tmp_path / "empty").mkdir()
    assert _refused(tmp_path / "empty").code == "lora_not_found"
    broken = tmp_path / "broken"
    shutil.copytree(good, broken)
    (broken / "adapter_config.json").write_text("{not json")
    assert _refused(broken).code == "lora_invalid"
    no_weights = tmp_path / "no-weights"
    shutil.copytree(good, no_weights)
    (no_weights / "adapter_model.safetensors").unlink()
    assert _refused(no_weights).code == "lora_not_found"
    (no_weights / "adapter_model.safetensors").write_bytes(b"garbage")
    assert _refused(no_weights).code == "lora_invalid"


def test_rank_above_max_lora_rank(good: Path) -> None:
    error = _refused(good, max_rank=2)
    assert error.code == "lora_rank_too_large" and "--max-lora-rank 2" in str(error)


@pytest.mark.parametrize("changes", [
    {"bias": "lora_only"}, {"use_dora": True}, {"modules_to_save": ["lm_head"]}, {"target_modules": ["lm_head"]},
    {"target_modules": ["embed_tokens", "q_proj"]}, {"rank_pattern": {"q_proj": 2}}, {"peft_type": "IA3"},
], ids=["bias", "dora", "modules_to_save", "lm_head", "embedding", "rank_pattern", "not-lora"])
def test_unsupported_options(good: Path, tmp_path: Path, changes: dict[str, Any]) -> None:
    error = _refused(_edited(good, tmp_path, **changes))
    assert error.code == "lora_unsupported", error


def test_peft_dora_and_embedding_adapters_are_refused(base: Path, tmp_path: Path) -> None:
    """Adapters PEFT itself writes with DoRA, or over the embedding, never load."""
    dora = make_adapter(base, tmp_path / "dora", seed=2, r=4, use_dora=True)
    assert _refused(dora).code == "lora_unsupported"
    embed = make_adapter(base, tmp_path / "embed", seed=2, r=4, targets=["embed_tokens", "q_proj"])
    assert _refused(embed).code == "lora_unsupported"


def test_adapter_of_another_model_is_refused_by_the_engine(llm: LLM, tmp_path: Path) -> None:
    wider = make_tiny_model_dir(tmp_path / "wider", seed=1, hidden_size=96)
    deeper = make_tiny_model_dir(tmp_path / "deeper", seed=1, num_hidden_layers=3)
    for name, model in (("wider", wider), ("deeper", deeper)):
        adapter = make_adapter(model, tmp_path / f"{name}-lora", seed=3, r=4)
        with pytest.raises(RequestRejected) as info:
            llm.engine.add_request(name, [1, 2, 3], PARAMS, lora_request=LoRARequest(name, 1, str(adapter)))
        assert info.value.code == "lora_invalid", info.value
        assert not llm.engine.has_request(name)


def test_unknown_name_and_name_clash(llm: LLM, good: Path, tmp_path: Path) -> None:
    with pytest.raises(RequestRejected) as info:
        llm.engine.add_request("unknown", [1, 2, 3], PARAMS, lora_request=LoRARequest("never-loaded"))
    assert info.value.code == "lora_not_found"
    llm.generate([[1, 2, 3]], PARAMS, lora_request=LoRARequest("good", 1, str(good)))
    other = shutil.copytree(good, tmp_path / "other")
    with pytest.raises(ValueError, match="already loaded"):
        llm.generate([[1, 2, 3]], PARAMS, lora_request=LoRARequest("good", 2, str(other)))


def test_engine_without_lora_refuses_adapter_requests(base: Path, good: Path) -> None:
    with LLM(str(base), dtype="float32", kv_cache_memory=8 << 20) as plain:
        with pytest.raises(RequestRejected) as info:
            plain.engine.add_request("r", [1, 2, 3], PARAMS, lora_request=LoRARequest("a", 1, str(good)))
        assert info.value.code == "lora_disabled"


def test_config_refusals(base: Path, good: Path) -> None:
    assert EngineConfig(str(base), enable_lora=True, tensor_parallel_size=2).enable_lora  # adapters are split
    with pytest.raises(ValueError, match="enable_lora"):
        EngineConfig(str(base), lora_modules={"a": str(good)})
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineConfig(str(base), enable_lora=True, max_loras=4, max_cpu_loras=2)
