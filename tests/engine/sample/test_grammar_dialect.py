"""Issue 41: a grammar's dialect is decided once (the gateway's `dialect_of`) and carried as
"dialect"; the engine compiles what it is told. A Lark grammar whose literal holds `::=` is
served; a request from before the field keeps the old rule (GBNF when it contains `::=`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.protocol import EngineRequest
from common.sampling_params import ParamError, SamplingParams, grammar_dialect
from engine.llm import LLM
from gateway.api.structured import check_structured, dialect_of, parse_structured

LARK_WITH_GBNF_TOKEN = 'start: "a::=" /[0-9]/'
PROMPT = list(range(60, 80))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), kv_cache_memory=8 << 20)


def _text(llm: LLM, structured: dict[str, object]) -> str:
    params = SamplingParams(temperature=1.0, seed=2, max_tokens=40, structured_output=structured)
    choice = llm.generate([PROMPT], params)[0].outputs[0]
    assert choice.finish_reason == "stop"
    return llm.tokenizer.decode(choice.token_ids, skip_special_tokens=True)


def test_gateway_decides_once_and_the_request_carries_it() -> None:
    structured, param = parse_structured({"guided_grammar": LARK_WITH_GBNF_TOKEN})
    assert structured == {"kind": "grammar", "spec": LARK_WITH_GBNF_TOKEN, "dialect": "lark"}
    check_structured(structured, param)  # compiles as Lark
    assert dialect_of('root ::= "x"') == "gbnf"
    request = EngineRequest(id="r", gateway="g", model="m", prompt_token_ids=[1],
                            params=SamplingParams(structured_output=structured), arrival=0.0, deadline=1.0)
    assert EngineRequest.decode(request.encode()).params.structured_output == structured  # on the wire


def test_lark_literal_with_gbnf_token_is_served(llm: LLM) -> None:
    structured, _ = parse_structured({"guided_grammar": LARK_WITH_GBNF_TOKEN})
    text = _text(llm, structured)
    assert text.startswith("a::=") and len(text) == 5 and text[-1].isdigit()


def test_old_requests_without_the_field_keep_the_old_rule(llm: LLM) -> None:
    old = {"kind": "grammar", "spec": 'root ::= "x" [0-9] "y"'}
    assert grammar_dialect(old) == "gbnf" and grammar_dialect({"kind": "grammar", "spec": 'start: "a"'}) == "lark"
    text = _text(llm, old)
    assert text[0] == "x" and text[-1] == "y"


def test_a_bad_dialect_is_refused() -> None:
    with pytest.raises(ParamError, match="dialect"):
        SamplingParams(structured_output={"kind": "grammar", "spec": 'start: "a"', "dialect": "peg"})
    with pytest.raises(ParamError, match="dialect"):
        SamplingParams(structured_output={"kind": "regex", "spec": "a", "dialect": "lark"})
