"""Adapters added and removed while the engine runs (`LLMEngine.add_lora` / `remove_lora`, vLLM's
names): an added adapter serves requests by name, one in use is not removed, a removed one is
refused and its name free for another folder, whose requests reuse none of the first one's K/V."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model.lora import LoRARequest
from engine.sched.admission import RequestRejected
from tests.engine.lora.adapters import make_adapter

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = list(range(60, 90))


def test_add_use_remove(tiny_llama_dir: Path, tmp_path: Path) -> None:
    first = make_adapter(tiny_llama_dir, tmp_path / "first", seed=41, r=4)
    second = make_adapter(tiny_llama_dir, tmp_path / "second", seed=42, r=4)
    with LLM(str(tiny_llama_dir), dtype="float32", enable_lora=True, max_lora_rank=8,
             kv_cache_memory=4 << 20) as llm:
        engine = llm.engine
        with pytest.raises(RequestRejected, match="lora_path is required"):
            engine.add_lora(LoRARequest("x"))
        assert engine.add_lora(LoRARequest("a", 1, str(first))) and engine.lora_names() == ["a"]
        by_name = llm.generate([PROMPT], PARAMS, lora_request=LoRARequest("a"))[0].outputs[0].token_ids
        by_path = llm.generate([PROMPT], PARAMS, lora_request=LoRARequest("a", 1, str(first)))[0].outputs[0].token_ids
        assert by_name == by_path

        engine.add_request("busy", PROMPT, PARAMS, lora_request=LoRARequest("a"))
        with pytest.raises(RequestRejected) as info:
            engine.remove_lora("a")
        assert info.value.code == "lora_in_use"
        assert engine.abort_request("busy")
        assert engine.remove_lora("a") and not engine.remove_lora("a") and engine.lora_names() == []
        with pytest.raises(RequestRejected) as info:
            engine.add_request("gone", PROMPT, PARAMS, lora_request=LoRARequest("a"))
        assert info.value.code == "lora_not_found"

        engine.add_lora(LoRARequest("a", 2, str(second)))  # the name now serves another folder
        other = llm.generate([PROMPT], PARAMS, lora_request=LoRARequest("a"))[0]
        assert other.num_cached_tokens == 0  # nothing of the first folder's K/V is reused
        assert other.outputs[0].token_ids != by_name
