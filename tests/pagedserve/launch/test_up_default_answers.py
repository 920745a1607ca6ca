"""`pagedserve up`'s default configuration (the Q4_1 GGUF with int8 activations, an int8 KV cache)
answers simple factual questions as the fp32 model does: greedy, chat-templated, the fact
each fp32 answer states must be in the default's answer too.

This was the gate for the int8 KV cache default: Q4_1 weights with int8 activations everywhere
and an int8 cache answered "What is the capital of France?" with "L'Étoile, …", where fp32 (and each
alone) says Paris: the answer's first token is a near-tie in fp32 ("The" -1.88 against "L" -1.97),
and int8 rounding of the prompt's activations, on top of any 8-bit KV rounding, tipped it. Prompt
rows now keep fp32 activations (`engine.model.execution_policy.LinearRows.exact_rows`), so the first token is the
dequantized model's and both configurations (int8 and fp32 KV) state every fact. Each question is asked alone, as one
client asks it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.worker.cli import resolve_model
from pagedserve.launch.up import add_arguments, up_kv_cache_dtype

# question -> the fact fp32 SmolLM2 states in its greedy answer
FACTS = {
    "What is the capital of France?": "Paris",
    "What is the capital of Japan?": "Tokyo",
    "What is the capital of Germany?": "Berlin",
    "What is the chemical symbol for gold?": "Au",
    "How many days are in a week?": "7",
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def up_defaults() -> argparse.Namespace:
    """`pagedserve up`'s options when given none."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args([])


def answers(model: str, tokenizer: str | None, **config: object) -> dict[str, str]:
    """Each question alone, as one client asks it."""
    llm = LLM(model, tokenizer=tokenizer, kv_cache_memory=32 << 20, **config)
    return {q: llm.chat([[{"role": "user", "content": q}]], GREEDY)[0].outputs[0].text for q in FACTS}


@pytest.mark.slow  # the facts table's own check; the default suite keeps only up's configuration
def test_fp32_model_states_each_fact(smollm2_dir: Path) -> None:
    got = answers(str(smollm2_dir), None, dtype="float32")
    assert all(fact in got[q] for q, fact in FACTS.items()), got


@pytest.mark.parametrize("kv_cache_dtype", [
    pytest.param(None, id="up-default"),
    pytest.param("float32", id="fp32-kv", marks=pytest.mark.slow),
])
def test_up_default_configuration_states_each_fact(smollm2_dir: Path, kv_cache_dtype: str | None) -> None:
    args = up_defaults()
    model, tokenizer = resolve_model(args.model, args.tokenizer, args.quantization)
    assert model.endswith(".gguf"), "up serves the GGUF by default"
    kv = kv_cache_dtype or up_kv_cache_dtype(args.kv_cache_dtype, model, args.quantization)
    assert kv_cache_dtype or kv == "int8", "up serves the GGUF with an int8 KV cache by default"
    got = answers(model, tokenizer, kv_cache_dtype=kv, dtype="auto", quantization=args.quantization)
    assert all(fact in got[q] for q, fact in FACTS.items()), got
