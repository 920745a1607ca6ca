"""Reading a request body as JSON that is safe to hand on: 413 past the size limit, 400 for
invalid JSON, nesting deeper than MAX_DEPTH, or a string that is not valid Unicode (a lone
surrogate such as ``"\\ud800"`` parses in Python but breaks the tokenizer, msgpack and the
response encoder later, where it would be a 500)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from gateway.errors import OpenAIError, bad_request
from gateway.state import CONFIG

MAX_DEPTH = 64  # JSON schemas and tool definitions nest, but nothing legitimate nests this deep


async def read_json(request: web.Request) -> Any:
    """The body as checked JSON (see the module docstring)."""
    limit = request.app[CONFIG].max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise OpenAIError(413, f"request body too large (limit {limit} bytes)", code="request_too_large")
    raw = await request.read()
    try:
        body = json.loads(raw)
    except RecursionError as exc:  # the C scanner gives up on very deep nesting
        raise bad_request(f"request body nests deeper than {MAX_DEPTH} levels", code="too_deep") from exc
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    check_tree(body)
    return body


def check_tree(body: Any) -> None:
    """400 for nesting deeper than MAX_DEPTH or an unencodable string (key or value), naming
    where. Iterative, so a deep body cannot exhaust the stack here either."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"request body nests deeper than {MAX_DEPTH} levels (at '{path}')", path or None,
                              "too_deep")
        if isinstance(value, str):
            _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, path)
                stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = _printable(path)
        raise bad_request(f"'{where}' holds a lone surrogate (\\u{ord(text[exc.start]):04x}), which is not valid "
                          "Unicode", where or None, "invalid_unicode") from exc


def _printable(path: str) -> str:
    return path.encode("utf-8", "backslashreplace").decode("utf-8")
