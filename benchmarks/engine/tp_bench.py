"""What tensor parallelism costs on the CPU (gloo), JSON lines.

- ``broadcast``: rank 0's per-step message to a spawned rank 1 (`engine.parallel.channel`):
  pack time, and send + a one-value all-reduce the receiver answers with (so the time covers
  delivery), for decode steps of B sequences with block tables W blocks wide, and one prefill
  chunk; the message's int64 values and whether it needed a second broadcast.
- ``check``: greedy tokens at every TP size equal TP = 1's (exit status 1 otherwise): what
  `scripts/gpu_check.sh` runs on a machine with two GPUs (`--device cuda`, NCCL).
- ``step``: the engine's mean step time (`LLMEngine.stats()`: step_seconds / num_steps) and the
  broadcast's share of it (publish_seconds) at TP = 1, 2, ..., the same total torch threads
  split over the ranks, greedy decode of B prompts; tok/s alongside.

    python benchmarks/engine/tp_bench.py [--parts broadcast,step,check] [--model DIR] [--sizes 1,3] [--threads 3]
                                  [--batch 16] [--tokens 32] [--rounds 200] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.ports import free_port
from common.sampling_params import SamplingParams
from engine.model.step_inputs import StepInputs
from engine.parallel.channel import Rendezvous, join
from engine.parallel.step_message import Command, control, header, pack


def _inputs(batch: int, width: int, prefill: int = 0) -> StepInputs:
    tokens = prefill + batch
    return StepInputs(
        input_ids=torch.randint(0, 49_152, (tokens,)), positions=torch.arange(tokens), slots=torch.arange(tokens),
        prefill_query_start=[0, prefill] if prefill else [0], prefill_context_lens=[prefill] if prefill else [],
        block_tables=torch.randint(0, 5000, ((1 if prefill else 0) + batch, width), dtype=torch.int32),
        decode_context_lens=torch.full((batch,), 100, dtype=torch.int32), swap_out=[], swap_in=[], copy=[])


def _receiver(rendezvous: Rendezvous) -> None:
    torch.set_num_threads(1)
    groups = join(rendezvous, 1)
    ack = torch.zeros(1)
    while header(groups.receive())["command"] != Command.SHUTDOWN:
        dist.all_reduce(ack, group=groups.compute)
    groups.close()


def bench_broadcast(rounds: int) -> None:
    rendezvous = Rendezvous(master_addr="127.0.0.1", master_port=free_port("127.0.0.1"), world_size=2, backend="gloo",
                            timeout_s=60.0)
    proc = multiprocessing.get_context("spawn").Process(target=_receiver, args=(rendezvous,))
    proc.start()
    groups = join(rendezvous, 0)
    ack = torch.zeros(1)
    cases = [(1, 8, 0), (16, 8, 0), (64, 16, 0), (256, 32, 0), (256, 64, 0), (0, 64, 1024)]
    for batch, width, prefill in cases:
        inputs = _inputs(batch, width, prefill)
        message = pack(inputs)
        packs, sends = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            message = pack(inputs)
            t1 = time.perf_counter()
            groups.send(message)
            dist.all_reduce(ack, group=groups.compute)
            t2 = time.perf_counter()
            packs.append(t1 - t0)
            sends.append(t2 - t1)
        print(json.dumps({"bench": "broadcast", "decode_seqs": batch, "prefill_tokens": prefill,
                          "table_width": width, "values": int(message.shape[0]),
                          "two_parts": bool(message.shape[0] > 4096),
                          "pack_us": round(1e6 * statistics.median(packs), 1),
                          "send_and_ack_us": round(1e6 * statistics.median(sends), 1)}), flush=True)
    groups.send(control(Command.SHUTDOWN))
    proc.join(30)
    groups.close()


def _llm(model: str, size: int, threads: int, device: str) -> Any:
    from engine.llm import LLM

    torch.set_num_threads(threads)
    return LLM(model, dtype="float32", device=device, kv_cache_memory=256 << 20, gpu_memory_utilization=0.3,
               tensor_parallel_size=size, tensor_parallel_threads=max(1, threads // size))


def check(model: str, sizes: list[int], threads: int, device: str) -> bool:
    prompts = [[1 + (i * 29 + j) % 1000 for j in range(20 + 7 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    tokens = {}
    for size in sorted(set(sizes) | {1}):
        with _llm(model, size, threads, device) as llm:
            tokens[size] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    ok = all(t == tokens[1] for t in tokens.values())
    for size, got in tokens.items():
        same = sum(a == b for a, b in zip(got, tokens[1], strict=True))
        print(json.dumps({"bench": "check", "device": device, "tensor_parallel_size": size,
                          "identical_to_tp1": f"{same}/{len(prompts)}"}), flush=True)
    return ok


def bench_step(model: str, sizes: list[int], threads: int, batch: int, tokens: int, device: str) -> None:
    prompts = [[1 + (i * 13 + j) % 1000 for j in range(32)] for i in range(batch)]
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for size in sizes:
        with _llm(model, size, threads, device) as llm:
            llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up (packing, caches)
            before = llm.stats()
            start = time.perf_counter()
            llm.generate(prompts, params)
            wall = time.perf_counter() - start
            after = llm.stats()
        steps = after["num_steps"] - before["num_steps"]
        step_s = (after["step_seconds"] - before["step_seconds"]) / steps
        publish_s = (after["publish_seconds"] - before["publish_seconds"]) / steps
        print(json.dumps({"bench": "step", "model": Path(model).name, "device": device, "tensor_parallel_size": size,
                          "threads_per_rank": max(1, threads // size), "batch": batch, "steps": steps,
                          "step_ms": round(1e3 * step_s, 2), "broadcast_ms": round(1e3 * publish_s, 3),
                          "broadcast_share": round(publish_s / step_s, 4),
                          "tok_s": round(batch * tokens / wall, 1)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="broadcast,step")
    parser.add_argument("--model", help="model directory (default: the fetched SmolLM2 fp32 directory)")
    parser.add_argument("--sizes", default="1,3", help="tensor_parallel_size values (SmolLM2: 1 or 3; 9 heads)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in all, split over the ranks")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per rank)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.model is None and {"step", "check"} & set(parts):
        from engine.model.fetch import default_model_dir

        args.model = str(default_model_dir(progress=True))
    ok = True
    if "broadcast" in parts:
        bench_broadcast(args.rounds)
    if "check" in parts:
        ok = check(args.model, sizes, args.threads, args.device)
    if "step" in parts:
        bench_step(args.model, sizes, args.threads, args.batch, args.tokens, args.device)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
