"""Time one `SparseMoE` block (random Qwen3-MoE proportions) per step size, and where its time goes.

Prints one JSON line per step size: the block's median milliseconds per step, and the split into
router (GEMM, softmax, top-k), grouping (sort, counts), expert GEMMs (gate_up, activation, down,
timed alone over the same rows) and the rest (gathers, scaling, index_add, the Python loop).
The engine-level decode benchmark needs the model families wired into the loader (not yet).

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/kernels/moe_bench.py --experts 32 --top-k 4 --hidden 1024 \
        --intermediate 768 --tokens 1 32 [--formats Q4_0 Q8_0 Q4_K]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from engine.model.moe import SparseMoE, group_by_expert
from engine.model.moe_spec import MoESpec
from ops.linear import fixed_linear
from ops.policy import FIXED_ORDER


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--formats", nargs="*", default=[],
                        help="also time the block's experts packed in these GGUF formats (PackedExperts) against "
                             "the fp32 Experts, one JSON line per step size")
    args = parser.parse_args()
    torch.manual_seed(0)
    spec = MoESpec(num_experts=args.experts, top_k=args.top_k, intermediate_size=args.intermediate, sparse_layers=(0,),
                   norm_topk_prob=True)
    moe = SparseMoE(spec, args.hidden).eval()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden)
        with torch.inference_mode():
            total = _median_ms(lambda: moe(x), args.repeats)  # noqa: B023
            weights, experts = moe.route(x)
            route = _median_ms(lambda: moe.route(x), args.repeats)  # noqa: B023
            group = _median_ms(lambda: group_by_expert(experts, weights, spec.num_experts),  # noqa: B023
                               args.repeats)
            ids, _, counts = group_by_expert(experts, weights, spec.num_experts)
            w13, w2 = moe.experts.fixed_weights()
            rows = [(e, x.index_select(0, ids[sum(counts[:e]):sum(counts[:e + 1])]))
                    for e, n in enumerate(counts) if n]

            def gemms() -> None:
                for e, xe in rows:  # noqa: B023
                    h = fixed_linear(xe, w13[e], 2 * spec.intermediate_size)  # noqa: B023
                    fixed_linear(moe.experts._activate(h, FIXED_ORDER), w2[e], args.hidden)  # noqa: B023

            gemm = _median_ms(gemms, args.repeats)
        weight_mb = len(rows) * 3 * spec.intermediate_size * args.hidden * 4 / 1e6
        print(json.dumps({
            "bench": "moe_block", "tokens": tokens, "experts": spec.num_experts, "top_k": spec.top_k,
            "hidden": args.hidden, "intermediate": spec.intermediate_size, "threads": torch.get_num_threads(),
            "active_experts": len(rows), "block_ms": round(total, 3), "router_ms": round(route, 3),
            "group_ms": round(group, 3), "expert_gemm_ms": round(gemm, 3),
            "rest_ms": round(total - route - group - gemm, 3),
            "expert_weight_gb_per_s": round(weight_mb / gemm, 1),
        }))
    if args.formats:
        _packed_experts(moe, args)


def _packed_experts(moe: SparseMoE, args: argparse.Namespace) -> None:
    """The grouped experts alone, fp32 (`Experts`, fixed_gemm) and packed per format, same routing."""
    from engine.model.packed_experts import PackedExperts, interleave_experts
    from ops.parallel import openmp_rows_for, set_openmp_rows
    from ops.quant import FORMATS
    from ops.reference import quant as ref

    gate_up, down = moe.experts.gate_up_proj.detach(), moe.experts.down_proj.detach()
    variants: dict[str, torch.nn.Module] = {"fp32": moe.experts}
    for name in args.formats:
        fmt = FORMATS[name]
        packed = [torch.stack([ref.quantize(w, fmt.type_id) for w in t]) for t in (gate_up, down)]
        variants[name] = PackedExperts(moe.spec, args.hidden, [interleave_experts(fmt, packed[0])],
                                       interleave_experts(fmt, packed[1]))
    for tokens in args.tokens:
        x = torch.randn(tokens, args.hidden)
        with torch.inference_mode():
            weights, experts = moe.route(x)
            grouped = group_by_expert(experts, weights, moe.spec.num_experts)
            ms = {}
            for name, module in variants.items():  # the thread split an engine sets for such a model
                set_openmp_rows(openmp_rows_for(quantized_weights=name != "fp32"))
                ms[name] = round(_median_ms(lambda m=module: m(x, *grouped), args.repeats), 3)  # noqa: B023
        print(json.dumps({"bench": "moe_experts", "tokens": tokens, "experts": moe.spec.num_experts,
                          "top_k": moe.spec.top_k, "hidden": args.hidden, "intermediate": moe.spec.intermediate_size,
                          "threads": torch.get_num_threads(), "experts_ms": ms}))


if __name__ == "__main__":
    main()
