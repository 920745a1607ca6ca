"""Block manager benchmark: block operations per second, and the block work of one decode step
for a full batch. Prints one JSON object per line on stdout.

    .venv/bin/python benchmarks/engine/block_manager_bench.py [--seqs 256] [--prompt-len 512]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from engine.kv.block_manager import BlockManager

GOAL_DECODE_STEP_MS = 1.0


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def rate(name: str, run: Callable[[], int], calls: int, blocks_per_call: float) -> None:
    """Time `run` (which makes `calls` calls) and print calls/s and block ops/s, a block op being
    one block taken from or returned to the free list, or one ref-count change."""
    start = time.perf_counter()
    run()
    elapsed = time.perf_counter() - start
    emit(
        bench=name,
        calls=calls,
        seconds=round(elapsed, 4),
        calls_per_s=round(calls / elapsed),
        block_ops_per_call=blocks_per_call,
        block_ops_per_s=round(calls * blocks_per_call / elapsed),
    )


def bench_allocate_free(block_size: int, prompt_len: int, calls: int) -> None:
    manager = BlockManager(4096, block_size)
    prompt = list(range(prompt_len))
    blocks = -(-prompt_len // block_size)

    def run() -> int:
        for i in range(calls):
            manager.allocate(i, prompt)
            manager.free(i)
        return calls

    rate("allocate+free", run, calls, 2 * blocks)


def bench_append(block_size: int, calls: int) -> None:
    manager = BlockManager(-(-calls // block_size) + 1, block_size)
    manager.allocate(0, [0])

    def run() -> int:
        for token in range(calls):
            manager.append_slot(0, token)
        return calls

    rate("append_slot", run, calls, 1 / block_size)  # one block allocated every block_size calls


def bench_fork(block_size: int, prompt_len: int, calls: int) -> None:
    manager = BlockManager(4096, block_size)
    manager.allocate(0, list(range(prompt_len)))
    blocks = -(-prompt_len // block_size)

    def run() -> int:
        for i in range(1, calls + 1):
            manager.fork(0, i)
            manager.free(i)
        return calls

    rate("fork+free", run, calls, 2 * blocks)  # ref count up and down per block


def bench_swap(block_size: int, prompt_len: int, calls: int) -> None:
    blocks = -(-prompt_len // block_size)
    manager = BlockManager(4 * blocks, block_size, 2 * blocks, watermark=0.0)
    manager.allocate(0, list(range(prompt_len)))

    def run() -> int:
        for _ in range(calls):
            manager.swap_out([0])
            manager.swap_in([0])
        return calls

    rate("swap_out+swap_in", run, calls, 2 * blocks)
    manager.check_invariants()


def bench_decode_step(block_size: int, num_seqs: int, prompt_len: int, steps: int, prefix_caching: bool) -> None:
    """Median time of one decode step's block work: can_append_slot + append_slot for every
    running sequence (and mark_computed, which publishes newly full blocks, when caching)."""
    per_seq = -(-(prompt_len + steps) // block_size)
    manager = BlockManager(num_seqs * per_seq + 16, block_size, enable_prefix_caching=prefix_caching)
    shared = list(range(prompt_len // 2))  # half of every prompt is a common system prompt
    for seq_id in range(num_seqs):
        prompt = shared + [100_000 + seq_id] * (prompt_len - len(shared))
        manager.allocate(seq_id, prompt)
        manager.mark_computed(seq_id, prompt_len)
    seq_ids = list(range(num_seqs))
    step_ns: list[int] = []
    for step in range(steps):
        start = time.perf_counter_ns()
        for seq_id in seq_ids:
            if manager.can_append_slot(seq_id):
                manager.append_slot(seq_id, step)
        if prefix_caching:
            for seq_id in seq_ids:
                manager.mark_computed(seq_id, prompt_len + step)
        step_ns.append(time.perf_counter_ns() - start)
    manager.check_invariants()
    assert all(manager.num_tokens(s) == prompt_len + steps for s in seq_ids), "a sequence did not grow"
    step_ns.sort()
    median_ms = statistics.median(step_ns) / 1e6
    stats = manager.stats()
    emit(
        bench="decode_step_block_work",
        prefix_caching=prefix_caching,
        num_seqs=num_seqs,
        prompt_len=prompt_len,
        block_size=block_size,
        steps=steps,
        median_ms=round(median_ms, 4),
        p90_ms=round(step_ns[int(0.9 * len(step_ns))] / 1e6, 4),
        max_ms=round(step_ns[-1] / 1e6, 4),
        goal_ms=GOAL_DECODE_STEP_MS,
        meets_goal=median_ms < GOAL_DECODE_STEP_MS,
        used_blocks=stats.num_used_blocks,
        prefix_hit_rate=round(stats.prefix_hit_rate, 4),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=512, help="decode steps to time")
    parser.add_argument("--calls", type=int, default=20_000, help="calls per ops/s figure")
    args = parser.parse_args()
    bs, calls = args.block_size, args.calls
    bench_allocate_free(bs, args.prompt_len, calls)
    bench_append(bs, calls * 10)
    bench_fork(bs, args.prompt_len, calls)
    bench_swap(bs, args.prompt_len, calls // 10)
    for prefix_caching in (False, True):
        bench_decode_step(bs, args.seqs, args.prompt_len, args.steps, prefix_caching)


if __name__ == "__main__":
    main()
