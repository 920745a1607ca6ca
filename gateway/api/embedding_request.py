"""The body of POST /v1/embeddings, checked: OpenAI's `input` (a string, a list of strings, a
token-id list or a list of token-id lists), `encoding_format` (float or base64), `dimensions`,
`user`, and vLLM's `normalize` extra; anything else is a 400 naming the field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.pooling_params import MAX_DIMENSIONS, PoolingParams
from gateway.errors import bad_request

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request
_KNOWN = {"model", "input", "encoding_format", "dimensions", "user", "normalize"}


@dataclass(slots=True)
class EmbeddingRequest:
    model: str
    inputs: list[str | list[int]]  # each: text to tokenize, or token ids as given
    encoding_format: str
    pooling: PoolingParams


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _inputs(raw: Any) -> list[str | list[int]]:
    """The inputs in order; 400 for an empty list, an empty string, or mixed or wrong types."""
    if isinstance(raw, str):
        raw = [raw]
    elif isinstance(raw, list) and raw and all(_is_int(t) for t in raw):
        raw = [raw]  # one prompt of token ids
    if not isinstance(raw, list) or not raw:
        raise bad_request("'input' must be a non-empty string, a list of strings, a list of token ids or a list "
                          "of token-id lists", "input")
    if len(raw) > MAX_INPUTS:
        raise bad_request(f"'input' has {len(raw)} items; at most {MAX_INPUTS}", "input")
    out: list[str | list[int]] = []
    for i, item in enumerate(raw):
        if isinstance(item, str):
            if not item:
                raise bad_request(f"'input[{i}]' is an empty string", "input")
            out.append(item)
        elif isinstance(item, list) and item and all(_is_int(t) for t in item):
            out.append([int(t) for t in item])
        else:
            raise bad_request(f"'input[{i}]' must be a non-empty string or a non-empty list of token ids", "input")
    return out


def parse_embedding_request(body: Any) -> EmbeddingRequest:
    """The checked request (400 with the field's name otherwise)."""
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    unknown = sorted(str(k) for k in body if k not in _KNOWN)
    if unknown:
        raise bad_request(f"unknown field '{unknown[0][:40]}'", unknown[0][:40], "unknown_parameter")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' must be a non-empty string", "model")
    if "input" not in body:
        raise bad_request("'input' is required", "input")
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding
    if encoding not in ("float", "base64"):
        raise bad_request("'encoding_format' must be 'float' or 'base64'", "encoding_format")
    dimensions = body.get("dimensions")
    if dimensions is not None and (not _is_int(dimensions) or not 1 <= dimensions <= MAX_DIMENSIONS):
        raise bad_request(f"'dimensions' must be an integer in [1, {MAX_DIMENSIONS}]", "dimensions")
    normalize = body.get("normalize")
    if normalize is not None and not isinstance(normalize, bool):
        raise bad_request("'normalize' must be a boolean", "normalize")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("'user' must be a string", "user")
    return EmbeddingRequest(model, _inputs(body["input"]), encoding, PoolingParams(dimensions, normalize))
