"""Reading a request body as JSON that is safe to hand on: 413 past the size limit, 400 for
a body that is not UTF-8 (strictly: ``json.loads(bytes)`` would also guess UTF-16 and UTF-32,
whose lone surrogates then reach the tokenizer; a UTF-8 BOM is skipped), invalid JSON, nesting
deeper than MAX_DEPTH, or a string that is not valid Unicode (a lone surrogate escape such as
``"\\ud800"`` parses in Python but breaks the tokenizer, msgpack and the response encoder later,
where it would be a 500)."""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web

from gateway.errors import OpenAIError, bad_request
from gateway.state import CONFIG

MAX_DEPTH = 64  # JSON schemas and tool definitions nest, but nothing legitimate nests this deep
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # the only way a surrogate gets into parsed JSON


async def read_json(request: web.Request) -> Any:
    """The body as checked JSON (see the module docstring)."""
    limit = request.app[CONFIG].max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise OpenAIError(413, f"request body too large (limit {limit} bytes)", code="request_too_large")
    return parse_body(await request.read())


def parse_body(raw: bytes) -> Any:
    """`raw` as checked JSON, or OpenAIError(400) (see the module docstring)."""
    try:
        text = raw.decode("utf-8-sig")  # strict: invalid bytes and encoded surrogates are refused
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (byte {exc.start}: {raw[exc.start:exc.start + 1]!r}); "
                          "send JSON encoded as UTF-8", code="invalid_encoding") from exc
    try:
        body = json.loads(text)
    except RecursionError as exc:  # the C scanner gives up on very deep nesting
        raise bad_request(f"request body nests deeper than {MAX_DEPTH} levels", code="too_deep") from exc
    except ValueError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from exc
    # the walk is slow on a large body: skip what the raw bytes show cannot happen
    deep = raw.count(b"[") + raw.count(b"{") > MAX_DEPTH
    strings = _SURROGATE_ESCAPE.search(raw) is not None
    if deep or strings:
        check_tree(body, strings)
    return body


def check_tree(body: Any, strings: bool = True) -> None:
    """400 for nesting deeper than MAX_DEPTH or (with `strings`) an unencodable string, key or
    value, naming where. Iterative, so a deep body cannot exhaust the stack here either."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise bad_request(f"request body nests deeper than {MAX_DEPTH} levels (at '{_printable(path)}')",
                              _printable(path) or None, "too_deep")
        if isinstance(value, str):
            if strings:
                _check_text(value, path)
        elif isinstance(value, dict):
            for key, item in value.items():
                if strings:
                    _check_text(key, path)
                if strings or isinstance(item, (dict, list)):
                    stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value)
                         if strings or isinstance(item, (dict, list)))


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        where = _printable(path)
        raise bad_request(f"'{where}' holds a lone surrogate (\\u{ord(text[exc.start]):04x}), which is not valid "
                          "Unicode", where or None, "invalid_unicode") from exc


def _printable(path: str) -> str:
    return path.encode("utf-8", "backslashreplace").decode("utf-8")
