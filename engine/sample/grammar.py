"""Structured output with llguidance: a `structured_output` spec becomes a grammar; each
constrained sequence holds a matcher that follows its output tokens; each step one call fills
the token bitmasks of every constrained row (in parallel, in Rust) and one bulk op masks the
logits. JSON is compact (no free whitespace), so a sampled answer cannot wander in blanks.

Kinds: json_schema (spec: the schema as JSON text), json_object (any JSON object), regex, grammar
(Lark, or GBNF when it uses `::=`), choice (one of the strings). A spec the library cannot
compile is refused with its message, before anything is queued."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

_CACHE_SIZE = 64  # compiled grammars kept (by spec text); compiling a schema can take milliseconds


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

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: list[int]) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._tokenizer: Any = None
        self._executor: Any = None
        self._grammars: OrderedDict[str, str] = OrderedDict()

    def grammar(self, spec: dict[str, Any], generated: Sequence[int] = ()) -> Grammar:
        """A fresh matcher for `spec`, advanced over `generated`; ValueError names what is wrong."""
        from llguidance import LLMatcher

        tokenizer = self._tok()
        text = self._compile(spec, tokenizer)
        matcher = LLMatcher(tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_output: {matcher.get_error()}")
        if generated and not matcher.consume_tokens(list(generated)):
            raise ValueError("structured_output: the tokens already generated do not follow the grammar")
        return Grammar(matcher)

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

    def _compile(self, spec: dict[str, Any], tokenizer: Any) -> str:
        key = json.dumps(spec, sort_keys=True)
        if key in self._grammars:
            self._grammars.move_to_end(key)
            return self._grammars[key]
        from llguidance import LLMatcher

        text = _grammar_text(spec)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if is_error:
            raise ValueError(f"structured_output ({spec['kind']}): {messages[0] if messages else 'invalid'}")
        self._grammars[key] = text
        if len(self._grammars) > _CACHE_SIZE:
            self._grammars.popitem(last=False)
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
        raise ValueError(f"structured_output (json_schema): {exc}") from exc
    if kind == "regex":
        return str(LLMatcher.grammar_from_regex(value))
    if kind == "choice":
        return str(LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(v) for v in value)))
    if kind == "grammar":
        if "::=" in value:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            value = gbnf_to_lark(value)
        return str(LLMatcher.grammar_from_lark(value))
    raise ValueError(f"structured_output kind {kind!r} is not supported")
