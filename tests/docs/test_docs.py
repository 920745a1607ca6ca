"""The README and docs/ stay navigable: every relative link resolves to a file (and its #anchor
to a heading there, by GitHub's slug rule), every `benchmarks/...` and `scripts/...` path they
name exists, every flag their commands pass to a benchmark script or to `pagedserve <command>` is
one it defines, benchmarks/README.md lists every script, the plotted figures are the page's, and
docs/flags.md is what scripts/flags_page.py generates from the argparse definitions. Reads files
and builds parsers only: no network, no server, no model."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
SCRIPT_PATH = re.compile(r"(?<![\w./-])((?:benchmarks|scripts)/[\w./-]+\.(?:py|sh))")
BENCH_FOLDERS = ("engine", "helpers", "investigations", "kernels", "ladder", "peer", "quality", "serving")
BENCH_PATH = re.compile(rf"(?<![\w./-])(?:benchmarks/)?((?:{'|'.join(BENCH_FOLDERS)})/\w+\.(?:py|sh))")
BENCH_README = ROOT / "benchmarks" / "README.md"


def _prose(text: str) -> str:
    """The text outside fenced code blocks (links in code are not links)."""
    keep, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            keep.append(line)
    return "\n".join(keep)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link targets and markup dropped, lower case, punctuation
    other than '-' and '_' removed, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = text.lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a markdown page (duplicates numbered as GitHub numbers them)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose(page.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    """Relative link targets of a page (http(s) and mailto links left out)."""
    found = []
    for m in LINK.finditer(_prose(page.read_text())):
        target = m.group(1) or m.group(2)
        if not re.match(r"[a-z]+:", target):
            found.append(target)
    return found


def test_pages_exist() -> None:
    assert (ROOT / "README.md").is_file()
    assert len(PAGES) > 5, "docs/ pages missing"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_named_scripts_exist(page: Path) -> None:
    missing = sorted({p for p in SCRIPT_PATH.findall(page.read_text()) if not (ROOT / p).is_file()})
    assert not missing, f"{page.relative_to(ROOT)} names scripts that do not exist: {missing}"


def test_benchmarks_readme_lists_every_script() -> None:
    text = BENCH_README.read_text()
    named = set(BENCH_PATH.findall(text))
    missing = sorted({str(p.relative_to(ROOT / "benchmarks")) for p in (ROOT / "benchmarks").rglob("*")
                      if p.suffix in (".py", ".sh") and p.name != "__init__.py"} - named)
    assert not missing, f"benchmarks/README.md does not list: {missing}"
    gone = sorted(p for p in named if not (ROOT / "benchmarks" / p).is_file())
    assert not gone, f"benchmarks/README.md lists scripts that do not exist: {gone}"


def _script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flags_page_is_current() -> None:
    assert (ROOT / "docs" / "flags.md").read_text() == _script("flags_page").render(), (
        "docs/flags.md is stale: run .venv/bin/python scripts/flags_page.py")


def test_plotted_figures_are_the_pages() -> None:
    """Every value scripts/plots.py charts (from docs/results/*.jsonl) is a figure docs/performance.md
    states, the KV chart's tokens per GiB are the ones docs/cpu-fast-path.md states, and each chart is on
    the page."""
    plots = _script("plots")
    page = (ROOT / "docs" / "performance.md").read_text()
    peers, (modes, spec) = plots.peer_rows(), plots.spec_rows()
    assert len(peers) >= 5 and len(spec) >= 5 and len(modes) >= 2, (peers, modes, spec)
    values = {v for _, runs in peers for v in runs}
    values |= {v for _, speedups in spec for v in speedups.values()}

    def stated(v: float) -> bool:
        return any(re.search(rf"(?<![\d.]){re.escape(text)}(?![\d])", page)
                   for text in {f"{v:.2f}", f"{v:.3f}", str(v)})

    absent = sorted(v for v in values if not stated(v))
    assert not absent, f"plotted values not on docs/performance.md: {absent}"
    fast_path = (ROOT / "docs" / "cpu-fast-path.md").read_text()
    tokens = plots.kv_tokens_per_gib()
    assert all(f"{tokens[d]:,}" in fast_path for d in ("float32", "bfloat16", "int8")), tokens
    for png in ("peers.png", "speculative.png", "kv_tokens_per_gib.png"):
        assert f"](plots/{png})" in page and (ROOT / "docs" / "plots" / png).is_file(), png


def test_plots_take_a_benchmark_runs_json_lines(tmp_path: Path) -> None:
    """`plots.py --add` keeps a peer run's throughput ratio (not its latency ratios, not the
    per-system lines) and a spec_bench run's per-mode speed-ups, under the given label."""
    plots = _script("plots")
    peer_run = tmp_path / "peer.jsonl"
    peer_run.write_text("\n".join(json.dumps(r) for r in (
        {"part": "setup", "cpus": 2},
        {"part": "offline", "system": "pagedserve", "tok_s": 400.0},
        {"part": "offline", "ratio": "pagedserve/vllm", "tok_s_ratio": 0.95, "pagedserve_wins": False},
        {"part": "served", "ratio": "pagedserve/vllm", "ttft_p50_ratio": 0.5})))
    target, count = plots.add_run(peer_run, "offline, test machine", results=tmp_path)
    assert (target.name, count) == ("peers.jsonl", 1)
    assert plots.peer_rows(target) == [("offline, test machine", [0.95])]
    spec_run = tmp_path / "spec.jsonl"
    spec_run.write_text(json.dumps({"bench": "batch", "plain_tok_s": 10.0, "ngram_k4": {"speedup": 1.3},
                                    "suffix_k4": {"speedup": 1.5}}))
    target, count = plots.add_run(spec_run, "batch, test machine", results=tmp_path)
    assert plots.spec_rows(target) == (["ngram_k4", "suffix_k4"],
                                       [("batch, test machine", {"ngram_k4": 1.3, "suffix_k4": 1.5})])


def _code(text: str) -> list[str]:
    """Inline code spans and fenced blocks: where the pages write commands."""
    fenced = re.findall(r"```\w*\n(.*?)```", text, re.S)
    return fenced + re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))


def _flags(args: str) -> list[str]:
    """The flags of a command line, leaving out quoted arguments (flags passed on to another command)."""
    return re.findall(r"(?<![\w-])--?[a-z][a-z0-9-]*", re.sub(r"'[^']*'|\"[^\"]*\"", "", args))


BENCH_CMD = re.compile(rf"(?<![\w./-])((?:benchmarks/)?(?:{'|'.join(BENCH_FOLDERS)})/\w+\.py)([^`\n|;&)]*)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_benchmark_flags_exist(page: Path) -> None:
    """Every flag a page passes to a benchmark script is one that script (or a benchmarks module
    it imports) defines."""
    unknown = []
    for span in _code(page.read_text()):
        for m in BENCH_CMD.finditer(span):
            script = ROOT / "benchmarks" / m.group(1).removeprefix("benchmarks/")
            if not script.is_file():
                continue  # test_named_scripts_exist reports it
            source = script.read_text()
            for module in re.findall(r"from benchmarks\.([\w.]+) import", source):
                imported = ROOT / "benchmarks" / (module.replace(".", "/") + ".py")
                source += imported.read_text() if imported.is_file() else ""
            unknown += [f"{m.group(1)} {flag}" for flag in _flags(m.group(2))
                        if f'"{flag}"' not in source and f"'{flag}'" not in source]
    assert not unknown, f"{page.relative_to(ROOT)}: flags no script defines: {sorted(set(unknown))}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_pagedserve_flags_exist(page: Path) -> None:
    """Every flag a page passes to `pagedserve <command>` is one that command's parser takes."""
    flags_page = _script("flags_page")
    commands = flags_page.commands()
    known = {name: {o for a in flags_page.command_parser(name)._actions for o in a.option_strings} for name in commands}
    call = re.compile(rf"pagedserve\s+({'|'.join(map(re.escape, commands))})\b([^`\n|]*)")
    unknown = [f"pagedserve {m.group(1)} {flag}" for span in _code(page.read_text()) for m in call.finditer(span)
               for flag in _flags(m.group(2)) if flag not in known[m.group(1)]]
    assert not unknown, f"{page.relative_to(ROOT)}: flags the command does not take: {sorted(set(unknown))}"


def test_documented_python_scripts_answer_help() -> None:
    """Every Python script a page names (benchmarks/, scripts/) that parses arguments runs with
    `--help` and exits 0: a documented command at least starts (imports resolve, the parser builds).
    Scripts without a parser would run their work, so they are only checked to exist elsewhere."""
    named = {m.group(1) for page in PAGES for m in SCRIPT_PATH.finditer(page.read_text())}
    named |= {f"benchmarks/{m.group(1)}" for page in PAGES for m in BENCH_PATH.finditer(page.read_text())}
    scripts = sorted(p for p in named if p.endswith(".py") and (ROOT / p).is_file()
                     and re.search(r"argparse|parse_args", (ROOT / p).read_text()))
    assert len(scripts) >= 10, scripts
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("help_runner.py")), *scripts], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    results = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [r["script"] for r in results] == scripts, run.stderr[-2000:]
    failed = [f"{r['script']}: exit {r['code']}: {r['tail']}" for r in results if r["code"] != 0]
    assert not failed, "\n".join(failed)


def test_readme_claims_only_supported_models_and_formats() -> None:
    """The README's model types are ones ModelSpec accepts and its GGUF formats are in the format
    table, each run as the README says (packed or dequantized at load)."""
    from engine.model.spec import SUPPORTED_MODEL_TYPES
    from ops.reference import formats

    text = " ".join((ROOT / "README.md").read_text().split())  # line breaks fall anywhere
    types_line = re.search(r"\*\*Model types\*\*.*?from a Hugging Face", text, re.S)
    assert types_line, "README.md: the 'Model types' bullet is gone"
    named = re.findall(r"`(\w+)`", types_line.group(0).split(":", 1)[1])
    assert named and set(named) <= set(SUPPORTED_MODEL_TYPES), (named, SUPPORTED_MODEL_TYPES)
    gguf = re.search(r"\*\*GGUF files\*\*.*?refused by name", text, re.S)
    assert gguf, "README.md: the 'GGUF files' bullet is gone"
    packed, rest = gguf.group(0).split("stay packed", 1)
    dequantized = rest.split("dequantized to fp32 at load", 1)[0]
    assert re.findall(r"\b(Q\d_\w+|IQ4_\w+)\b", packed), "README.md names no packed format"
    for name in re.findall(r"\b(Q\d_\w+|IQ4_\w+)\b", packed):
        assert formats.BY_NAME[name].runs == formats.PACKED, name
    for name in re.findall(r"\b(Q\d_\w+|IQ4_\w+)\b", dequantized.replace("Q2_K–Q6_K", "Q2_K Q6_K")):
        assert formats.BY_NAME[name].runs == formats.DEQUANTIZED, name


def test_readme_stays_short() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 260, f"README.md has {lines} lines; the details belong in docs/"


def test_slug_rule() -> None:
    assert slug("`up`'s default: an int8 KV cache on the Q4_1 file") == "ups-default-an-int8-kv-cache-on-the-q4_1-file"
    assert slug("Against llama.cpp on the same Q4_1 file") == "against-llamacpp-on-the-same-q4_1-file"
    assert slug("Deterministic mode (the CPU default)") == "deterministic-mode-the-cpu-default"
