"""The served part of benchmarks/peer/peer_bench.py: `pagedserve up` and `vllm serve`, one after the
other on free loopback ports, both driven by the same client, `vllm bench serve`.

Each server runs in a session of its own; stopping it sends SIGTERM to the whole process group
(vLLM's engine core and worker, pagedserve's Redis, engine and gateway) and SIGKILL after a grace
period, so nothing outlives the part, even on failure."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.peer.counters import pagedserve_figures, vllm_figures
from benchmarks.peer.vllm_env import vllm_env
from common.openmp_env import peer_environ
from common.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
WARMUPS = 1  # untimed client requests before each run (the first request of the trace)


@dataclass
class ServerSpec:
    """How to start one server, and how to read its (generated tokens, requests in flight) as of a
    time.time() stamp (benchmarks/peer/counters.py)."""

    cmd: list[str]
    port: int
    figures: Callable[[str, float], tuple[float, float]]
    env: dict[str, str] = field(default_factory=dict)


def pagedserve_spec(model: str, kv_cache_gib: int, extra: str = "") -> ServerSpec:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.cli", "up", "--port", str(port), "--model", model,
           "--kv-cache-memory", f"{kv_cache_gib}GiB", *shlex.split(extra)]
    return ServerSpec(cmd, port, pagedserve_figures)


def vllm_spec(venv: Path, model: str, kv_cache_gib: int, max_model_len: int, dtype: str = "float32") -> ServerSpec:
    port = free_port()
    cmd = [str(venv / "bin" / "vllm"), "serve", model, "--dtype", dtype, "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", str(max_model_len)]
    return ServerSpec(cmd, port, vllm_figures, vllm_env(kv_cache_gib))


def _idle_tokens(spec: ServerSpec, url: str, timeout: float = 1800.0) -> float:
    """Wait until the server has nothing in flight (requests the client or the gateway gave up on may
    still decode); its generated-token count then."""
    deadline = time.monotonic() + timeout
    while True:
        tokens, in_flight = spec.figures(url, time.time())
        if not in_flight:
            return tokens
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} still had {in_flight:.0f} requests in flight after {timeout:.0f}s")
        time.sleep(1.0)


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _wait_model(url: str, proc: subprocess.Popen[bytes], timeout: float) -> str:
    """Poll /v1/models until the server lists a model; its announced name."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} during start-up")
        try:
            data = _get_json(f"{url}/v1/models").get("data") or []
            if data:
                return str(data[0]["id"])
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            pass
        time.sleep(1.0)
    raise RuntimeError(f"server at {url} listed no model within {timeout:.0f}s")


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(parent pid, start time, state) of a process, from /proc/PID/stat; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), int(fields[19]), fields[0]
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: int, started: int) -> bool:
    """True while that very process (not a reused pid) runs; a zombie is not running."""
    info = _stat(pid)
    return info is not None and info[1] == started and info[2] != "Z"


def _descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, start time) of every live descendant of `pid`, also those in sessions of their own."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        info = _stat(int(entry.name))
        if info is not None:
            children.setdefault(info[0], []).append((int(entry.name), info[1]))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child[0])
    return found


def _stop_group(proc: subprocess.Popen[bytes], grace: float = 60.0) -> None:
    """SIGTERM the server's process group and wait `grace` seconds for it to stop its children
    (`pagedserve up` starts its engine and gateway in sessions of their own); then SIGKILL whatever
    of the group and of those descendants is left."""
    tree = _descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        print(f"server {proc.pid} did not stop in {grace:.0f}s: SIGKILL", file=sys.stderr, flush=True)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pid, started in tree:
        if alive(pid, started):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def server(spec: ServerSpec, log_path: Path, timeout: float = 900.0) -> Iterator[tuple[str, str]]:
    """Run the server until the block ends; yields (base URL, served model name)."""
    url = f"http://127.0.0.1:{spec.port}"
    with log_path.open("w") as log:
        proc = subprocess.Popen(spec.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=peer_environ() | spec.env)
    try:
        start = time.perf_counter()
        name = _wait_model(url, proc, timeout)
        print(f"  up in {time.perf_counter() - start:.0f}s at {url}, model '{name}' (log {log_path})",
              file=sys.stderr, flush=True)
        yield url, name
    finally:
        _stop_group(proc)


def bench_serve(venv: Path, spec: ServerSpec, name: str, tokenizer: str, out: Path, *, num_prompts: int,
                input_len: int, output_len: int, concurrency: int | None, seed: int) -> dict[str, Any]:
    """One `vllm bench serve` run (random dataset, greedy, ignore_eos): its figures, failure causes,
    and the server-side output rate: tokens the server's engine generated from idle until the client
    finished (benchmarks/peer/counters.py), less the client's warm-up requests (`output_len` tokens
    each, sent before the timed run), over the client's timed duration."""
    url = f"http://127.0.0.1:{spec.port}"
    cmd = [str(venv / "bin" / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", url,
           "--model", name, "--tokenizer", tokenizer, "--dataset-name", "random",
           "--random-input-len", str(input_len), "--random-output-len", str(output_len),
           "--num-prompts", str(num_prompts), "--ignore-eos", "--temperature", "0", "--seed", str(seed),
           "--disable-tqdm", "--save-detailed", "--num-warmups", str(WARMUPS),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    if concurrency:
        cmd += ["--max-concurrency", str(concurrency)]
    out.unlink(missing_ok=True)
    before = _idle_tokens(spec, url)
    with out.with_suffix(".log").open("w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0 or not out.is_file():
        tail = out.with_suffix(".log").read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"vllm bench serve exited with {proc.returncode}:\n" + "\n".join(tail))
    report = json.loads(out.read_text())
    served = spec.figures(url, time.time())[0] - before - WARMUPS * output_len
    return summarize(report) | {"server_output_tokens": int(served),
                                "server_output_tok_s": round(served / report["duration"], 2)}


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The figures peer_bench prints from a `vllm bench serve` result file."""
    errors = Counter(_first_line(e) for e in report.get("errors", []) if e)
    return {
        "completed": report["completed"], "failed": report["failed"],
        "duration_s": round(report["duration"], 2),
        "output_tok_s": round(report["output_throughput"], 2),
        "ttft_p50_s": round(report["median_ttft_ms"] / 1000, 3),
        "ttft_p99_s": round(report["p99_ttft_ms"] / 1000, 3),
        "tpot_p50_ms": round(report["median_tpot_ms"], 1),
        "failure_causes": dict(errors.most_common(5)),
    }


def _first_line(error: str) -> str:
    """A failure's cause in one line: the exception line of a traceback, else the message."""
    lines = [ln.strip() for ln in error.strip().splitlines() if ln.strip()]
    return (lines[-1] if lines else error)[:200]
