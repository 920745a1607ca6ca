"""Typed field readers for request validation; each raises OpenAIError(400) naming the param."""

from __future__ import annotations

import math
from typing import Any

from gateway.api.endpoint import Endpoint
from gateway.errors import bad_request

_UNSUPPORTED_PRESENT = ("functions", "function_call", "audio", "prediction")
MAX_ID_DIGITS = 20  # a token id written as a string (logit_bias keys): 2^64 has 20 digits


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def opt_int(body: dict[str, Any], name: str, lo: int, hi: int, prefix: str = "") -> int | None:
    """An optional integer in [lo, hi]; None when absent or null."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not _is_int(value):
        raise bad_request(f"'{prefix}{name}' must be an integer", prefix + name, "invalid_type")
    if not lo <= value <= hi:
        raise bad_request(f"'{prefix}{name}' must be between {lo} and {hi}, got {value}", prefix + name)
    return int(value)


def as_int(body: dict[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = opt_int(body, name, lo, hi)
    return default if value is None else value


def as_float(body: dict[str, Any], name: str, default: float, lo: float, hi: float,
             open_low: bool = False) -> float:
    """A number in [lo, hi] (or (lo, hi] with open_low); the default when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number", name, "invalid_type")
    if value > hi or value < lo or (open_low and value == lo):
        bounds = f"({lo}, {hi}]" if open_low else f"[{lo}, {hi}]"
        raise bad_request(f"'{name}' must be in {bounds}, got {value}", name)
    return float(value)


def as_bool(body: dict[str, Any], name: str, default: bool, prefix: str = "") -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{prefix}{name}' must be a boolean", prefix + name, "invalid_type")
    return value


def reject_unsupported(body: dict[str, Any], kind: Endpoint) -> None:
    for name in _UNSUPPORTED_PRESENT:
        if body.get(name):
            hint = " (use 'tools')" if name.startswith("function") else ""
            raise bad_request(f"'{name}' is not supported{hint}", name, "unsupported_parameter")
    if kind is Endpoint.COMPLETION and body.get("suffix"):
        raise bad_request("'suffix' is not supported", "suffix", "unsupported_parameter")


def token_id_list(body: dict[str, Any], name: str) -> list[int]:
    """A list of non-negative integers (token ids; the vocabulary is checked once the model is known)."""
    value = body.get(name)
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value):
        raise bad_request(f"'{name}' must be a list of token ids", name, "invalid_type")
    return [int(t) for t in value]


def parse_logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's ``{"token id as a string": bias}`` → ``{token_id: bias}`` (ranges: SamplingParams)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must map token ids to numbers", "logit_bias", "invalid_type")
    out: dict[int, float] = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdecimal()):
            raise bad_request(f"'logit_bias' keys must be token ids, got {key[:32]!r}", "logit_bias", "invalid_type")
        if len(key) > MAX_ID_DIGITS:  # past int()'s 4300-digit limit it would raise; no vocabulary is this large
            raise bad_request(f"'logit_bias' key {key[:20]}... is not a token id ({len(key)} digits)", "logit_bias",
                              "token_id_out_of_range")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise bad_request(f"'logit_bias' values must be numbers, got {bias!r}"[:120], "logit_bias",
                              "invalid_type")
        out[int(key)] = float(bias)
    return out


def parse_prompt(prompt: Any) -> str | list[int]:
    """A single prompt: a string, a list of token ids, or a one-element list of either."""
    if prompt is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) and t >= 0 for t in prompt):
        return [int(t) for t in prompt]
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad_request("batched prompts are not supported; send one prompt per request", "prompt",
                          "unsupported_parameter")
    raise bad_request("'prompt' must be a string or a list of token ids", "prompt", "invalid_type")


def parse_stop(stop: Any, max_count: int, max_len: int) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad_request("'stop' must be a string or a list of strings", "stop", "invalid_type")
    if len(stops) > max_count:
        raise bad_request(f"'stop' accepts at most {max_count} strings", "stop")
    if any(not s or len(s) > max_len for s in stops):
        raise bad_request(f"each stop string must have 1 to {max_len} characters", "stop")
    return list(stops)
