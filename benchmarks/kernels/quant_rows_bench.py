"""The quantized kernel at the row counts of decoding: SmolLM2's four linears per layer (qkv, o,
gate_up, down) in Q4_1 with random weights, one `quant_linear` call per linear, interleaved; each
in GGUF order (`gguf`) and in the kernel's eight-row layout (`r8`, `ops.quant.interleave`).

- `rows`: one layer's four linears at 1, 4 and 5 rows (a plain decode row, a K = 3 and a K = 4
  verify row), 2 threads; the weights stay in cache, so this is the arithmetic's cost;
- `prompt_rows`: one layer at 32 rows with int8 activations and with fp32 ones (`exact_rows`: a
  step's prompt rows);
- `one_row`: all 30 layers' linears at one row (66 MB, out of cache) at 1 and 2 threads: the
  bandwidth a decode step gets and how it scales over the second thread;
- `lm_head`: SmolLM2's tied Q8_0 lm_head (49152 x 576, 30 MB, GGUF order) at 1, 2, 4 and 5 rows,
  int8 activations (the logit screen's pass), 2 threads;
- `lm_head_bf16_screen` (CPUs with native bf16 only): the same lm_head at 8, 32 and 64 rows, the
  int8 kernel against the bf16 screen's GEMM (`ops.screen.screen_logits` on its packed copy), which
  `engine/model/quant_screen.py` uses from `BF16_SCREEN_MIN_ROWS` greedy rows on;
- `amx_bf16` (CPUs with the AMX-BF16 kernel only): one layer's four r8 linears at 8 to 1024 rows,
  the int8 kernel, bf16 `quant_linear` (bf16 AMX tiles, `dtype bfloat16`), oneDNN's bf16 GEMM on
  cached bf16 weights (what a bf16 checkpoint runs) and the fp32 prompt-row path (`exact_rows`);
- `amx_int8` (CPUs with AMX-INT8 only): a SmolLM2-shaped linear pair (576 -> 1536, 1536 -> 576) in
  Q4_1r8 and Q8_0r8 at 1 to 128 int8 rows, 1 and 2 threads, the AMX-INT8 tiles (`PAGEDSERVE_INT8_AMX=all`) against the
  VNNI kernel (`=0`): the same bits (tests/ops/test_quant_int8_amx.py). `--amx-int8-only` runs just this;
- `format_rows`: each r8 format of `--formats` (the K-quants too) at `--format-rows` rows on one thread, a
  real-size weight (`--n` x `--k`, 4096 x 2048) held in cache, timed in the thread's CPU time (another
  process's load slows it little): GMAC/s, the arithmetic's rate where a batch of 32 is compute-bound.
  `--format-rows-only` runs just this (run it in two checkouts to compare kernels); `--format-rounds`
  takes the best of more rounds on a noisy machine.

Prints one JSON object per line.

    .venv/bin/python benchmarks/kernels/quant_rows_bench.py [--iters 300] [--amx-int8-only]
    .venv/bin/python benchmarks/kernels/quant_rows_bench.py --format-rows-only [--formats Q4_K,Q6_K,Q4_0,Q8_0]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
from collections.abc import Callable

import torch

import ops.quant as oq
from ops.reference import quant as rq
from ops.screen import bf16_packing_available, native_bf16, pack_screen_weight, screen_logits

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): qkv, o, gate_up, down
LAYERS = 30
PROMPT_ROWS = 32  # a prompt chunk: its rows keep fp32 activations (`exact_rows`)


def sample(fn: Callable[[], object], samples: list[float]) -> None:
    """Time one call of `fn` into `samples`."""
    start = time.perf_counter()
    fn()
    samples.append(time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--amx-int8-only", action="store_true", help="only the AMX-INT8 against VNNI lines")
    parser.add_argument("--format-rows-only", action="store_true", help="only the per-format GMAC/s lines")
    parser.add_argument("--formats", default="Q4_K,Q6_K,Q4_0,Q8_0", help="format_rows: r8 formats by base name")
    parser.add_argument("--format-rows", default="1,4,32", help="format_rows: row counts")
    parser.add_argument("--format-rounds", type=int, default=5, help="format_rows: best of this many rounds")
    parser.add_argument("--n", type=int, default=4096, help="format_rows: the weight's rows")
    parser.add_argument("--k", type=int, default=2048, help="format_rows: the weight's columns")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    rows_list = [int(r) for r in args.format_rows.split(",")]
    if args.amx_int8_only:
        amx_int8_rows(gen, max(20, args.iters // 3))
        return
    if args.format_rows_only:
        format_rows(args.formats.split(","), rows_list, args.n, args.k, args.format_rounds)
        return
    raw_layer = [(rq.quantize(torch.randn(n, k, generator=gen), rq.Q4_1), k) for n, k in SHAPES]
    raw_model = [(rq.quantize(torch.randn(n, k, generator=gen), rq.Q4_1), k) for _ in range(LAYERS) for n, k in SHAPES]
    layouts = {"gguf": oq.Q4_1, "r8": oq.Q4_1R8}
    layer = {name: [(_laid_out(w, fmt), k) for w, k in raw_layer] for name, fmt in layouts.items()}
    model = {name: [(_laid_out(w, fmt), k) for w, k in raw_model] for name, fmt in layouts.items()}
    xs = {k: torch.randn(5, k, generator=gen) for _, k in SHAPES}

    def run(weights: list[tuple[torch.Tensor, int]], fmt: oq.QuantFormat, rows: int) -> Callable[[], None]:
        def go() -> None:
            for w, k in weights:
                oq.quant_linear(xs[k][:rows], w, fmt, checked=True)
        return go

    torch.set_num_threads(2)
    per_rows = {(name, rows): [] for name in layouts for rows in (1, 4, 5)}  # type: dict[tuple[str, int], list[float]]
    for _ in range(args.iters):
        for (name, rows), samples in per_rows.items():
            sample(run(layer[name], layouts[name], rows), samples)
    for name in layouts:
        us = {rows: 1e6 * statistics.median(per_rows[(name, rows)]) for rows in (1, 4, 5)}
        print(json.dumps({"bench": "rows", "layout": name, "threads": 2,
                          "us_per_layer": {str(r): round(v, 1) for r, v in us.items()},
                          "five_over_four": round(us[5] / us[4], 3), "four_over_one": round(us[4] / us[1], 3)}))
    prompt = {(name, exact): [] for name in layouts for exact in (False, True)}  # type: dict[tuple[str, bool], list[float]]
    x32 = {k: torch.randn(PROMPT_ROWS, k, generator=gen) for _, k in SHAPES}

    def prompt_pass(weights: list[tuple[torch.Tensor, int]], fmt: oq.QuantFormat, exact: bool) -> Callable[[], None]:
        def go() -> None:
            for w, k in weights:
                oq.quant_linear(x32[k], w, fmt, checked=True, exact_rows=PROMPT_ROWS if exact else 0)
        return go

    for _ in range(max(10, args.iters // 8)):
        for (name, exact), samples in prompt.items():
            sample(prompt_pass(layer[name], layouts[name], exact), samples)
    print(json.dumps({"bench": "prompt_rows", "rows": PROMPT_ROWS, "threads": 2, "ms_per_layer": {
        f"{name}_{'fp32' if exact else 'int8'}": round(1e3 * statistics.median(s), 3)
        for (name, exact), s in prompt.items()}}))
    per_threads = {(name, t): [] for name in layouts for t in (1, 2)}  # type: dict[tuple[str, int], list[float]]
    for _ in range(max(10, args.iters // 8)):
        for (name, threads), samples in per_threads.items():
            torch.set_num_threads(threads)
            sample(run(model[name], layouts[name], 1), samples)
    megabytes = sum(w.numel() for w, _ in raw_model) / 1e6
    for (name, threads), samples in per_threads.items():
        seconds = statistics.median(samples)
        print(json.dumps({"bench": "one_row", "layout": name, "threads": threads, "layers": LAYERS,
                          "ms": round(1e3 * seconds, 2), "megabytes": round(megabytes, 1),
                          "gb_per_s": round(megabytes / 1e3 / seconds, 2)}))

    torch.set_num_threads(2)
    head = rq.quantize(torch.randn(49152, 576, generator=gen) * 0.05, rq.Q8_0)
    head_rows = {rows: [] for rows in (1, 2, 4, 5)}  # type: dict[int, list[float]]
    xh = torch.randn(5, 576, generator=gen)
    for _ in range(max(10, args.iters // 8)):
        for rows, samples in head_rows.items():
            sample(functools.partial(oq.quant_linear, xh[:rows], head, oq.Q8_0, checked=True), samples)
    for rows, samples in head_rows.items():
        seconds = statistics.median(samples)
        print(json.dumps({"bench": "lm_head", "format": "Q8_0", "rows": rows, "threads": 2,
                          "ms": round(1e3 * seconds, 3), "gb_per_s": round(head.numel() / 1e9 / seconds, 2)}))
    if native_bf16() and bf16_packing_available():
        packed = pack_screen_weight(oq.dequantize(head, oq.Q8_0, 576))
        xs64 = torch.randn(64, 576, generator=gen)
        both = {(kind, rows): [] for kind in ("int8", "bf16") for rows in (8, 32, 64)}  # type: dict[tuple[str, int], list[float]]
        for _ in range(max(10, args.iters // 16)):
            for (kind, rows), samples in both.items():
                if kind == "int8":
                    sample(functools.partial(oq.quant_linear, xs64[:rows], head, oq.Q8_0, checked=True), samples)
                else:
                    sample(functools.partial(screen_logits, xs64[:rows], packed), samples)
        print(json.dumps({"bench": "lm_head_bf16_screen", "format": "Q8_0", "threads": 2, "ms": {
            f"{kind}_{rows}": round(1e3 * statistics.median(s), 2) for (kind, rows), s in both.items()}}))
    if oq.amx_bf16():
        amx_rows(layer["r8"], gen, max(5, args.iters // 30))
    amx_int8_rows(gen, max(20, args.iters // 3))
    format_rows(args.formats.split(","), rows_list, args.n, args.k, args.format_rounds)


def format_rows(formats: list[str], rows_list: list[int], n: int, k: int, rounds: int = 5, calls: int = 4) -> None:
    """Per r8 format and row count: the best of `rounds` runs of `calls` passes through one cached
    [n, k] weight on one thread, in GMAC/s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for name in formats:
            gen = torch.Generator().manual_seed(0)
            base = oq.FORMATS[name]
            w, fmt = oq.interleave(rq.quantize(torch.randn(n, k, generator=gen) * 0.05, base.type_id), base)
            for rows in rows_list:
                x, out = torch.randn(rows, k, generator=gen), torch.empty(rows, n)
                oq.quant_linear(x, w, fmt, per_row=True, checked=True, out=out)  # warm the cache and the kernel
                best = float("inf")
                for _ in range(rounds):
                    start = time.thread_time()
                    for _ in range(calls):
                        oq.quant_linear(x, w, fmt, per_row=True, checked=True, out=out)
                    best = min(best, time.thread_time() - start)
                print(json.dumps({"bench": "format_rows", "format": name, "layout": fmt.name, "rows": rows, "n": n,
                                  "k": k, "threads": 1, "gmac_s": round(rows * n * k * calls / best / 1e9, 2)}),
                      flush=True)
    finally:
        torch.set_num_threads(threads)


def amx_int8_rows(gen: torch.Generator, iters: int) -> None:
    """SmolLM2's MLP-shaped pair (576 -> 1536, 1536 -> 576) in Q4_1r8 and Q8_0r8 per int8 row count,
    AMX-INT8 tiles against the VNNI kernel (the `PAGEDSERVE_INT8_AMX` switch, read at every call),
    interleaved."""
    from ops.build import cpu_ops

    if not cpu_ops().int8_amx_available():
        return
    shapes = [(1536, 576), (576, 1536)]
    xs = {k: torch.randn(128, k, generator=gen) for _, k in shapes}
    modes = {"amx": "all", "vnni": "0"}
    previous = os.environ.get("PAGEDSERVE_INT8_AMX")
    for base in (oq.Q4_1, oq.Q8_0):
        fmt = oq.INTERLEAVED[base]
        weights = [(oq.interleave(rq.quantize(torch.randn(n, k, generator=gen) * 0.05, base.type_id), base)[0], k)
                   for n, k in shapes]
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (1, 4, 16, 32, 64, 128):
                times = {name: [] for name in modes}  # type: dict[str, list[float]]
                for _ in range(iters):
                    for name, mode in modes.items():
                        os.environ["PAGEDSERVE_INT8_AMX"] = mode
                        start = time.perf_counter()
                        for w, k in weights:
                            oq.quant_linear(xs[k][:rows], w, fmt, checked=True)
                        times[name].append(time.perf_counter() - start)
                ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
                print(json.dumps({"bench": "amx_int8", "format": fmt.name, "shapes": "576x1536+1536x576",
                                  "rows": rows, "threads": threads, "ms": {n: round(v, 4) for n, v in ms.items()},
                                  "vnni_over_amx": round(ms["vnni"] / ms["amx"], 3)}), flush=True)
    if previous is None:
        os.environ.pop("PAGEDSERVE_INT8_AMX", None)
    else:
        os.environ["PAGEDSERVE_INT8_AMX"] = previous


def amx_rows(weights: list[tuple[torch.Tensor, int]], gen: torch.Generator, iters: int) -> None:
    """One layer's four r8 linears per implementation and row count, interleaved, 2 threads."""
    cached = [(oq.dequantize(w, oq.Q4_1R8, k).bfloat16(), k) for w, k in weights]
    impls: dict[str, Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], object]] = {
        "int8": lambda x, w, k, wb: oq.quant_linear(x, w, oq.Q4_1R8, checked=True),
        "amx_bf16": lambda x, w, k, wb: oq.quant_linear(x, w, oq.Q4_1R8, bf16=True),
        "onednn_bf16_cached": lambda x, w, k, wb: torch.nn.functional.linear(x.bfloat16(), wb).float(),
        "fp32_exact": lambda x, w, k, wb: oq.quant_linear(x, w, oq.Q4_1R8, checked=True, exact_rows=x.shape[0]),
    }
    for rows in (8, 32, 128, 1024):
        xs = {k: torch.randn(rows, k, generator=gen) for _, k in SHAPES}
        times = {name: [] for name in impls}  # type: dict[str, list[float]]
        for _ in range(iters if rows < 1024 else max(3, iters // 4)):
            for name, impl in impls.items():
                start = time.perf_counter()
                for (w, k), (wb, _) in zip(weights, cached, strict=True):
                    impl(xs[k], w, k, wb)
                times[name].append(time.perf_counter() - start)
        macs = rows * sum(n * k for n, k in SHAPES)
        print(json.dumps({"bench": "amx_bf16", "rows": rows, "threads": 2,
                          "ms_per_layer": {name: round(1e3 * statistics.median(t), 3) for name, t in times.items()},
                          "amx_gmac_s": round(macs / statistics.median(times["amx_bf16"]) / 1e9, 1)}))


def _laid_out(qweight: torch.Tensor, fmt: oq.QuantFormat) -> torch.Tensor:
    """A Q4_1 weight in `fmt`'s layout (GGUF order, or the kernel's eight-row one)."""
    return qweight if fmt == oq.Q4_1 else oq.interleave(qweight, oq.Q4_1)[0]

if __name__ == "__main__":
    main()
