"""Request traces for the simulator: synthetic ShareGPT-like and Alpaca-like workloads, and JSONL
trace files.

The synthetic length distributions are log-normal fits whose means are the figures the vLLM paper
(Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention",
SOSP 2023, Fig. 11 and Section 6.1) reports for the two datasets it evaluates on:

- ShareGPT (real ChatGPT conversations): mean input 161.31, mean output 337.99 tokens, both
  long-tailed, far longer than Alpaca's.
- Alpaca (GPT-3.5 self-instruct): mean input 19.31, mean output 58.45 tokens, short and narrow.

The spreads (log-normal sigma) are our choice, read off the shapes of the paper's histograms, not
fitted to the datasets themselves. A sample whose prompt + output exceeds ``max_model_len`` is
drawn again (the paper likewise drops over-long ShareGPT conversations), which lowers the means a
little; the simulator reports the means it actually used. Arrivals are a Poisson process.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np


class TraceError(ValueError):
    """A trace that cannot be replayed; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Request:
    """One traced request: `n` parallel samples or a beam of `beam_width`, optionally behind a
    shared system prompt (`prefix_len` leading prompt tokens identical for one `prefix_id`)."""

    request_id: int
    arrival: float
    prompt_len: int
    output_len: int
    n: int = 1
    beam_width: int = 1
    prefix_id: str | None = None
    prefix_len: int = 0

    def __post_init__(self) -> None:
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError("prompt_len and output_len must be >= 1")
        if self.n < 1 or self.beam_width < 1 or (self.n > 1 and self.beam_width > 1):
            raise ValueError("n and beam_width must be >= 1, and at most one of them > 1")
        if self.arrival < 0 or not math.isfinite(self.arrival):
            raise ValueError("arrival must be a finite time >= 0")
        has_prefix = self.prefix_id is not None
        if not 0 <= self.prefix_len <= self.prompt_len or (self.prefix_len > 0) != has_prefix:
            raise ValueError("prefix_id and prefix_len go together, with 0 < prefix_len <= prompt_len")

    @property
    def width(self) -> int:
        """Sequences the request runs at once."""
        return max(self.n, self.beam_width)

    @property
    def total_len(self) -> int:
        return self.prompt_len + self.output_len


@dataclass(frozen=True, slots=True)
class LengthModel:
    """Log-normal prompt and output lengths with the given means."""

    name: str
    mean_input: float
    sigma_input: float
    mean_output: float
    sigma_output: float


SHAREGPT = LengthModel("sharegpt", mean_input=161.31, sigma_input=1.0, mean_output=337.99, sigma_output=0.9)
ALPACA = LengthModel("alpaca", mean_input=19.31, sigma_input=0.6, mean_output=58.45, sigma_output=0.8)
LENGTH_MODELS = {model.name: model for model in (SHAREGPT, ALPACA)}


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, size: int) -> np.ndarray:
    mu = math.log(mean) - sigma**2 / 2  # so that E[X] = mean
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, size))).astype(np.int64)


def synthetic_trace(
    model: LengthModel, num_requests: int, *, rate: float = math.inf, seed: int = 0, max_model_len: int = 2048
) -> list[Request]:
    """`num_requests` requests with Poisson arrivals at `rate` per second (inf: all at t=0)."""
    rng = np.random.default_rng(seed)
    prompts = np.empty(0, dtype=np.int64)
    outputs = np.empty(0, dtype=np.int64)
    while len(prompts) < num_requests:
        batch = max(64, 2 * (num_requests - len(prompts)))
        p = _lognormal(rng, model.mean_input, model.sigma_input, batch)
        o = _lognormal(rng, model.mean_output, model.sigma_output, batch)
        keep = p + o <= max_model_len
        prompts, outputs = np.concatenate([prompts, p[keep]]), np.concatenate([outputs, o[keep]])
    gaps = rng.exponential(1.0 / rate, num_requests) if math.isfinite(rate) else np.zeros(num_requests)
    arrivals = np.cumsum(gaps) - (gaps[0] if num_requests else 0.0)
    return [
        Request(i, float(arrivals[i]), int(prompts[i]), int(outputs[i])) for i in range(num_requests)
    ]


def with_sharing(
    trace: list[Request], *, n: int = 1, beam_width: int = 1, num_prefixes: int = 0, prefix_len: int = 0,
    seed: int = 0,
) -> list[Request]:
    """The same trace with `n` samples or a beam per request, and/or one of `num_prefixes` shared
    system prompts of `prefix_len` tokens put in front of every prompt."""
    rng = np.random.default_rng(seed)
    out: list[Request] = []
    for req in trace:
        prefix: dict[str, Any] = {}
        if num_prefixes and prefix_len:
            prefix = {"prefix_id": f"system-{rng.integers(num_prefixes)}", "prefix_len": prefix_len,
                      "prompt_len": req.prompt_len + prefix_len}
        out.append(replace(req, n=n, beam_width=beam_width, **prefix))
    return out


_FIELDS = {"arrival": float, "prompt_len": int, "output_len": int, "n": int, "beam_width": int,
           "prefix_id": str, "prefix_len": int}


def load_jsonl(path: Path) -> list[Request]:
    """Read a JSONL trace: one object per line with `arrival` (s), `prompt_len`, `output_len` and
    optional `n`, `beam_width`, `prefix_id`, `prefix_len`. Blank and `#` lines are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from None
    requests: list[Request] = []
    for lineno, line in enumerate(lines, start=1):
        if line.strip() and not line.lstrip().startswith("#"):
            requests.append(_parse_line(line, len(requests), f"{path}:{lineno}"))
    if not requests:
        raise TraceError(f"{path}: the trace holds no requests")
    return sorted(requests, key=lambda r: r.arrival)


def _parse_line(line: str, request_id: int, where: str) -> Request:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(_FIELDS) - {"request_id"})
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {', '.join(unknown)}")
    for name in ("arrival", "prompt_len", "output_len"):
        if name not in obj:
            raise TraceError(f"{where}: missing field {name!r}")
    fields: dict[str, Any] = {}
    for name, kind in _FIELDS.items():
        value = obj.get(name)
        if value is None:
            continue
        bad_int = kind is int and (isinstance(value, bool) or not isinstance(value, int))
        if bad_int or (kind is float and not isinstance(value, (int, float))):
            raise TraceError(f"{where}: field {name!r} must be {'an integer' if kind is int else 'a number'}")
        fields[name] = kind(value)
    try:
        return Request(request_id, **fields)
    except ValueError as exc:
        raise TraceError(f"{where}: {exc}") from None


def save_jsonl(trace: list[Request], path: Path) -> None:
    """Write a trace in the format `load_jsonl` reads."""
    with Path(path).open("w") as f:
        for req in trace:
            row = {k: v for k, v in asdict(req).items() if k in _FIELDS and v is not None}
            f.write(json.dumps(row) + "\n")
