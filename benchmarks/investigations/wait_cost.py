"""What durability across a failover costs per engine step: the worker's per-step flush (one
MULTI/EXEC with an output entry per gateway, checkpoints, acks and probes) to a master with one
replica on loopback, without WAIT and with `WAIT 1` on the same connection, and the gateway's
submit with and without it. Prints one JSON line per case (milliseconds).

    PYTHONPATH=$PWD python benchmarks/investigations/wait_cost.py [--steps 400] [--batch 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import tempfile
import time

import redis

from common.ports import free_port
from common.protocol import Keys, OutputMessage, SeqOutput
from common.redis_conn import ReplicaAck, pinned, pooled_client
from engine.worker.outbox import Outbox, flush
from pagedserve.launch.redis_server import find_redis_binary

KEYS = Keys("bench")


def _start(binary: str, workdir: str, port: int, master: int | None) -> subprocess.Popen[bytes]:
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
            "--repl-diskless-sync-delay", "0", "--dir", workdir, "--dbfilename", f"d{port}.rdb"]
    if master is not None:
        args += ["--replicaof", "127.0.0.1", str(master)]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            with redis.Redis(port=port) as client:
                if master is None or client.info("replication").get("master_link_status") == "up":
                    return proc
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"redis on {port} not ready")
        time.sleep(0.05)


def _outbox(step: int, batch: int) -> Outbox:
    box = Outbox()
    for i in range(batch):
        box.add(f"gw{i % 2}", OutputMessage(id=f"r{i}", seq=step, outputs=[SeqOutput(index=0, token_ids=[100 + step],
                                                                                     offset=step)]))
    return box


def _figures(name: str, times: list[float], **extra: object) -> str:
    ms = sorted(t * 1000 for t in times)
    return json.dumps({"case": name, "n": len(ms), "mean_ms": round(statistics.fmean(ms), 3),
                       "p50_ms": round(ms[len(ms) // 2], 3), "p99_ms": round(ms[int(len(ms) * 0.99)], 3), **extra})


async def _bench(port: int, steps: int, batch: int) -> None:
    """Cases alternate step by step, so a busy machine slows them alike."""
    client = pooled_client(f"redis://127.0.0.1:{port}/0", 4, 5.0)
    acks = {"flush": None, "flush+WAIT 1": ReplicaAck(1, 500),
            "submit XADD": None, "submit XADD+WAIT 1": ReplicaAck(1, 500)}
    times: dict[str, list[float]] = {name: [] for name in acks}
    try:
        for step in range(-20, steps):  # 20 warm-up rounds
            for name, ack in acks.items():
                start = time.perf_counter()
                if name.startswith("flush"):
                    await flush(client, KEYS, KEYS.requests("m"), _outbox(step, batch), 60, ["gw0", "gw1"], None, ack)
                else:
                    async with pinned(client) as conn:
                        await conn.xadd(KEYS.requests("m"), {"m": b"x" * 600}, maxlen=1000)
                        if ack is not None:
                            await ack.wait(conn)
                if step >= 0:
                    times[name].append(time.perf_counter() - start)
        for name, ack in acks.items():
            extra = {"batch": batch} if name.startswith("flush") else {}
            if ack is not None:
                extra |= {"acked": ack.figures.acked, "timeouts": ack.figures.timeouts}
            print(_figures(name, times[name], **extra), flush=True)
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=32, help="requests with a token in each step")
    args = parser.parse_args()
    binary = find_redis_binary()
    with tempfile.TemporaryDirectory() as workdir:
        master_port, replica_port = free_port(), free_port()
        procs = [_start(binary, workdir, master_port, None)]
        try:
            procs.append(_start(binary, workdir, replica_port, master_port))
            asyncio.run(_bench(master_port, args.steps, args.batch))
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()


if __name__ == "__main__":
    main()
