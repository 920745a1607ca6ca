"""Issue 24: grammars are compiled at admission, once per grammar text (a bounded LRU of
pristine matchers, each request gets a copy), never inside a step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.sample.grammar import GrammarCompiler, entry_bytes
from engine.sample.lru import BoundedLRU

SCHEMA = {"kind": "json_schema", "spec": json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                     "required": ["a"], "additionalProperties": False})}
REGEX = {"kind": "regex", "spec": "[ab]{2,5}"}
CHOICE = {"kind": "choice", "spec": ["yes", "no"]}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), kv_cache_memory=8 << 20)


def _compiler(llm: LLM, size: int = 8, cache_bytes: int = 1 << 30) -> GrammarCompiler:
    engine = llm.engine
    return GrammarCompiler(engine.grammars.tokenizer_dir, engine.vocab_size, engine.grammars.eos_token_ids, size,
                           cache_bytes)


def test_one_grammar_compiles_once_and_copies_are_independent(llm: LLM) -> None:
    compiler = _compiler(llm)
    first, second = compiler.grammar(REGEX), compiler.grammar(dict(REGEX))
    assert compiler.num_compiled == 1
    token = llm.tokenizer.encode("a", add_special_tokens=False)[0]
    assert first.consume(token)
    assert not first.matcher.is_accepting() and not second.matcher.is_accepting()
    assert second.matcher.consume_tokens(llm.tokenizer.encode("ab", add_special_tokens=False))
    assert second.matcher.is_accepting() and not first.matcher.is_accepting()  # the copies do not share state
    compiler.grammar(REGEX, llm.tokenizer.encode("ab", add_special_tokens=False))  # resumed: still one compile
    assert compiler.num_compiled == 1 and compiler.compiled(REGEX).is_accepting() is False  # pristine stays so


def test_cache_is_a_bounded_lru(llm: LLM) -> None:
    compiler = _compiler(llm, size=2)
    compiler.grammar(REGEX)
    compiler.grammar(SCHEMA)
    compiler.grammar(REGEX)  # REGEX most recent: SCHEMA goes next
    compiler.grammar(CHOICE)
    assert compiler.num_compiled == 3
    compiler.grammar(REGEX)
    assert compiler.num_compiled == 3
    compiler.grammar(SCHEMA)
    assert compiler.num_compiled == 4


def test_a_bad_grammar_is_refused_and_not_cached(llm: LLM) -> None:
    compiler = _compiler(llm)
    for _ in range(2):
        with pytest.raises(ValueError, match="undefined_rule"):
            compiler.grammar({"kind": "grammar", "spec": "start: undefined_rule"})
    assert compiler.num_compiled == 2


def test_requests_with_one_grammar_compile_once_at_admission(llm: LLM) -> None:
    engine = llm.engine
    before = engine.grammars.num_compiled
    spec = {"kind": "regex", "spec": "[xy]{3,9}z"}  # not used by another test of this module
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=12, structured_output=spec)
    engine.add_request("g-1", list(range(40, 50)), params)
    engine.add_request("g-2", list(range(50, 60)), params)
    engine.wait_compiled()  # compiled off the engine thread (issue 41), once for both
    assert engine.grammars.num_compiled == before + 1
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.grammars.num_compiled == before + 1  # nothing compiled in a step
    out = llm.generate([list(range(60, 70))], SamplingParams(temperature=0, max_tokens=12, structured_output=spec))
    assert engine.grammars.num_compiled == before + 1
    text = llm.tokenizer.decode(out[0].outputs[0].token_ids, skip_special_tokens=True)
    assert text[-1] == "z" and set(text[:-1]) <= {"x", "y"}


def test_cache_is_bounded_in_bytes_too(llm: LLM) -> None:
    """Issue 41: past the byte budget the least recently used grammars go, whatever the count;
    one larger than the whole budget is compiled, served, and not kept."""
    small = [{"kind": "regex", "spec": f"[ab]{{{i}}}"} for i in range(1, 4)]
    sizes = [entry_bytes(llm.engine.grammars._text(spec)) for spec in small]
    compiler = _compiler(llm, size=64, cache_bytes=sizes[0] + sizes[1] + sizes[2] // 2)
    for spec in small:
        compiler.grammar(spec)
    assert compiler.num_compiled == 3 and len(compiler._compiled) == 2  # the first went
    assert compiler._compiled.bytes <= compiler._compiled.max_bytes
    compiler.grammar(small[2])
    compiler.grammar(small[1])
    assert compiler.num_compiled == 3
    compiler.grammar(small[0])
    assert compiler.num_compiled == 4
    tight = _compiler(llm, size=64, cache_bytes=sizes[0] - 1)  # no grammar fits
    for _ in range(2):
        assert tight.grammar(small[0]).consume(llm.tokenizer.encode("a", add_special_tokens=False)[0])
    assert tight.num_compiled == 2 and len(tight._compiled) == 0


def test_bounded_lru_evicts_by_bytes_and_count() -> None:
    lru: BoundedLRU[int] = BoundedLRU(max_entries=3, max_bytes=100)
    assert lru.put("a", 1, 40) and lru.put("b", 2, 40)
    assert lru.get("a") == 1  # "b" is now the oldest
    assert lru.put("c", 3, 40)
    assert "b" not in lru and lru.bytes == 80 and lru.evicted == 1
    assert not lru.put("huge", 4, 101) and "huge" not in lru
    lru.put("d", 4, 1)
    lru.put("e", 5, 1)
    assert len(lru) == 3 and "a" not in lru  # the count bound
    lru.put("c", 6, 10)  # replacing an entry counts its new size only
    assert lru.bytes == 12 and lru.get("c") == 6


def test_library_errors_reach_the_client_as_one_line(llm: LLM) -> None:
    compiler = _compiler(llm)
    with pytest.raises(ValueError) as info:
        compiler.grammar({"kind": "grammar", "spec": 'start: foo\nfoo: "a" | %json {"type": 3}'})
    assert "\n" not in str(info.value) and str(info.value).startswith("structured_output (grammar): ")
