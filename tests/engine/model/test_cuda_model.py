"""The paged model on CUDA: logits equal HF's in fp32 (bf16: no worse than HF's own bf16 against
fp32), and greedy decoding through the engine equals HF generate() token for token in fp32."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model import load_model
from tests.fixtures.models import PagedHarness, Seq, make_tiny_model_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# head_dim 64 (a CUDA kernel size), GQA 4, weights large enough that greedy has clear winners.
SHAPE = {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
         "num_hidden_layers": 3}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("cuda-llama"), seed=11, **SHAPE)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf(model_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to("cuda").eval()


def _paged_logits(model_dir: Path, dtype: torch.dtype, tokens: list[int]) -> torch.Tensor:
    """Chunked prefill then decode steps, every block size the CUDA kernels take."""
    out = []
    for block_size in (8, 16, 32):
        harness, seq = PagedHarness(load_model(model_dir, dtype, "cuda"), block_size=block_size), Seq(tokens)
        steps = [harness.step([(seq, 20)], []), harness.step([(seq, 12)], [])]
        steps += [harness.step([], [seq]) for _ in range(len(tokens) - 32)]
        out.append(torch.cat(steps).float())
    return torch.stack(out)


def test_logits_match_hf_fp32(model_dir: Path) -> None:
    tokens = _tokens(48, 0)
    with torch.inference_mode():
        expected = _hf(model_dir, torch.float32)(torch.tensor([tokens], device="cuda")).logits[0].float()
    for logits in _paged_logits(model_dir, torch.float32, tokens):
        torch.testing.assert_close(logits, expected, rtol=1e-3, atol=1e-3)


def test_bf16_logits_no_worse_than_hf_bf16(model_dir: Path) -> None:
    tokens = _tokens(48, 1)
    ids = torch.tensor([tokens], device="cuda")
    with torch.inference_mode():
        truth = _hf(model_dir, torch.float32)(ids).logits[0].float()
        hf_error = (_hf(model_dir, torch.bfloat16)(ids).logits[0].float() - truth).abs().mean()
    for logits in _paged_logits(model_dir, torch.bfloat16, tokens):
        assert (logits - truth).abs().mean() <= 1.5 * hf_error


@pytest.mark.parametrize("config", [{}, {"max_num_batched_tokens": 32}, {"enable_prefix_caching": False}],
                         ids=["plain", "chunked-prefill", "no-prefix-cache"])
def test_engine_greedy_equals_hf_fp32(model_dir: Path, config: dict) -> None:
    prompts = [_tokens(n, 10 + n) for n in (5, 40, 77, 130)]
    prompts.append(prompts[2][:50] + _tokens(9, 3))  # shares a 48-token prefix with a prompt above
    llm = LLM(str(model_dir), device="cuda", dtype="float32", num_gpu_blocks=512, **config)  # not 90% of the card
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32,
                                                                                  min_tokens=32))]
    hf = _hf(model_dir, torch.float32)
    with torch.inference_mode():
        for prompt, got in zip(prompts, ours, strict=True):
            ids = torch.tensor([prompt], device="cuda")  # explicit mask: token 0 is also the pad id
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=32,
                              min_new_tokens=32, pad_token_id=0)
            assert got == gen[0, len(prompt):].tolist()
