"""Traces: the synthetic workloads' shapes, JSONL round trips, and errors that name the line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pagedserve.cli import main
from pagedserve.sim.traces import (
    ALPACA,
    SHAREGPT,
    Request,
    TraceError,
    load_jsonl,
    save_jsonl,
    synthetic_trace,
    with_sharing,
)


@pytest.mark.parametrize(("model", "mean_in", "mean_out"), [(SHAREGPT, 161.31, 337.99), (ALPACA, 19.31, 58.45)])
def test_synthetic_means_follow_the_paper(model, mean_in: float, mean_out: float) -> None:
    trace = synthetic_trace(model, 4000, seed=1, max_model_len=2048)
    prompts = np.array([r.prompt_len for r in trace])
    outputs = np.array([r.output_len for r in trace])
    # dropping prompt + output > 2048 trims the long tail a little
    assert 0.85 * mean_in <= prompts.mean() <= 1.05 * mean_in
    assert 0.85 * mean_out <= outputs.mean() <= 1.05 * mean_out
    assert max(r.total_len for r in trace) <= 2048 and min(prompts) >= 1
    assert np.percentile(outputs, 99) > 3 * np.median(outputs)  # long-tailed, as the paper's histograms


def test_seeded_and_poisson() -> None:
    a = synthetic_trace(SHAREGPT, 2000, rate=10.0, seed=7)
    assert a == synthetic_trace(SHAREGPT, 2000, rate=10.0, seed=7)
    assert a != synthetic_trace(SHAREGPT, 2000, rate=10.0, seed=8)
    gaps = np.diff([r.arrival for r in a])
    assert a[0].arrival == 0.0 and (gaps >= 0).all()
    assert abs(gaps.mean() - 0.1) < 0.01
    assert all(r.arrival == 0 for r in synthetic_trace(ALPACA, 10, rate=math.inf))


def test_with_sharing_prepends_a_system_prompt() -> None:
    trace = synthetic_trace(ALPACA, 50, seed=0)
    shaped = with_sharing(trace, beam_width=4, num_prefixes=2, prefix_len=100)
    assert {r.prefix_id for r in shaped} <= {"system-0", "system-1"}
    assert all(s.prompt_len == r.prompt_len + 100 and s.beam_width == 4 for s, r in zip(shaped, trace, strict=True))


def test_jsonl_round_trip(tmp_path: Path) -> None:
    trace = with_sharing(synthetic_trace(SHAREGPT, 20, rate=5.0), n=3, num_prefixes=1, prefix_len=8)
    path = tmp_path / "t.jsonl"
    save_jsonl(trace, path)
    assert load_jsonl(path) == trace


@pytest.mark.parametrize(("line", "message"), [
    ('{"arrival": 0, "prompt_len": 3', "not valid JSON"),
    ("[1, 2, 3]", "expected a JSON object"),
    ('{"arrival": 0, "prompt_len": 3}', "missing field 'output_len'"),
    ('{"arrival": 0, "prompt_len": -3, "output_len": 2}', "prompt_len and output_len must be >= 1"),
    ('{"arrival": 0, "prompt_len": "many", "output_len": 2}', "'prompt_len' must be an integer"),
    ('{"arrival": 0, "prompt_len": 3, "output_len": 2, "colour": 1}', "unknown field(s) colour"),
    ('{"arrival": 0, "prompt_len": 3, "output_len": 2, "n": 2, "beam_width": 2}', "at most one of them"),
    ('{"arrival": 0, "prompt_len": 3, "output_len": 2, "prefix_id": "a", "prefix_len": 9}', "prefix_len"),
])
def test_malformed_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('# a comment\n{"arrival": 0.5, "prompt_len": 10, "output_len": 5}\n\n' + line + "\n")
    with pytest.raises(TraceError) as info:
        load_jsonl(path)
    assert f"{path}:4:" in str(info.value) and message in str(info.value)


def test_empty_and_missing_files(tmp_path: Path) -> None:
    (tmp_path / "empty.jsonl").write_text("\n# nothing\n")
    with pytest.raises(TraceError, match="no requests"):
        load_jsonl(tmp_path / "empty.jsonl")
    with pytest.raises(TraceError, match="cannot read"):
        load_jsonl(tmp_path / "absent.jsonl")


def test_simulate_cli_names_the_bad_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"arrival": 0, "prompt_len": 4, "output_len": 4}) + "\n{oops\n")
    assert main(["simulate", "--trace", str(path), "--plots", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2:" in err and "Traceback" not in err


def test_request_validation() -> None:
    with pytest.raises(ValueError):
        Request(0, arrival=-1.0, prompt_len=1, output_len=1)
    assert Request(0, 0.0, 5, 7, n=3).width == 3 and Request(0, 0.0, 5, 7).total_len == 12
