"""Typed field readers for the body's own fields (the sampling parameters' rules are
`common.sampling_params`'); each raises OpenAIError(400) naming the param."""

from __future__ import annotations

from typing import Any

from gateway.api.endpoint import Endpoint
from gateway.errors import bad_request

_UNSUPPORTED_PRESENT = ("functions", "function_call", "audio", "prediction")
MAX_ID_DIGITS = 20  # a token id written as a string (logit_bias keys): 2^64 has 20 digits


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


def parse_logit_bias(value: Any) -> dict[int, Any]:
    """OpenAI's ``{"token id as a string": bias}`` → ``{token_id: bias}`` (the values' type and
    range: SamplingParams)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("'logit_bias' must map token ids to numbers", "logit_bias", "invalid_type")
    out: dict[int, Any] = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdecimal()):
            raise bad_request(f"'logit_bias' keys must be token ids, got {key[:32]!r}", "logit_bias", "invalid_type")
        if len(key) > MAX_ID_DIGITS:  # past int()'s 4300-digit limit it would raise; no vocabulary is this large
            raise bad_request(f"'logit_bias' key {key[:20]}... is not a token id ({len(key)} digits)", "logit_bias",
                              "token_id_out_of_range")
        out[int(key)] = bias
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
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
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
