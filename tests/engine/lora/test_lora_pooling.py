"""A LoRA adapter on the pooling runner: an embedding request run with an adapter gets the
pooled final hidden state of HF + PEFT with that adapter applied, and differs from the base's."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from common.pooling_params import PoolingParams, embedding_floats
from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model.lora import LoRARequest
from tests.engine.lora.adapters import make_adapter
from tests.fixtures.models import make_tiny_model_dir

PROMPT = [5, 9, 200, 31, 77, 12, 140]


def hf_last_hidden(model_dir: Path, adapter: Path, prompt: list[int]) -> torch.Tensor:
    """HF + PEFT's final (normed) hidden state of the prompt's last token, L2-normalized."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter)).eval()
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1]
    return F.normalize(hidden[0, -1], dim=-1)


def test_adapter_applies_to_pooled_vectors(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "model", seed=5)
    adapter = make_adapter(model_dir, tmp_path / "adapter", seed=1)
    vectors: dict[str, torch.Tensor] = {}
    with LLM(str(model_dir), dtype="float32", kv_cache_memory=8 << 20, swap_space=1 << 20, runner="pooling",
             enable_lora=True, lora_modules={"sql": str(adapter)}) as llm:
        for request_id, lora in (("base", None), ("sql", LoRARequest("sql"))):
            llm.engine.add_request(request_id, PROMPT, SamplingParams(max_tokens=1), lora_request=lora,
                                   pooling=PoolingParams())
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                assert out.error is None
                if out.finished and out.embedding is not None:
                    vectors[out.request_id] = torch.tensor(embedding_floats(out.embedding))
    assert set(vectors) == {"base", "sql"}
    torch.testing.assert_close(vectors["sql"], hf_last_hidden(model_dir, adapter, PROMPT), atol=1e-5, rtol=0)
    assert (vectors["sql"] - vectors["base"]).abs().max().item() > 1e-2
