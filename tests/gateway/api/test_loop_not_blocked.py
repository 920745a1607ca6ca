"""Tokenizing huge prompts does not block the gateway's event loop: while a few ~1 MB prompts
are tokenized (completion and chat), a loop-lag probe and `/health` on the same gateway keep
running. The bound is relative to what one prompt's tokenization costs on this machine,
measured in the test, so a slow or loaded machine does not change the verdict."""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

from gateway.text.tokenizer import ModelTokenizer
from tests.fixtures.gateway import MODEL, open_live_gateway

_WORDS = ["Hello", "world!", "quick", "brown", "fox", "zebra", "Paged", "blocks", "你好", "😀", "0123"]


def _prompt(chars: int, seed: int) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    size = 0
    while size < chars:
        words.append(rng.choice(_WORDS))
        size += len(words[-1]) + 1
    return " ".join(words)


class LagProbe:
    """Largest delay of a 10 ms sleep on the running loop while it runs."""

    def __init__(self) -> None:
        self.worst = 0.0
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            start = time.monotonic()
            await asyncio.sleep(0.01)
            self.worst = max(self.worst, time.monotonic() - start - 0.01)

    async def stop(self) -> float:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        return self.worst


async def test_huge_prompts_do_not_block_the_loop(redis_server: str, tiny_tokenizer_dir: Path) -> None:
    prompts = [_prompt(1 << 20, seed) for seed in range(3)]
    tok = ModelTokenizer(tiny_tokenizer_dir)
    start = time.monotonic()
    expected = len(tok.tokenizer.encode(prompts[0], add_special_tokens=False).ids)  # what the loop would wait
    one_prompt_s = time.monotonic() - start
    assert one_prompt_s > 0.2, "the prompt is too small to show a stall on this machine"
    async with open_live_gateway(redis_server, tiny_tokenizer_dir, max_body_bytes=8 << 20) as gw:
        assert (await gw.client.get("/health")).status == 200
        probe = LagProbe()
        posts = [asyncio.create_task(gw.client.post("/v1/completions", json={"model": MODEL, "prompt": p}))
                 for p in prompts[:2]]
        posts.append(asyncio.create_task(gw.client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": prompts[2]}]})))
        health_s: list[float] = []
        while not all(p.done() for p in posts):  # /health while the prompts are being tokenized
            asked = time.monotonic()
            assert (await gw.client.get("/health")).status == 200
            health_s.append(time.monotonic() - asked)
        lag = await probe.stop()
        bodies = [await (await p).json() for p in posts]
    # each prompt was tokenized whole: it is refused for its length, counted exactly
    assert all(b["error"]["code"] == "context_length_exceeded" for b in bodies), bodies
    assert f"the prompt has {expected} tokens" in bodies[0]["error"]["message"]
    assert len(health_s) >= 2, "/health never ran while the prompts were tokenized"
    assert lag < one_prompt_s / 2, f"loop blocked {lag:.3f}s (one prompt takes {one_prompt_s:.3f}s inline)"
    assert max(health_s) < one_prompt_s / 2 + 0.5, health_s
