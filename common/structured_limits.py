"""Size limits of structured-output constraints, in one place (documented in docs/api.md).

The gateway checks them with a 400 naming the field (`gateway.api.structured`), and
`SamplingParams` checks them again (an engine never compiles an oversized grammar, whoever
sent it). They keep a request from reaching the grammar library's internal limits (whose
complaints carry a Rust backtrace) and from spending seconds of compile time (compile time
grows with the number of choices).

`library_message` is what a client may see of a grammar library error: its first line."""

from __future__ import annotations

MAX_CHOICES = 1024  # strings in a choice list
MAX_CHOICE_BYTES = 64 << 10  # UTF-8 bytes of all choices together
MAX_REGEX_BYTES = 16 << 10  # a regular expression
MAX_GRAMMAR_BYTES = 256 << 10  # a Lark / GBNF grammar (tool-call grammars included)
MAX_JSON_SCHEMA_BYTES = 256 << 10  # a JSON schema, as compact JSON text
MAX_LIBRARY_MESSAGE = 300  # characters of a grammar-library error shown to a client

SPEC_BYTES = {"regex": MAX_REGEX_BYTES, "grammar": MAX_GRAMMAR_BYTES, "json_schema": MAX_JSON_SCHEMA_BYTES}


def limit_error(kind: str, spec: object, what: str) -> str | None:
    """Why `spec` (of `kind`, named `what` in the message) is too large; None when it fits."""
    if kind == "choice" and isinstance(spec, list):
        if len(spec) > MAX_CHOICES:
            return f"'{what}' has {len(spec)} choices; at most {MAX_CHOICES} are accepted"
        size = sum(len(v.encode("utf-8", "surrogatepass")) for v in spec if isinstance(v, str))
        if size > MAX_CHOICE_BYTES:
            return f"'{what}' holds {size} bytes of choices; at most {MAX_CHOICE_BYTES} are accepted"
        return None
    limit = SPEC_BYTES.get(kind)
    if limit is not None and isinstance(spec, str):
        size = len(spec.encode("utf-8", "surrogatepass"))
        if size > limit:
            return f"'{what}' is {size} bytes; a {kind} of at most {limit} bytes is accepted"
    return None


def library_message(text: str) -> str:
    """The first non-empty line of a grammar-library error, bounded: no backtrace, no grammar
    excerpt. A first line that only introduces (ends with ':', as regex errors do) gets the
    library's `error: ...` line after it."""
    lines = [line.strip() for line in str(text).splitlines()]
    for i, line in enumerate(lines):
        if "backtrace" in line.lower():
            lines = lines[:i]
            break
    lines = [line for line in lines if line]
    if not lines:
        return "invalid"
    first = lines[0]
    if first.endswith(":"):
        detail = next((line for line in lines[1:] if line.startswith("error:")), None)
        if detail:
            first = f"{first} {detail}"
    return first[:MAX_LIBRARY_MESSAGE]


def is_library_failure(exc: BaseException) -> bool:
    """An error of the grammar library: ValueError / RuntimeError, or a Rust panic (pyo3 raises
    `PanicException`, a BaseException): a refusal of that one grammar, not a crash."""
    return isinstance(exc, (ValueError, RuntimeError)) or type(exc).__name__ == "PanicException"
