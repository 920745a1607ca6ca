"""Charts for docs/performance.md: `.venv/bin/python scripts/plots.py` writes docs/plots/*.png.

The measured charts plot figures docs/performance.md states (same-run ratios from the commands in
each chart's `source`); `tests/docs/test_docs.py` checks that every value below appears on that
page, so a chart cannot drift from the page it illustrates. The KV chart is computed from the
engine's own size formula (`engine.model.spec.kv_dtype_bytes_per_token`) for SmolLM2's shape. The
simulator's utilization chart is `pagedserve simulate`'s own (docs/simulator_utilization.png).

    .venv/bin/python scripts/plots.py [--out docs/plots]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# Same-run ratios pagedserve / peer (above 1: pagedserve faster), per workload: each run's value.
PEERS: dict[str, Any] = {
    "title": "pagedserve against vLLM and llama.cpp, same run, same 2-core CPU",
    "source": "benchmarks/peer/peer_bench.py; benchmarks/kernels/quant_bench.py --parts engine --peer-python ...",
    "rows": [
        ("offline trace, Q4_1 + int8 KV vs vLLM bf16 (Xeon, stop 35)", ["1.222", "1.237", "1.243", "1.239", "1.224"]),
        ("offline trace, fp32 vs vLLM fp32 (EPYC, 2026-11-30)", ["1.14", "1.10", "1.14"]),
        ("2-layer model, engine overhead, fp32 vs vLLM fp32", ["1.80", "1.84"]),
        ("one stream, fp32 vs vLLM fp32", ["1.52", "1.82"]),
        ("served burst 96 x 128, fp32 vs vLLM fp32", ["1.13", "1.12"]),
        ("served, 32 concurrent, fp32 vs vLLM fp32", ["1.15", "1.16"]),
        ("one stream, Q4_1 GGUF vs llama.cpp (Xeon, stop 35)", ["1.46", "1.40"]),
        ("batch of 32, Q4_1 GGUF vs llama.cpp (Xeon, stop 35)", ["5.26", "5.46"]),
    ],
}

# Speculative decoding over plain decoding, stop 34 on the AVX-512/AMX Xeon.
SPEC: dict[str, Any] = {
    "title": "Speculative decoding: speed-up over plain decoding (Xeon, stop 34)",
    "source": "benchmarks/engine/spec_bench.py --rounds 2 --max-tokens 96 --k 4,8",
    "methods": ["ngram K=4", "ngram K=8", "suffix K=4", "suffix K=8"],
    "rows": [
        ("repeat a passage, new prompt", ["1.90", "2.66", "1.90", "2.41"]),
        ("edit code, new prompt", ["1.52", "1.92", "1.59", "1.78"]),
        ("long context, new prompt", ["2.10", "3.17", "2.20", "2.97"]),
        ("grounded, prompts cached", ["1.99", "2.99", "2.04", "2.67"]),
        ("passage asked again", ["2.16", "3.59", "2.26", "3.91"]),
        ("batch of 32, unrepetitive", ["1.11", "1.13", "1.14", "1.16"]),
    ],
}

# SmolLM2-135M's KV geometry (30 layers, 3 KV heads, head 64) and the engine's block size.
SMOLLM2_KV = {"layers": 30, "kv_heads": 3, "head_dim": 64, "block_size": 16}


def kv_tokens_per_gib() -> dict[str, int]:
    """Tokens 1 GiB of cache holds per cache dtype, whole blocks, by the engine's formula."""
    from engine.model.spec import KV_ELEMENT_BYTES, kv_dtype_bytes_per_token

    g = SMOLLM2_KV
    out = {}
    for dtype in KV_ELEMENT_BYTES:
        block = kv_dtype_bytes_per_token(g["layers"], g["kv_heads"], g["head_dim"], dtype) * g["block_size"]
        out[dtype] = (2**30 // block) * g["block_size"]
    return out


def _peers(plt: Any, out: Path) -> Path:
    rows = PEERS["rows"]
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for i, (_, values) in enumerate(rows):
        v = [float(x) for x in values]
        ax.barh(i, max(v), color="#4c72b0", alpha=0.35)
        ax.plot(v, [i] * len(v), "o", color="#1f3b73")
        ax.text(max(v) + 0.05, i, f"{min(v):.2f}–{max(v):.2f}x" if len(set(v)) > 1 else f"{v[0]:.2f}x",
                va="center", fontsize=8)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("pagedserve / peer throughput (each dot one run)")
    ax.set_title(PEERS["title"], fontsize=10)
    ax.set_xlim(0, 6.2)
    fig.tight_layout()
    path = out / "peers.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _spec(plt: Any, out: Path) -> Path:
    rows, methods = SPEC["rows"], SPEC["methods"]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(methods)
    for m, method in enumerate(methods):
        xs = [i + (m - (len(methods) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [float(values[m]) for _, values in rows], width, label=method)
    ax.axhline(1.0, color="black", lw=1)
    ax.set_xticks(range(len(rows)), [name for name, _ in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("tok/s over plain decoding")
    ax.set_title(SPEC["title"], fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "speculative.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _kv(plt: Any, out: Path) -> Path:
    tokens = kv_tokens_per_gib()
    fig, ax = plt.subplots(figsize=(6, 3.6))
    names = list(tokens)
    ax.bar(names, [tokens[n] for n in names], color="#55a868")
    for i, n in enumerate(names):
        ax.text(i, tokens[n], f"{tokens[n]:,}", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("tokens in 1 GiB of KV cache")
    ax.set_title("KV tokens per GiB by cache dtype (SmolLM2-135M, block 16)", fontsize=10)
    fig.tight_layout()
    path = out / "kv_tokens_per_gib.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "plots")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    for draw in (_peers, _spec, _kv):
        print(f"wrote {draw(plt, args.out)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
