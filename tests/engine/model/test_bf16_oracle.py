"""The bf16 oracle on the CPU: the paged model in bf16 against Hugging Face in bf16, with HF fp32 as
the truth. Runs on every CPU (where bf16 is emulated, as on AVX2-only machines, it is only slower).

Tolerance, and why: two bf16 implementations round in different places (fused kernels, fp32
accumulation in attention, a bf16 cache), so they cannot agree bit for bit; each sits within bf16's
own error E of the fp32 logits, so they differ by at most about 2E (triangle inequality). E is
measured, not assumed: HF bf16 against HF fp32 on the same tokens.
- teacher-forced logits: the paged model's error against fp32 is at most 1.5x HF bf16's (mean |diff|);
- greedy through the engine: tokens equal HF bf16's up to a first divergence, every logprob before it
  within 2E of HF bf16's, and the divergence (if any) only at a near-tie: the two tokens' fp32 logits
  within 2E of each other.
The model is the CUDA oracle's tiny Llama (head 64, GQA 4, weights large enough that greedy has clear
winners), so the whole module takes seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model import load_model
from tests.fixtures.models import PagedHarness, Seq, make_tiny_model_dir

SHAPE = {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 2,
         "num_hidden_layers": 3}
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("bf16-llama"), seed=11, **SHAPE)


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> dict[torch.dtype, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    return {dt: AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dt).eval()
            for dt in (torch.float32, torch.bfloat16)}


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf_logits(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].float()


def test_paged_bf16_logits_no_worse_than_hf_bf16(model_dir: Path, hf: dict[torch.dtype, torch.nn.Module]) -> None:
    tokens = _tokens(40, 1)
    truth = _hf_logits(hf[torch.float32], tokens)
    hf_error = (_hf_logits(hf[torch.bfloat16], tokens) - truth).abs().mean()
    harness, seq = PagedHarness(load_model(model_dir, "bf16")), Seq(tokens)
    assert harness.kv_caches[0][0].dtype is torch.bfloat16
    steps = [harness.step([(seq, 24)], [])] + [harness.step([], [seq]) for _ in range(len(tokens) - 24)]
    ours = torch.cat(steps).float()
    assert (ours - truth).abs().mean() <= 1.5 * hf_error, (float((ours - truth).abs().mean()), float(hf_error))


def test_engine_bf16_greedy_against_hf_bf16(model_dir: Path, hf: dict[torch.dtype, torch.nn.Module]) -> None:
    prompts = [_tokens(n, 20 + n) for n in (6, 30, 57)]
    llm = LLM(str(model_dir), dtype="bfloat16", kv_cache_memory=16 << 20, max_num_batched_tokens=32)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    identical = 0
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            theirs = hf[torch.bfloat16].generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                 max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                                 pad_token_id=0)[0, len(prompt):].tolist()
        full = prompt + theirs
        truth = _hf_logits(hf[torch.float32], full)[len(prompt) - 1:-1]
        hf16 = _hf_logits(hf[torch.bfloat16], full)[len(prompt) - 1:-1]
        bound = 2 * (hf16 - truth).abs().max()  # 2E: two bf16 roundings of the same fp32 logits
        diverge = next((i for i, (a, b) in enumerate(zip(out.token_ids, theirs, strict=True)) if a != b), None)
        upto = NEW_TOKENS if diverge is None else diverge
        assert out.logprobs is not None
        ours_lp = torch.tensor([step["logprob"] for step in out.logprobs[:upto]])
        hf_lp = torch.log_softmax(hf16[:upto], -1).gather(1, torch.tensor(theirs[:upto])[:, None])[:, 0]
        assert (ours_lp - hf_lp).abs().max() <= bound, ((ours_lp - hf_lp).abs().max(), bound)
        if diverge is None:
            identical += 1
        else:
            gap = truth[diverge, theirs[diverge]] - truth[diverge, out.token_ids[diverge]]
            assert gap.abs() <= bound, f"diverged at {diverge} with an fp32 margin of {float(gap):.3f} > {bound:.3f}"
    assert identical >= 1, "no prompt was generated identically: the tiny model is meant to have clear winners"
