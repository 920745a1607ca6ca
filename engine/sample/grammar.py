"""Structured output with llguidance: a `structured_output` spec becomes a grammar; each
constrained sequence holds a matcher that follows its output tokens; each step one call fills
the token bitmasks of every constrained row (in parallel, in Rust) and one bulk op masks the
logits. JSON is compact (no free whitespace), so a sampled answer cannot wander in blanks.

Kinds: json_schema (spec: the schema as JSON text), json_object (any JSON object), regex, grammar
(Lark or GBNF, as its carried "dialect" says: `grammar_dialect`), choice (one of the strings). A spec the library cannot
compile is refused with its message, before anything is queued.

Compiling happens at admission (`LLMEngine.add_request`), never in a step, and once per grammar
text: the compiled form, a pristine matcher, is kept in a bounded LRU and every request gets a
`deep_copy` of it (microseconds, against milliseconds for a compile). The LRU is bounded by
entries and by an estimate of the bytes it holds (llguidance reports no size: `entry_bytes`,
from the grammar text's length); a grammar too large for the budget is compiled but not kept.
Errors of the library reach clients as their first line only (`library_message`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.sampling_params import grammar_dialect
from common.structured_limits import is_library_failure, library_message
from engine.sample.lru import BoundedLRU

_CACHE_SIZE = 64  # compiled grammars kept (by grammar text); compiling a schema can take milliseconds
_CACHE_BYTES = 256 << 20  # estimated bytes the compiled grammars (and their texts) may hold
_ENTRY_BASE_BYTES = 64 << 10  # a compiled matcher's fixed cost (lexer tables, token trie views)
_BYTES_PER_CHAR = 64  # what a compiled matcher holds per character of grammar text, estimated


def entry_bytes(text: str) -> int:
    """The estimated size of a compiled grammar of `text` (an over-estimate for small ones)."""
    return _ENTRY_BASE_BYTES + _BYTES_PER_CHAR * len(text)


class Grammar:
    """One sequence's grammar state (`engine.sched.sequence.TokenConstraint`)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def consume(self, token_id: int) -> bool:
        return bool(self.matcher.consume_token(token_id))

    def fork(self) -> Grammar:
        return Grammar(self.matcher.deep_copy())


class GrammarCompiler:
    """Compiles specs against one model's tokenizer (built on first use) and masks logits."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: list[int],
                 cache_size: int = _CACHE_SIZE, cache_bytes: int = _CACHE_BYTES) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.cache_size = cache_size
        self.num_compiled = 0  # grammars compiled so far (cache misses)
        self._tokenizer: Any = None
        self._executor: Any = None
        self._texts: BoundedLRU[str] = BoundedLRU(cache_size, cache_bytes)  # spec (as JSON) -> grammar text
        self._compiled: BoundedLRU[Any] = BoundedLRU(cache_size, cache_bytes)  # grammar text -> pristine LLMatcher

    def grammar(self, spec: dict[str, Any], generated: Sequence[int] = ()) -> Grammar:
        """A fresh matcher for `spec`, advanced over `generated`; ValueError names what is wrong.
        Compiles only on a cache miss (see the module docstring)."""
        matcher = self.compiled(spec).deep_copy()
        if generated and not matcher.consume_tokens(list(generated)):
            raise ValueError("structured_output: the tokens already generated do not follow the grammar")
        return Grammar(matcher)

    def compiled(self, spec: dict[str, Any]) -> Any:
        """The pristine (never advanced) matcher of `spec`'s grammar, from the LRU or compiled now."""
        text = self._text(spec)
        pristine = self._compiled.get(text)
        if pristine is not None:
            return pristine
        from llguidance import LLMatcher

        tokenizer = self._tok()
        try:
            pristine = LLMatcher(tokenizer, text, log_level=0)
        except BaseException as exc:
            if not is_library_failure(exc):
                raise
            raise ValueError(f"structured_output ({spec['kind']}): {library_message(str(exc))}") from exc
        self.num_compiled += 1
        if pristine.is_error():
            raise ValueError(f"structured_output ({spec['kind']}): {library_message(pristine.get_error() or '')}")
        self._compiled.put(text, pristine, entry_bytes(text))
        return pristine

    def apply(self, logits: torch.Tensor, rows: list[int], grammars: list[Grammar]) -> None:
        """Mask `logits[rows[i]]` to the tokens `grammars[i]` allows next; a row left with nothing
        (a matcher in an error state) can only end. Bits are unpacked with numpy and the batch is
        masked by one torch op: torch's elementwise ops cost far more than the masks themselves."""
        from llguidance.torch import fill_next_token_bitmask_par

        words = -(-self.vocab_size // 32)
        slot: dict[int, int] = {}  # rows of one request forking now share a matcher: one mask each
        for g in grammars:
            slot.setdefault(id(g), len(slot))
        bits = torch.full((len(slot), words), -1, dtype=torch.int32)
        unique = {id(g): g for g in grammars}
        fill_next_token_bitmask_par(self._exec(), [(unique[k].matcher, i) for k, i in slot.items()], bits)
        allowed = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[1]]
        allowed = allowed[[slot[id(g)] for g in grammars]].astype(bool)
        stuck = ~allowed.any(axis=1)
        if stuck.any():
            allowed[stuck, self.eos_token_ids[0]] = True
        banned = np.zeros(tuple(logits.shape), dtype=bool)
        banned[rows] = ~allowed
        logits.masked_fill_(torch.from_numpy(banned).to(logits.device), float("-inf"))

    def _text(self, spec: dict[str, Any]) -> str:
        key = json.dumps(spec, sort_keys=True)
        text = self._texts.get(key)
        if text is None:
            text = _grammar_text(spec)
            self._texts.put(key, text, len(key) + len(text))
        return text

    def _tok(self) -> Any:
        if self._tokenizer is None:
            if not (Path(self.tokenizer_dir) / "tokenizer.json").is_file():
                raise ValueError("structured_output needs the model's tokenizer.json, which this engine lacks")
            from llguidance.hf import from_tokenizer
            from transformers import AutoTokenizer

            hf: Any = AutoTokenizer.from_pretrained(self.tokenizer_dir)
            self._tokenizer = from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=self.eos_token_ids)
        return self._tokenizer

    def _exec(self) -> Any:
        if self._executor is None:
            from llguidance import LLExecutor

            self._executor = LLExecutor()
        return self._executor


def _grammar_text(spec: dict[str, Any]) -> str:
    """The Lark text of `spec`; ValueError with the library's first line when it is invalid."""
    try:
        return _lark(spec)
    except BaseException as exc:
        if not is_library_failure(exc):
            raise
        message = library_message(str(exc))
        raise ValueError(message if message.startswith("structured_output") else
                         f"structured_output ({spec['kind']}): {message}") from exc


def _lark(spec: dict[str, Any]) -> str:
    from llguidance import LLMatcher

    kind, value = spec["kind"], spec.get("spec")  # shapes checked by SamplingParams
    value = value if value is not None else ""
    compact = {"whitespace_flexible": False}
    try:
        if kind == "json_schema":
            return str(LLMatcher.grammar_from_json_schema(value, defaults=compact))  # type: ignore[arg-type]
        if kind == "json_object":
            return str(LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=compact))  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"structured_output (json_schema): {library_message(str(exc))}") from exc
    if kind == "regex":
        return str(LLMatcher.grammar_from_regex(value))
    if kind == "choice":
        return str(LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(v) for v in value)))
    if kind == "grammar":
        if grammar_dialect(spec) == "gbnf":
            from llguidance.gbnf_to_lark import gbnf_to_lark

            value = gbnf_to_lark(value)
        return str(LLMatcher.grammar_from_lark(value))
    raise ValueError(f"structured_output kind {kind!r} is not supported")
