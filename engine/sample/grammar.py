"""Structured output with llguidance: a `structured_output` spec becomes a grammar; each
constrained sequence holds a matcher that follows its output tokens; each step one call fills
the token bitmasks of every constrained row (in parallel, in Rust) and one bulk op masks the
logits. JSON is compact (no free whitespace), so a sampled answer cannot wander in blanks.

Kinds: json_schema (spec: the schema as JSON text), json_object (any JSON object), regex, grammar
(Lark or GBNF, as its carried "dialect" says: `grammar_dialect`), choice (one of the strings). A spec the library cannot
compile is refused with its message, before anything is queued.

Compiling never runs on the engine thread (a large grammar takes seconds, and every other
stream of the engine would wait): `submit` hands it to a few compile
threads (`CompilePool`; llguidance drops the GIL while it builds a matcher) and returns a
future; the engine admits the request into the scheduler once the future is done
(`LLMEngine.add_request`, `_admit_compiled`). Concurrent requests for one grammar share one
future, so it compiles once; a future nobody waits for any more is cancelled if it has not
started. Once per grammar text: the compiled form, a pristine matcher, is kept in a bounded LRU and every request gets a
`deep_copy` of it (microseconds, against milliseconds for a compile). The LRU is bounded by
entries and by an estimate of the bytes it holds (llguidance reports no size: `entry_bytes`,
from the grammar text's length); a grammar too large for the budget is compiled but not kept.
Errors of the library reach clients as their first line only (`library_message`)."""

from __future__ import annotations

import contextlib
import json
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
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
COMPILE_WORKERS = 2  # compile threads: two slow grammars at once leave later ones queued, not the engine
_JOIN_S = 30.0  # how long `close` waits for a compile still running (the size limits keep one to seconds;
# the threads are daemons: one still running cannot block the exit)


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


class CompilePool:
    """A few daemon threads running compile jobs in order of submission, started on first use;
    `close` stops them (waiting `_JOIN_S` at most for a compile still running)."""

    def __init__(self, workers: int = COMPILE_WORKERS) -> None:
        self.workers = workers
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compile pool is closed")
            if not self._threads:
                self._threads = [threading.Thread(target=self._run, name=f"grammar-compile-{i}", daemon=True)
                                 for i in range(self.workers)]
                for thread in self._threads:
                    thread.start()
            self._jobs.put(job)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            threads, self._threads = self._threads, []
        for _ in threads:
            self._jobs.put(None)
        for thread in threads:
            thread.join(_JOIN_S)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()


@dataclass(slots=True)
class _InFlight:
    """One grammar being compiled, and how many requests wait for it."""

    future: Future[Any]
    waiters: int = 1


class GrammarCompiler:
    """Compiles specs against one model's tokenizer (built on first use) and masks logits.
    `submit`, `release`, `follow`, `compiled`, `grammar` and `close` may be called from any
    thread; `apply` runs on the engine thread."""

    def __init__(self, tokenizer_dir: str, vocab_size: int, eos_token_ids: list[int],
                 cache_size: int = _CACHE_SIZE, cache_bytes: int = _CACHE_BYTES,
                 workers: int = COMPILE_WORKERS) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.cache_size = cache_size
        self.num_compiled = 0  # grammars compiled so far (cache misses)
        self._tokenizer: Any = None
        self._executor: Any = None
        self._texts: BoundedLRU[str] = BoundedLRU(cache_size, cache_bytes)  # spec (as JSON) -> grammar text
        self._compiled: BoundedLRU[Any] = BoundedLRU(cache_size, cache_bytes)  # grammar text -> pristine LLMatcher
        self._pool = CompilePool(workers)
        self._lock = threading.Lock()  # guards `_inflight` and `num_compiled`
        self._tok_lock = threading.Lock()
        self._inflight: dict[str, _InFlight] = {}  # spec (as JSON) -> its compile under way

    def grammar(self, spec: dict[str, Any], generated: Sequence[int] = ()) -> Grammar:
        """A fresh matcher for `spec`, advanced over `generated`; ValueError names what is wrong.
        Compiles only on a cache miss (see the module docstring), and waits for it."""
        return self.follow(self.compiled(spec), generated)

    def follow(self, pristine: Any, generated: Sequence[int] = ()) -> Grammar:
        """A copy of a pristine matcher, advanced over `generated` (a resumed request's tokens)."""
        matcher = pristine.deep_copy()
        if generated and not matcher.consume_tokens(list(generated)):
            raise ValueError("structured_output: the tokens already generated do not follow the grammar")
        return Grammar(matcher)

    def compiled(self, spec: dict[str, Any]) -> Any:
        """The pristine (never advanced) matcher of `spec`'s grammar, from the LRU or compiled
        now by the pool (`submit`), waited for."""
        return self.submit(spec).result()

    def submit(self, spec: dict[str, Any]) -> Future[Any]:
        """A future of `spec`'s pristine matcher: done at once on a cache hit; else the compile
        already under way for this spec, or a new one queued on the pool. Its exception is a
        ValueError naming what is wrong. A caller that stops waiting calls `release`."""
        key = _key(spec)
        with self._lock:
            text = self._texts.get(key)
            pristine = self._compiled.get(text) if text is not None else None
            if pristine is not None:
                done: Future[Any] = Future()
                done.set_result(pristine)
                return done
            job = self._inflight.get(key)
            if job is not None:
                job.waiters += 1
                return job.future
            job = self._inflight[key] = _InFlight(Future())
        self._pool.submit(lambda: self._work(key, spec, job))
        return job.future

    def release(self, spec: dict[str, Any], future: Future[Any]) -> None:
        """One waiter of `future` (from `submit`) gave up (aborted, timed out): when nobody
        waits any more and the compile has not started, it never runs."""
        key = _key(spec)
        with self._lock:
            job = self._inflight.get(key)
            if job is None or job.future is not future:
                return
            job.waiters -= 1
            if job.waiters <= 0 and job.future.cancel():
                del self._inflight[key]

    def prewarm(self) -> None:
        """Build the llguidance tokenizer on a compile thread now. It holds the GIL for about a
        second (transformers loads the tokenizer, llguidance builds its token trie), so a server
        does it at start-up rather than under the first structured request's neighbours."""
        self._pool.submit(self._try_tok)

    def _try_tok(self) -> None:
        with contextlib.suppress(Exception):  # no tokenizer.json: the first structured request says so
            self._tok()

    def compiling(self) -> int:
        """Compiles queued or running now."""
        with self._lock:
            return len(self._inflight)

    def close(self) -> None:
        """Stop the compile threads; compiles not started are cancelled."""
        with self._lock:
            jobs, self._inflight = list(self._inflight.values()), {}
        for job in jobs:
            job.future.cancel()
        self._pool.close()

    def _work(self, key: str, spec: dict[str, Any], job: _InFlight) -> None:
        """On a compile thread: compile, keep the result in the LRU, then end the in-flight
        entry and settle the future (in that order: a `submit` meanwhile finds one or the other)."""
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            result, error = self._compile(key, spec), None
        except BaseException as exc:  # whatever it is goes to the waiters
            result, error = None, exc
        with self._lock:
            if self._inflight.get(key) is job:
                del self._inflight[key]
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    def _compile(self, key: str, spec: dict[str, Any]) -> Any:
        text = self._text(spec, key)
        pristine = self._compiled.get(text)
        if pristine is not None:  # another spec of the same grammar text
            return pristine
        from llguidance import LLMatcher

        tokenizer = self._tok()
        try:
            pristine = LLMatcher(tokenizer, text, log_level=0)
        except BaseException as exc:
            if not is_library_failure(exc):
                raise
            raise ValueError(f"structured_output ({spec['kind']}): {library_message(str(exc))}") from exc
        with self._lock:
            self.num_compiled += 1
        if pristine.is_error():
            raise ValueError(f"structured_output ({spec['kind']}): {library_message(pristine.get_error() or '')}")
        # the first mask, here rather than in the first step: the lexer states it builds are
        # shared by every copy (the first mask of a large grammar is slow, later ones are fast)
        pristine.deep_copy().compute_bitmask()
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

    def _text(self, spec: dict[str, Any], key: str | None = None) -> str:
        key = key if key is not None else _key(spec)
        text = self._texts.get(key)
        if text is None:
            text = _grammar_text(spec)
            self._texts.put(key, text, len(key) + len(text))
        return text

    def _tok(self) -> Any:
        with self._tok_lock:  # compile threads may want it at once: built once
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


def _key(spec: dict[str, Any]) -> str:
    return json.dumps(spec, sort_keys=True)


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
