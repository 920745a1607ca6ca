"""The simulator's outputs for people: a summary table and PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedserve.sim.metrics import PolicyResult

COLUMNS = (
    ("policy", 18), ("steps", 7), ("max seqs", 9), ("mean seqs", 10), ("util", 7), ("reserv", 7),
    ("internal", 9), ("external", 9), ("preempt", 8), ("CoW", 7), ("share", 7),
)


def format_table(results: Sequence[PolicyResult]) -> str:
    """One line per policy: steps, concurrency, utilization and waste breakdown, events."""
    header = "".join(name.rjust(width) if i else name.ljust(width) for i, (name, width) in enumerate(COLUMNS))
    lines = [header, "-" * len(header)]
    for r in results:
        cells = (
            r.name, str(r.steps), str(r.max_concurrency), f"{r.mean_concurrency:.1f}",
            f"{r.utilization:.1%}", f"{r.reservation_waste:.1%}", f"{r.internal_fragmentation:.1%}",
            f"{r.external_fragmentation:.1%}", str(r.preemptions), str(r.cow_copies), f"{r.sharing_saving:.1%}",
        )
        lines.append("".join(c.rjust(w) if i else c.ljust(w) for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS,
                                                                                                 strict=True))))
    return "\n".join(lines)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_utilization(results: Sequence[PolicyResult], path: Path, title: str) -> None:
    """Memory utilization (tokens / reserved) and running sequences over time, one line per policy."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for r in results:
        top.plot(r.series["step"], r.series["utilization"], label=r.name, linewidth=1.2)
        bottom.plot(r.series["step"], r.series["running"], label=r.name, linewidth=1.2)
    top.set_ylabel("utilization (token bytes / reserved)")
    top.set_ylim(0, 1.05)
    top.set_title(title)
    bottom.set_ylabel("running sequences")
    bottom.set_xlabel("step")
    top.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_block_sweep(results: Sequence[PolicyResult], path: Path, title: str) -> None:
    """Paged policies by block size: utilization and mean concurrency, contiguous as reference lines."""
    plt = _pyplot()
    paged = [r for r in results if r.kind == "paged" and r.sharing]
    baselines = [r for r in results if r.kind != "paged"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    sizes = [str(r.block_size) for r in paged]
    left.bar(sizes, [r.utilization for r in paged], color="tab:blue")
    right.bar(sizes, [r.mean_concurrency for r in paged], color="tab:green")
    for r, style in zip(baselines, ("--", ":"), strict=False):
        left.axhline(r.utilization, linestyle=style, color="tab:red", label=r.name)
        right.axhline(r.mean_concurrency, linestyle=style, color="tab:red", label=r.name)
    left.set(xlabel="block size (tokens)", ylabel="utilization", ylim=(0, 1.05))
    right.set(xlabel="block size (tokens)", ylabel="mean running sequences")
    left.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_breakdown(results: Sequence[PolicyResult], path: Path, title: str) -> None:
    """Stacked shares of the reserved memory: tokens, reservation, internal fragmentation."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4))
    names = [r.name for r in results]
    parts = (("token states", "utilization", "tab:green"), ("reservation", "reservation_waste", "tab:orange"),
             ("internal frag.", "internal_fragmentation", "tab:red"))
    bottom = [0.0] * len(results)
    for label, attr, color in parts:
        values = [getattr(r, attr) for r in results]
        ax.bar(names, values, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(ylabel="share of reserved KV memory", ylim=(0, 1.0), title=title)
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
