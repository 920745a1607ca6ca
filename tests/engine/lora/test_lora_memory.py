"""The adapter slots' memory: what the engine allocates equals the formula `pagedserve plan` uses
(`engine.model.spec.lora_slot_elements`), and the slots start empty (a base request is untouched)."""

from __future__ import annotations

from pathlib import Path

from engine.llm import LLM
from engine.model.spec import lora_slot_elements
from pagedserve.plan.model_shape import lora_slot_bytes, read_model_dir


def test_slots_match_the_planner(tiny_llama_dir: Path) -> None:
    with LLM(str(tiny_llama_dir), dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8,
             kv_cache_memory=4 << 20) as llm:
        manager = llm.engine.lora
        assert manager is not None
        allocated = sum(s.a.numel() + sum(b.numel() for b in s.b) for s in manager.linears.values()) * 4
        assert allocated == 3 * manager.slot_bytes
        assert manager.slot_bytes == lora_slot_elements(llm.engine.hf_config, 8) * 4
        assert lora_slot_bytes(read_model_dir(tiny_llama_dir), 3, 8) == allocated
