"""`pagedserve up` with the default model (SmolLM2-135M-Instruct): the README's run command
serves the official openai client (chat, completions, /v1/responses) and an OpenAI Agents SDK agent
that calls a tool over /v1/responses, and Ctrl-C stops every child (gateway, engine, Redis)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import openai

from common.ports import free_port
from tests.e2e.agents_support import assert_called_once_and_answered, run_weather_agent
from tests.e2e.support import ROOT

MODEL = "SmolLM2-135M-Instruct"


def _children(pid: int) -> list[int]:
    """Direct children of `pid` (from /proc)."""
    kids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                kids.append(int(entry.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _agent_calls_a_tool(base_url: str, model_dir: Path) -> None:
    """An Agents SDK agent over /v1/responses (tests/e2e/agents_support.py) on the default model."""

    async def run() -> tuple[list[str], Any]:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=120) as client:
            return await run_weather_agent(client, MODEL, model_dir, "What is the weather in Oslo?",
                                           temperature=0.0)

    assert_called_once_and_answered(*asyncio.run(run()))


def test_up_serves_the_default_model_and_stops_cleanly(smollm2_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    log = open(tmp_path / "up.log", "w")  # noqa: SIM115 - closed below
    up = subprocess.Popen([sys.executable, "-m", "pagedserve.cli", "up", "--port", str(port),
                           "--model", str(smollm2_dir), "--kv-cache-memory", "64MiB"],
                          cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    children: list[int] = []
    try:
        assert up.stdout is not None
        banner = ""
        for line in up.stdout:
            banner += line
            if "Ctrl-C" in line:
                break
        assert f"http://127.0.0.1:{port}" in banner and "curl" in banner and MODEL in banner
        children = _children(up.pid)
        assert len(children) == 3  # redis-server, engine, gateway
        with openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=120) as client:
            chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0,
                                                  messages=[{"role": "user", "content": "What is 2+2?"}])
            assert chat.choices[0].message.content
            stream = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6,
                                               temperature=0, stream=True, stream_options={"include_usage": True})
            chunks = list(stream)
            assert "".join(c.choices[0].text for c in chunks if c.choices).strip()
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
            response = client.responses.create(model=MODEL, input="What is 2+2?", max_output_tokens=8,
                                               temperature=0)
            assert response.output_text and client.responses.retrieve(response.id).output_text == response.output_text
        _agent_calls_a_tool(f"http://127.0.0.1:{port}/v1", smollm2_dir)
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        deadline = time.monotonic() + 10
        while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in children), "a child outlived pagedserve up"
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if up.stdout is not None:
            up.stdout.close()
        log.close()
