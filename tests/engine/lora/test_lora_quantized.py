"""LoRA over a quantized GGUF base (Q4_0, Q4_1: the common CPU case). The adapter's product is
added to the packed linear's output; a step's prompt rows run the packed weights on fp32
activations, so the prompt logprobs are those of transformers + PEFT on the file's dequantized
weights up to fp32 summation order (the same 2e-3 bound the engine's own prompt-logprob test
uses against transformers). Decode rows (int8 activations) are checked by the base rows: a base
request beside adapter requests gets exactly the tokens it gets alone. Steps with adapter rows take
the fused C++ decoder too (tests/engine/model/test_fused_decoder.py holds it to the modules' bits)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model.lora import LoRARequest
from tests.engine.lora.adapters import make_adapter
from tests.engine.model.gguf_writing import write_llama_gguf
from tests.fixtures.models import make_tiny_model_dir

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, *range(200, 230)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("lora-q4"), seed=6)


@pytest.fixture(scope="module")
def adapter(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_adapter(model_dir, tmp_path_factory.mktemp("lora-q4-adapter") / "a", seed=5, r=8)


def _gguf(model_dir: Path, path: Path, fmt: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return write_llama_gguf(hf, path, fmt)


def _hf_prompt_logprobs(model_dir: Path, state: dict[str, torch.Tensor], adapter: Path) -> tuple[list[float], int]:
    """transformers + PEFT on the dequantized weights: each prompt token's logprob, and the argmax
    after the prompt."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    loaded = hf.load_state_dict(state, strict=False)
    assert not loaded.missing_keys and not loaded.unexpected_keys
    hf = PeftModel.from_pretrained(hf, str(adapter)).eval()
    with torch.inference_mode():
        logp = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    chosen = logp[:-1].gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1)).squeeze(1).tolist()
    return chosen, int(logp[-1].argmax())


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1"])
def test_adapter_on_quantized_base(model_dir: Path, adapter: Path, tmp_path: Path, fmt: str) -> None:
    file = tmp_path / f"model-{fmt}.gguf"
    state = _gguf(model_dir, file, fmt)
    want, first = _hf_prompt_logprobs(model_dir, state, adapter)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    lora = LoRARequest("a", 1, str(adapter))
    with LLM(str(file), tokenizer=str(model_dir), dtype="float32", enable_lora=True, max_lora_rank=8,
             kv_cache_memory=8 << 20, block_size=8) as llm:
        assert llm.engine.model.fused_decoder() is not None  # the base steps take the C++ decoder
        out = llm.generate([PROMPT], params, lora_request=lora)[0]
        entries = out.prompt_logprobs
        assert entries is not None and [e["token_id"] for e in entries[1:] if e] == PROMPT[1:]
        got = [e["logprob"] for e in entries[1:] if e]
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) < 2e-3
        assert out.outputs[0].token_ids[0] == first
        base_alone = llm.generate([PROMPT], params)[0]
        assert base_alone.outputs[0].token_ids != out.outputs[0].token_ids  # the adapter changes the answer
        llm.reset_prefix_cache()
        mixed = llm.generate([PROMPT, PROMPT[:20], PROMPT], params, lora_request=[None, lora, lora])
        assert mixed[0].outputs[0].token_ids == base_alone.outputs[0].token_ids
        assert mixed[2].outputs[0].token_ids == out.outputs[0].token_ids
