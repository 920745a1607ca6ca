"""LoRA over a bf16 model: the adapter slots hold bf16 weights and the products are added in the
model's dtype. The oracle is transformers + PEFT: in fp32 our fp32 prompt logprobs match it to
2e-3; in bf16 both drift from it by rounding alone, so ours must stay within twice the drift of
PEFT's own bf16 forward (mean absolute logprob error, plus 0.01). A base request beside adapter
requests is untouched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model.lora import LoRARequest
from tests.engine.lora.adapters import make_adapter
from tests.fixtures.models import make_tiny_model_dir

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, *range(200, 224)]
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("lora-bf16"), seed=8)


def _ours(out: Any) -> torch.Tensor:
    return torch.tensor([e["logprob"] for e in out.prompt_logprobs[1:] if e])


def _peft(model_dir: Path, adapter: Path, dtype: torch.dtype) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    hf = PeftModel.from_pretrained(hf, str(adapter)).eval()
    with torch.inference_mode():
        logp = torch.log_softmax(hf(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    return logp[:-1].gather(1, torch.tensor(PROMPT[1:]).unsqueeze(1)).squeeze(1)


def test_bf16_adapter_drifts_no_more_than_peft(model_dir: Path, tmp_path: Path) -> None:
    adapter = make_adapter(model_dir, tmp_path / "a", seed=9, r=8)
    lora = LoRARequest("a", 1, str(adapter))
    ours = {}
    for dtype in ("float32", "bfloat16"):
        with LLM(str(model_dir), dtype=dtype, enable_lora=True, max_lora_rank=8, kv_cache_memory=8 << 20) as llm:
            ours[dtype] = _ours(llm.generate([PROMPT], PARAMS, lora_request=lora)[0])
            base = llm.generate([PROMPT], PARAMS)[0]
            llm.reset_prefix_cache()
            mixed = llm.generate([PROMPT, PROMPT], PARAMS, lora_request=[None, lora])
            assert mixed[0].outputs[0].token_ids == base.outputs[0].token_ids
    exact, rounded = _peft(model_dir, adapter, torch.float32), _peft(model_dir, adapter, torch.bfloat16)
    assert (ours["float32"] - exact).abs().max() < 2e-3
    peft_drift = (rounded - exact).abs().mean()
    assert (ours["bfloat16"] - exact).abs().mean() <= 2 * peft_drift + 0.01
