"""Charts for docs/performance.md from the benchmarks' JSON lines: `.venv/bin/python scripts/plots.py`.

The measured charts read `docs/results/peers.jsonl` (the ratio lines `benchmarks/peer/peer_bench.py`
and the llama.cpp benches print: a `*_ratio` figure, pagedserve over the peer) and
`docs/results/speculative.jsonl` (the report lines of `benchmarks/engine/spec_bench.py`: per mode a
`speedup`), each line stamped with the `label` the chart shows; lines with the same label are runs
of one workload. `--add RUN.jsonl --label TEXT` appends a fresh run's ratio or report lines to the
right file (then the page's figure should follow: `tests/docs/test_docs.py` checks every plotted
value appears on docs/performance.md, so a chart cannot drift from the page it illustrates). The KV
chart is computed from the engine's own size formula (`engine.model.spec.kv_dtype_bytes_per_token`)
for SmolLM2's shape. The simulator's utilization chart is `pagedserve simulate`'s own.

    .venv/bin/python benchmarks/peer/peer_bench.py --only offline --json-out /tmp/run.jsonl
    .venv/bin/python scripts/plots.py --add /tmp/run.jsonl --label "offline trace, ... (machine, date)"
    .venv/bin/python scripts/plots.py [--out docs/plots]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PEERS_FILE = RESULTS / "peers.jsonl"
SPEC_FILE = RESULTS / "speculative.jsonl"
PEERS_TITLE = "pagedserve against vLLM and llama.cpp, same run, same 2-core CPU"
SPEC_TITLE = "Speculative decoding: speed-up over plain decoding (Xeon, stop 34)"
# Latency ratios (below 1 is better) are not drawn on the throughput chart.
_LATENCY = ("ttft", "tpot", "itl", "latency", "e2e")


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file (blank lines skipped)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def throughput_ratio(record: dict[str, Any]) -> float | None:
    """The record's pagedserve/peer throughput ratio, or None for a line that carries none."""
    for key, value in record.items():
        if key.endswith("_ratio") and not any(tag in key for tag in _LATENCY) and isinstance(value, (int, float)):
            return float(value)
    return None


def spec_speedups(record: dict[str, Any]) -> dict[str, float]:
    """Per speculative mode the speed-up over plain decoding of one spec_bench report line."""
    return {mode: float(v["speedup"]) for mode, v in record.items() if isinstance(v, dict) and "speedup" in v}


def grouped(records: list[dict[str, Any]], value: Any) -> list[tuple[str, list[Any]]]:
    """(label, [value of each run]) in first-seen label order, lines without a value dropped."""
    rows: dict[str, list[Any]] = {}
    for record in records:
        v = value(record)
        if v is not None and v != {}:
            rows.setdefault(str(record.get("label", record.get("part", record.get("bench", "?")))), []).append(v)
    return list(rows.items())


def peer_rows(path: Path = PEERS_FILE) -> list[tuple[str, list[float]]]:
    return grouped(read_lines(path), throughput_ratio)


def spec_rows(path: Path = SPEC_FILE) -> tuple[list[str], list[tuple[str, dict[str, float]]]]:
    """Modes (columns) and per label the last run's speed-up per mode."""
    rows = [(label, runs[-1]) for label, runs in grouped(read_lines(path), spec_speedups)]
    modes = list(dict.fromkeys(m for _, speedups in rows for m in speedups))
    return modes, rows


def add_run(run: Path, label: str, results: Path = RESULTS) -> tuple[Path, int]:
    """Append a benchmark run's ratio lines (peers) or report lines (speculative) under `label`."""
    records = read_lines(run)
    peers = [r for r in records if throughput_ratio(r) is not None]
    spec = [r for r in records if spec_speedups(r)]
    target, keep = (results / PEERS_FILE.name, peers) if peers else (results / SPEC_FILE.name, spec)
    if not keep:
        raise SystemExit(f"{run}: no ratio lines (peer benches) or report lines (spec_bench) to add")
    with target.open("a") as f:
        for record in keep:
            f.write(json.dumps({"label": label, **{k: v for k, v in record.items() if k != "label"}}) + "\n")
    return target, len(keep)


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
    rows = peer_rows()
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for i, (_, v) in enumerate(rows):
        ax.barh(i, max(v), color="#4c72b0", alpha=0.35)
        ax.plot(v, [i] * len(v), "o", color="#1f3b73")
        ax.text(max(v) + 0.05, i, f"{min(v):.2f}–{max(v):.2f}x" if len(set(v)) > 1 else f"{v[0]:.2f}x",
                va="center", fontsize=8)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("pagedserve / peer throughput (each dot one run)")
    ax.set_title(PEERS_TITLE, fontsize=10)
    ax.set_xlim(0, 6.2)
    fig.tight_layout()
    path = out / "peers.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _spec(plt: Any, out: Path) -> Path:
    methods, rows = spec_rows()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    width = 0.8 / len(methods)
    for m, method in enumerate(methods):
        xs = [i + (m - (len(methods) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, [speedups.get(method, 0.0) for _, speedups in rows], width, label=method.replace("_k", " K="))
    ax.axhline(1.0, color="black", lw=1)
    ax.set_xticks(range(len(rows)), [name for name, _ in rows], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("tok/s over plain decoding")
    ax.set_title(SPEC_TITLE, fontsize=10)
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
    parser.add_argument("--add", type=Path, metavar="RUN.jsonl", help="append a benchmark run's JSON lines first")
    parser.add_argument("--label", help="the chart's label for the --add run's workload")
    args = parser.parse_args(argv)
    if args.add:
        if not args.label:
            parser.error("--add needs --label")
        target, count = add_run(args.add, args.label)
        print(f"added {count} line(s) to {target}")
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
