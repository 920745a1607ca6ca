"""What the routing e2e tests share: distinct conversation openings, a completion call, waiting
for the engines' routed announcements and fresh heartbeat figures, and a multi-turn run."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from tests.e2e.support import EngineProcess, serve_gateway

WORDS = ["apple", "river", "stone", "cloud", "maple", "tiger", "lemon", "violet", "copper", "desert", "harbor",
         "meadow"]


def system_prompt(i: int) -> str:
    """A distinct opening of some 100 tokens per conversation."""
    return f"System {i}: " + " ".join(WORDS[(i * 5 + k * 7) % len(WORDS)] for k in range(60)) + "\n"


async def complete(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
                   max_tokens: int = 8) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        payload: dict[str, Any] = await resp.json()
        assert resp.status == 200, payload
        return payload


def announced(engines: list[EngineProcess], timeout: float = 60.0) -> None:
    """Both engines announce a routed stream (and it is registered) before the gateway routes."""
    deadline = time.monotonic() + timeout
    while True:
        beats = [e.heartbeat() for e in engines]
        if all(b is not None and b.routed and b.block_size > 0 for b in beats):
            return
        assert time.monotonic() < deadline, f"engines never announced routed: {beats}"
        time.sleep(0.1)


def fresh_stats(engine: EngineProcess, since: float, timeout: float = 30.0) -> dict[str, float]:
    """Figures from a heartbeat written after `since` (wall clock)."""
    deadline = time.monotonic() + timeout
    while True:
        beat = engine.heartbeat()
        if beat is not None and beat.time > since:
            return beat.stats
        assert time.monotonic() < deadline, f"no fresh heartbeat from {engine.engine_id}"
        time.sleep(0.05)


async def multi_turn(session: aiohttp.ClientSession, gateway: str, model: str, conversations: int, turns: int,
                     block_size: int = 16) -> tuple[int, int]:
    """`conversations` concurrent chats with distinct openings, each turn resending the whole
    history: (prompt tokens found cached, cacheable ones: the previous turn's prompt in whole
    blocks) over the later turns."""
    history = {i: system_prompt(i) for i in range(conversations)}
    last = dict.fromkeys(history, 0)
    cached = cacheable = 0
    for turn in range(turns):
        replies = await asyncio.gather(*(complete(session, gateway, model, h) for h in history.values()))
        for i, reply in zip(history, replies, strict=True):
            usage = reply["usage"]
            if turn:
                cacheable += last[i] // block_size * block_size
                cached += min(usage["prompt_tokens_details"]["cached_tokens"], last[i] // block_size * block_size)
            last[i] = usage["prompt_tokens"]
            history[i] += reply["choices"][0]["text"] + f"\nUser turn {turn}: tell me more.\n"
    return cached, cacheable


async def assert_turns_follow_their_prefix(url: str, engines: list[EngineProcess], model: str) -> None:
    """Four 3-turn conversations through a fresh gateway: >= 90% of the later turns' cacheable
    history found cached, and every engine served routed requests."""
    announced(engines)
    async with aiohttp.ClientSession() as session, serve_gateway(url) as gateway:
        cached, cacheable = await multi_turn(session, gateway, model, conversations=4, turns=3)
    assert cacheable > 0
    assert cached / cacheable >= 0.9, f"later turns found only {cached}/{cacheable} cacheable tokens cached"
    taken = [fresh_stats(e, time.time()).get("routed_taken", 0.0) for e in engines]
    assert all(t > 0 for t in taken), f"both engines should serve routed requests: {taken}"
