"""What the LoRA end-to-end tests share: the in-process engine's greedy texts per adapter (the
oracle the served answers must equal), an OpenAI client and a raw POST to the adapter routes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
from openai import AsyncOpenAI

MODEL = "tiny"
PROMPTS = ["Once upon a time", "The paged cache", "LoRA adapters"]
MAX_TOKENS = 8


def expected_texts(model_dir: Path, adapters: dict[str, Path], names: tuple[str, ...]) -> dict[tuple[str, str], str]:
    """The in-process engine's greedy text per (`MODEL` or adapter name, prompt), decoded as the gateway does."""
    from common.sampling_params import SamplingParams
    from engine.llm import LLM
    from engine.model.lora import LoRARequest
    from gateway.text.tokenizer import ModelTokenizer

    tok = ModelTokenizer(str(model_dir))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(model_dir), dtype="float32", kv_cache_memory=8 << 20, enable_lora=True, max_loras=4,
             max_lora_rank=8) as llm:
        keys = [(name, prompt) for name in names for prompt in PROMPTS]
        loras = [None if name == MODEL else LoRARequest(name, 1, str(adapters[name])) for name, _ in keys]
        outs = llm.generate([prompt for _, prompt in keys], params, lora_request=loras)
    return {key: tok.decode(out.outputs[0].token_ids) for key, out in zip(keys, outs, strict=True)}


def openai_client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


async def post(session: aiohttp.ClientSession, url: str, route: str, body: dict[str, Any]) -> tuple[int, Any]:
    """`(status, text)` of a 200, `(status, error object)` otherwise."""
    async with session.post(f"{url}/v1/{route}", json=body) as resp:
        return resp.status, (await resp.text() if resp.status == 200 else (await resp.json())["error"])
