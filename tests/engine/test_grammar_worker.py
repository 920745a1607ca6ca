"""Issue 41, "no request may freeze the others": a grammar compiles on the compile threads, not
on the engine thread. Caused on a real engine (the tiny random Llama): a plain greedy stream keeps
stepping while a large grammar compiles (counted in tokens produced between the big request's
admission and its matcher being ready, not in wall-clock gaps), the big request then follows its
grammar; requests for one grammar share one compile; a request aborted while compiling, or
refused past the compile budget, leaves nothing behind; and the worker's thread reports the
refusal as a rejection (a 400 for its client)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.sample.grammar import GrammarCompiler, entry_bytes
from engine.worker.engine_thread import AddJob, EngineThread
from tests.engine.helpers import assert_no_leaks

PLAIN = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
PLAIN_PROMPT = [5, 6, 7, 8, 9]
BIG_PROMPT = list(range(60, 70))
GRAMMAR_BYTES = 250_000  # under MAX_GRAMMAR_BYTES (256 KiB): ~12,000 alternatives
STEPS_HELD = 20  # plain steps taken while the big request's compile is held


def big_grammar(tag: str, size: int = GRAMMAR_BYTES) -> tuple[dict[str, str], list[str]]:
    """A Lark grammar of one terminal of string alternatives, `size` bytes long (the largest kind
    of grammar the size limits let through; a guided_choice is capped at 1,024 strings; as a
    terminal, the lexer matches them, where parser-level alternatives stop at llguidance's 2,000
    items per row), distinct per `tag` so that no other test's cache entry serves it; and the
    strings it allows."""
    words: list[str] = []
    used = len("start: ITEM\nITEM: ")
    while used < size:
        words.append(f"{tag} {len(words)} {len(words) * 7919 % 100_000}")
        used += len(json.dumps(words[-1])) + 3
    return {"kind": "grammar", "spec": "start: ITEM\nITEM: " + " | ".join(json.dumps(w) for w in words)}, words


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), kv_cache_memory=8 << 20)


def _tokens(outputs: list[RequestOutput], request_id: str) -> int:
    return sum(len(c.token_ids) for o in outputs if o.request_id == request_id for c in o.outputs)


def flat_grammar(tag: str, size: int = GRAMMAR_BYTES) -> dict[str, str]:
    """The same strings as parser-level alternatives: the slowest grammar to compile that the
    size limits let through (~1 s here); it cannot run (past llguidance's 2,000 items per row)."""
    _, words = big_grammar(tag, size)
    return {"kind": "grammar", "spec": "start: " + " | ".join(json.dumps(w) for w in words)}


def test_plain_stream_steps_while_a_big_grammar_waits_for_its_matcher(llm: LLM) -> None:
    """Deterministic: both compile threads are held (`gate`), so the big request's matcher
    cannot be ready; the plain stream must still produce every one of its tokens meanwhile,
    and the big request must not run until its matcher is there."""
    engine = llm.engine
    reference = llm.generate([PLAIN_PROMPT], PLAIN)[0].outputs[0].token_ids
    spec, words = big_grammar("progress")
    gate = threading.Event()
    for _ in range(engine.grammars._pool.workers):
        engine.grammars._pool.submit(gate.wait)
    engine.add_request("plain", PLAIN_PROMPT, PLAIN)
    engine.add_request("big", BIG_PROMPT, SamplingParams(temperature=0, max_tokens=64, structured_output=spec))
    assert engine.num_compiling() == 1, "add_request returned before the grammar compiled"
    produced: list[int] = []
    try:
        for _ in range(STEPS_HELD):
            outputs = engine.step()
            assert {o.request_id for o in outputs} == {"plain"}
            produced += outputs[0].outputs[0].token_ids
        assert produced == reference[:STEPS_HELD] and engine.num_compiling() == 1
        assert "big" not in engine.waiting_request_ids() + engine.running_request_ids()
    finally:
        gate.set()
    big: list[int] = []
    finish = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "plain":
                produced += out.outputs[0].token_ids
            else:
                big += out.outputs[0].token_ids
                finish = out.outputs[0].finish_reason or finish
    assert produced == reference  # its greedy tokens, undisturbed
    text = llm.tokenizer.decode(big, skip_special_tokens=True)
    assert finish == "stop" and text in set(words)
    assert_no_leaks(llm)


def test_plain_stream_steps_while_a_big_grammar_compiles(llm: LLM) -> None:
    """The compile itself runs beside the steps (llguidance drops the GIL while it builds a
    matcher): steps that began and ended while the slowest grammar the limits allow was
    compiling are counted; a compile holding the engine (as before issue 41) leaves none."""
    engine = llm.engine
    engine.add_request("plain", PLAIN_PROMPT, PLAIN)
    engine.step()
    engine.add_request("flat", BIG_PROMPT, SamplingParams(max_tokens=4, structured_output=flat_grammar("gil")))
    future = engine.compiling["flat"].future
    steps_inside = tokens_inside = 0
    while not future.done():
        outputs = engine.step()
        if not future.done():
            steps_inside += 1
            tokens_inside += _tokens(outputs, "plain")
    assert steps_inside >= 3 and tokens_inside >= steps_inside, (steps_inside, tokens_inside)
    assert engine.abort_request("flat") and engine.abort_request("plain")
    engine.step()
    assert_no_leaks(llm)


def test_requests_for_one_grammar_share_one_compile(llm: LLM) -> None:
    engine = llm.engine
    spec, words = big_grammar("shared", 80_000)
    before = engine.grammars.num_compiled
    first = engine.grammars.submit(spec)
    assert engine.grammars.submit(dict(spec)) is first  # the same future while it compiles
    engine.grammars.release(spec, first)
    engine.grammars.release(spec, first)
    params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=64, structured_output=spec) for seed in range(3)]
    for i, p in enumerate(params):
        engine.add_request(f"shared-{i}", BIG_PROMPT, p)
    assert engine.num_compiling() == 3
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert engine.grammars.num_compiled == before + 1
    outputs = llm.generate([BIG_PROMPT], params[0])  # offline, later: the cached matcher
    assert engine.grammars.num_compiled == before + 1
    assert outputs[0].outputs[0].token_ids == tokens["shared-0"]
    texts = {llm.tokenizer.decode(t, skip_special_tokens=True) for t in tokens.values()}
    assert texts <= set(words)
    assert_no_leaks(llm)


def test_threads_asking_for_one_grammar_at_once_get_one_compile(llm: LLM) -> None:
    """Six threads released together ask for one new grammar: one compile, one cache entry (its
    bytes counted once), the same pristine matcher for all."""
    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer_dir, engine.vocab_size, sorted(engine.eos_token_ids), 8, 1 << 30)
    spec, _ = big_grammar("threads", 60_000)
    barrier = threading.Barrier(6)
    got: list[object] = []

    def ask() -> None:
        barrier.wait()
        got.append(compiler.compiled(spec))

    threads = [threading.Thread(target=ask) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert len(got) == 6 and all(m is got[0] for m in got)
        assert compiler.num_compiled == 1 and compiler.compiling() == 0
        assert len(compiler._compiled) == 1 and compiler._compiled.bytes == entry_bytes(compiler._text(spec))
    finally:
        compiler.close()


def test_abort_while_compiling_frees_everything(llm: LLM) -> None:
    engine = llm.engine
    spec, _ = big_grammar("aborted")
    engine.add_request("doomed", BIG_PROMPT, SamplingParams(max_tokens=8, structured_output=spec))
    engine.add_request("plain-a", PLAIN_PROMPT, SamplingParams(temperature=0, max_tokens=4))
    assert engine.num_compiling() == 1
    assert engine.abort_request("doomed")
    assert not engine.abort_request("doomed")
    assert engine.num_compiling() == 0 and "doomed" not in engine.requests
    while engine.has_unfinished_requests():
        assert all(o.request_id == "plain-a" for o in engine.step())
    assert engine.take_refused() == {}
    assert_no_leaks(llm)


def test_a_compile_past_its_budget_is_refused_and_the_engine_serves(tiny_llama_dir: Path) -> None:
    with LLM(str(tiny_llama_dir), kv_cache_memory=4 << 20, grammar_compile_timeout=0.001) as strict:
        engine = strict.engine
        spec, _ = big_grammar("over-budget")
        params = SamplingParams(max_tokens=8, structured_output=spec)
        engine.add_request("slow", BIG_PROMPT, params)
        engine.add_request("plain-b", PLAIN_PROMPT, SamplingParams(temperature=0, max_tokens=6))
        while engine.has_unfinished_requests():
            engine.step()
        refused = engine.take_refused()
        assert list(refused) == ["slow"]
        message, code = refused["slow"]
        assert code == "grammar_compile_timeout" and "0.001 s" in message and "--grammar-compile-timeout" in message
        assert engine.stats()["grammar_timeouts"] == 1
        with pytest.raises(ValueError, match="took longer than"):
            strict.generate([BIG_PROMPT], SamplingParams(max_tokens=8, structured_output=big_grammar("other")[0]))
        assert_no_leaks(strict)
        out = strict.generate([PLAIN_PROMPT], SamplingParams(temperature=0, max_tokens=6))[0]
        assert len(out.outputs[0].token_ids) == 6
        assert_no_leaks(strict)


def test_the_engine_thread_reports_refusals_as_rejections(tiny_llama_dir: Path) -> None:
    """The worker's path: a refusal made in a step comes back in that step's `rejected`, and a
    request waiting for its grammar counts in `Queues.compiling` (the worker keeps stepping)."""
    host = EngineThread()
    host._build(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=4 << 20, device="cpu",
                             grammar_compile_timeout=0.001))
    try:
        spec, _ = big_grammar("thread")
        result = host.step([AddJob(request_id="slow", prompt_token_ids=BIG_PROMPT, params=SamplingParams(max_tokens=4,
                                                                                                         structured_output=spec)),
                            AddJob(request_id="plain", prompt_token_ids=PLAIN_PROMPT,
                                   params=SamplingParams(temperature=0, max_tokens=4))], [])
        assert result.queues.compiling in (0, 1)
        rejected = dict(result.rejected)
        while host.engine.has_unfinished_requests():
            assert result.queues.total > 0
            result = host.step([], [])
            rejected |= result.rejected
        assert list(rejected) == ["slow"] and rejected["slow"][1] == "grammar_compile_timeout"
        assert result.queues.total == 0 and host.engine.block_manager.num_used_blocks == 0
    finally:
        host.close()
