"""Two models behind one gateway, real processes: one Redis, engines for two
different tiny models ("alpha" twice, "beta" once), one gateway. Every answer equals its
own model's in-process greedy output; a kill -9 of one alpha engine mid-generation moves its
requests to the other alpha engine, never to beta; a model with no live engine answers at
once (404), and the in-flight requests of a model whose engines all died fail cleanly (503)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from gateway.clients.sse_reader import sse_events
from pagedserve.launch.redis_server import RedisServer
from tests.e2e.support import ROOT, EngineProcess, owner_of_most, serve_gateway
from tests.fixtures.models import make_tiny_model_dir

ALPHA, BETA = "alpha", "beta"
ENGINE_ARGS = ("--kv-cache-memory", "8MiB")
LONG = 480  # tokens: the tiny model's 512 positions less the prompt; no request ends before the kill


@pytest.fixture(scope="module")
def beta_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-beta"), seed=1)


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path, beta_dir: Path,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, dict[str, list[EngineProcess]]]]:
    logs = tmp_path_factory.mktemp("two-models")
    with RedisServer() as server:
        engines = {ALPHA: [EngineProcess(tiny_llama_dir, server.url, f"alpha-{i}", logs, "--served-model-name", ALPHA,
                                         *ENGINE_ARGS) for i in range(2)],
                   BETA: [EngineProcess(beta_dir, server.url, "beta-0", logs, "--served-model-name", BETA,
                                        *ENGINE_ARGS)]}
        try:
            for group in engines.values():
                for engine in group:
                    engine.wait_ready()
            yield server, engines
        finally:
            for group in engines.values():
                for engine in group:
                    engine.stop()


def greedy_texts(model_dir: Path, prompts: list[str], max_tokens: int) -> list[str]:
    """The model's in-process greedy output, decoded the way the gateway decodes it."""
    from common.sampling_params import SamplingParams
    from engine.llm import LLM
    from gateway.text.tokenizer import ModelTokenizer

    llm = LLM(model=str(model_dir), device="cpu", dtype="float32", kv_cache_memory=8 << 20)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    tok = ModelTokenizer(str(model_dir))
    return [tok.decode(out.outputs[0].token_ids) for out in outs]


async def complete(session: aiohttp.ClientSession, url: str, model: str, prompt: str, max_tokens: int,
                   started: asyncio.Event | None = None) -> tuple[int, str, str | None]:
    """A streamed greedy completion: (HTTP status, text, error code)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, error = "", None
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            return resp.status, "", (await resp.json())["error"]["code"]
        async for event in sse_events(resp):
            if "error" in event:
                error = event["error"]["code"]
                continue
            text += "".join(c["text"] for c in event["choices"])
            if started is not None and text:
                started.set()
    if started is not None:
        started.set()
    return 200, text, error


def freeze_owner(redis_url: str, model: str, engines: list[EngineProcess]) -> EngineProcess:
    """SIGSTOP every engine of `model`, then pick the one holding the most of its requests:
    frozen, nothing can finish between the choice and the kill."""
    for engine in engines:
        engine.proc.send_signal(signal.SIGSTOP)
    return owner_of_most(redis_url, model, engines)


async def test_each_model_answers_only_its_requests_and_fails_over_to_its_sibling(
        stack: tuple[RedisServer, dict[str, list[EngineProcess]]], tiny_llama_dir: Path, beta_dir: Path) -> None:
    server, engines = stack
    prompts = [f"Question {i}:" for i in range(50)]
    expected = {ALPHA: greedy_texts(tiny_llama_dir, prompts, 12), BETA: greedy_texts(beta_dir, prompts, 12)}
    assert expected[ALPHA] != expected[BETA]
    async with serve_gateway(server.url, orphan_after_s=3.0) as url, aiohttp.ClientSession() as session:
        jobs = [(model, i) for i in range(50) for model in (ALPHA, BETA)]
        results = await asyncio.gather(*(complete(session, url, model, prompts[i], 12) for model, i in jobs))
        for (model, i), (status, text, error) in zip(jobs, results, strict=True):
            assert (status, error) == (200, None)
            assert text == expected[model][i], f"{model} request {i} was not answered by {model}"

        # kill -9 one alpha engine mid-generation: its requests finish on the other alpha engine
        long_prompts = [f"Story {i} begins" for i in range(8)]
        reference = greedy_texts(tiny_llama_dir, long_prompts, LONG)
        started = [asyncio.Event() for _ in long_prompts]
        tasks = [asyncio.create_task(complete(session, url, ALPHA, p, LONG, started[i]))
                 for i, p in enumerate(long_prompts)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 120)
        victim = freeze_owner(server.url, ALPHA, engines[ALPHA])
        victim.kill()
        for engine in engines[ALPHA]:
            if engine is not victim:
                engine.proc.send_signal(signal.SIGCONT)
        disturbed = await asyncio.wait_for(asyncio.gather(*tasks), 180)
        assert [r[1] for r in disturbed] == reference and all(r[2] is None for r in disturbed)
        sibling = next(e for e in engines[ALPHA] if e is not victim)
        assert "claimed entries" in sibling.log_tail(400_000)
        assert "claimed entries" not in engines[BETA][0].log_tail(400_000)
        sibling.wait_drained()
        engines[BETA][0].wait_drained()

        # a model with no live engine answers at once
        begin = time.monotonic()
        status, _, code = await complete(session, url, "gamma", "hi", 4)
        assert (status, code) == (404, "model_not_found") and time.monotonic() - begin < 1.0

        # every beta engine dies mid-generation: its in-flight requests fail cleanly (no_engine)
        started = [asyncio.Event() for _ in range(4)]
        tasks = [asyncio.create_task(complete(session, url, BETA, f"Tale {i}", LONG, started[i])) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 120)
        freeze_owner(server.url, BETA, engines[BETA]).kill()
        failed = await asyncio.wait_for(asyncio.gather(*tasks), 120)
        assert all(error == "no_engine" for _, _, error in failed), failed
        begin = time.monotonic()
        status, _, code = await complete(session, url, BETA, "hi", 4)
        assert (status, code) == (404, "model_not_found") and time.monotonic() - begin < 1.0


def test_an_engine_with_other_weights_under_a_served_name_is_refused(
        stack: tuple[RedisServer, dict[str, list[EngineProcess]]], beta_dir: Path) -> None:
    server, engines = stack
    alive = [e for e in engines[ALPHA] if e.proc.poll() is None]
    assert alive and alive[0].heartbeat() is not None
    result = subprocess.run([sys.executable, "-m", "pagedserve.cli", "engine", "--model", str(beta_dir),
                             "--served-model-name", ALPHA, "--redis-url", server.url, "--engine-id", "impostor",
                             *ENGINE_ARGS], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "already served by engines with other weights" in result.stderr, result.stderr[-2000:]
