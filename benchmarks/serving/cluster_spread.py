"""How the queue's load spreads over a Redis Cluster's masters: a real cluster on loopback
(`tests/fixtures/redis_cluster.py`: masters with a replica each), fake engines for several models
(`benchmarks/serving/fake_engine.py`: the real engine worker around a model-less engine),
several gateways, all with `--redis-cluster`, and a burst of streamed completions spread over
gateways and models. Each master's share of the commands (INFO stats) and of the main thread's
CPU time (INFO cpu) during the burst is printed as one JSON line.

    python benchmarks/serving/cluster_spread.py --models 2 --gateways 4 --engines-per-model 3 --requests 400

The hash tags put each model's keys, each gateway's and each engine's on one slot; which master a
slot lands on is the cluster's choice, so a few models and gateways spread unevenly by chance
(the shares say how it came out)."""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import redis
from redis.cluster import ClusterNode, RedisCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root: benchmarks.* importable
from benchmarks.serving.burst_bench import _healthy, _start
from benchmarks.serving.redis_cost import _start_module, streamed_tokens
from common.ports import free_port
from common.protocol import Keys
from tests.fixtures.redis_cluster import RedisClusterGroup


def master_counters(group: RedisClusterGroup) -> dict[int, tuple[int, float]]:
    """Per master: commands processed and main-thread CPU seconds so far."""
    out = {}
    for port in group.masters():
        with redis.Redis(port=port, socket_timeout=5) as client:
            info = client.info()
        cpu = float(info.get("used_cpu_user_main_thread", info["used_cpu_user"]))
        cpu += float(info.get("used_cpu_sys_main_thread", info["used_cpu_sys"]))
        out[port] = (int(info["total_commands_processed"]), cpu)
    return out


async def burst(urls: list[str], models: list[str], requests: int, concurrency: int, max_tokens: int) -> list[int]:
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(i: int) -> int:
            async with limit:
                return await streamed_tokens(session, urls[i % len(urls)], models[(i // len(urls)) % len(models)],
                                             f"spread request {i}", max_tokens)

        return list(await asyncio.gather(*(one(i) for i in range(requests))))


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from tests.fixtures.models import make_tiny_model_dir

    model_dir = str(make_tiny_model_dir(workdir / "tiny-model"))
    group = RedisClusterGroup(masters=args.masters, replicas=1, node_timeout_ms=2000)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        env = {"PAGEDSERVE_REDIS_CLUSTER": group.nodes_arg, "OMP_NUM_THREADS": "1"}
        models = [f"model-{m}" for m in range(args.models)]
        for model in models:
            procs.append(_start_module(["benchmarks.serving.fake_engine", "--redis-cluster", group.nodes_arg,
                                        "--model-name", model, "--model-dir", model_dir,
                                        "--engines", str(args.engines_per_model), "--tok-s", str(args.engine_tok_s),
                                        "--id-prefix", f"fake-{model}"], workdir / f"{model}.log", env))
        ports = [free_port() for _ in range(args.gateways)]
        procs += [_start(["gateway", "--host", "127.0.0.1", "--port", str(port), "--gateway-id", f"spread-gw-{i}",
                          "--max-queued", str(max(4096, args.requests))], workdir / f"gateway-{i}.log", env)
                  for i, port in enumerate(ports)]
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        engines = args.models * args.engines_per_model
        deadline = time.monotonic() + args.ready_timeout
        with RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in group.addresses]) as client:
            while not all(_healthy(u) for u in urls) or int(client.zcard(Keys().engines)) < engines:
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"fleet not ready; logs in {workdir}")
                time.sleep(0.5)
        time.sleep(args.settle_s)  # start-up writes (groups, first heartbeats) out of the burst
        before, start = master_counters(group), time.monotonic()
        results = asyncio.run(burst(urls, models, args.requests, args.concurrency, args.max_tokens))
        after, duration = master_counters(group), time.monotonic() - start
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        group.stop()
    commands = {port: after[port][0] - before[port][0] for port in before}
    cpu = {port: after[port][1] - before[port][1] for port in before}
    ok = [t for t in results if t >= 0]
    return {"masters": args.masters, "models": args.models, "gateways": args.gateways, "engines": engines,
            "engine_tok_s": args.engine_tok_s, "requests": args.requests, "completed": len(ok),
            "failed": len(results) - len(ok), "tokens": sum(ok), "duration_s": round(duration, 2),
            "tok_s": round(sum(ok) / duration, 1),
            "command_share": [round(commands[p] / max(1, sum(commands.values())), 3) for p in sorted(commands)],
            "cpu_share": [round(cpu[p] / max(1e-9, sum(cpu.values())), 3) for p in sorted(cpu)],
            "commands": [commands[p] for p in sorted(commands)],
            "cpu_s": [round(cpu[p], 3) for p in sorted(cpu)]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--masters", type=int, default=3)
    parser.add_argument("--models", type=int, default=2)
    parser.add_argument("--gateways", type=int, default=4)
    parser.add_argument("--engines-per-model", type=int, default=3)
    parser.add_argument("--engine-tok-s", type=float, default=500.0, help="tokens a second each fake engine delivers")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=128, help="streams open at once")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--settle-s", type=float, default=2.0, help="wait after start-up before measuring")
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cluster-spread-") as workdir:
        print(json.dumps(run(args, Path(workdir))), flush=True)


if __name__ == "__main__":
    main()
