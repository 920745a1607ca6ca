"""Structured output (llguidance) through the engine: sampled answers of a random model parse and
validate against the schema over several seeds, with n > 1, under forced preemption, and when
resumed from tokens already sent; every kind compiles; a bad spec is refused before it runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.worker.engine_thread import AddJob, EngineThread
from tests.engine.helpers import assert_no_leaks

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "ok"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"kind": "json_schema", "spec": json.dumps(SCHEMA)}
PROMPT = list(range(60, 80))


def _params(seed: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=80, structured_output=JSON_SCHEMA, **kwargs)


def _valid(llm: LLM, token_ids: list[int]) -> dict[str, Any]:
    value = json.loads(llm.tokenizer.decode(token_ids, skip_special_tokens=True))
    jsonschema.validate(value, SCHEMA)
    return value


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), kv_cache_memory=8 << 20)


def test_sampled_answers_validate_over_seeds(llm: LLM) -> None:
    outs = llm.generate([PROMPT] * 6, [_params(seed) for seed in range(6)])
    values = [_valid(llm, o.outputs[0].token_ids) for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)
    assert len({json.dumps(v) for v in values}) > 1  # sampled, not one fixed answer
    again = llm.generate([PROMPT], _params(2))[0].outputs[0].token_ids
    assert again == outs[2].outputs[0].token_ids  # seeded: reproducible whatever the batch
    assert_no_leaks(llm)


def test_parallel_samples_each_follow_the_grammar(llm: LLM) -> None:
    out = llm.generate([PROMPT], _params(7, n=3))[0]
    assert len(out.outputs) == 3
    values = [_valid(llm, c.token_ids) for c in out.outputs]
    assert len({json.dumps(v) for v in values}) > 1
    assert_no_leaks(llm)


def test_preemption_keeps_grammar_and_draws(tiny_llama_dir: Path, llm: LLM) -> None:
    params = [_params(seed, n=2) for seed in range(4)]
    calm = llm.generate([PROMPT] * 4, params)
    small = LLM(str(tiny_llama_dir), num_gpu_blocks=16, num_cpu_blocks=64, preemption_mode="recompute",
                enable_prefix_caching=False)
    squeezed = small.generate([PROMPT] * 4, params)
    assert small.stats()["preemptions"].get("recompute", 0) > 0, "the small pool was meant to force preemption"
    assert [[c.token_ids for c in o.outputs] for o in squeezed] == [[c.token_ids for c in o.outputs] for o in calm]
    for out in squeezed:
        for choice in out.outputs:
            _valid(small, choice.token_ids)
    assert_no_leaks(small)


def test_resume_rebuilds_the_grammar_from_sent_tokens(tiny_llama_dir: Path) -> None:
    from engine.config import EngineConfig

    host = EngineThread()
    host._build(EngineConfig(model=str(tiny_llama_dir), kv_cache_memory=4 << 20, device="cpu"))
    try:
        def run(job: AddJob) -> list[int]:
            tokens: list[int] = []
            result = host.step([job], [])
            while True:
                tokens += [t for out in result.outputs for t in out.outputs[0].token_ids]
                if not host.engine.has_unfinished_requests():
                    return tokens
                result = host.step([], [])

        params = _params(5)
        full = run(AddJob(request_id="so-1", prompt_token_ids=PROMPT, params=params))
        resumed = run(AddJob(request_id="so-1", prompt_token_ids=PROMPT, params=params, generated=full[:7]))
        assert full[:7] + resumed == full
        bad = host.step([AddJob(request_id="so-2", prompt_token_ids=PROMPT, params=params,
                                generated=[0, 0])], [])  # NUL bytes: not JSON
        message, code = bad.rejected["so-2"]
        assert "do not follow the grammar" in message and code == "invalid_parameter"
    finally:
        host.close()


@pytest.mark.parametrize("spec", [
    {"kind": "json_object", "spec": None},
    {"kind": "regex", "spec": "[a-c]{2}-[0-9]{3}"},
    {"kind": "choice", "spec": ["yes", "no", "may\"be"]},
    {"kind": "grammar", "spec": 'start: "(" num ("," num)* ")"\nnum: /[0-9]{1,2}/'},
    {"kind": "grammar", "spec": 'root ::= "x" [0-9] "y"'},
], ids=["json_object", "regex", "choice", "lark", "gbnf"])
def test_every_kind_constrains_the_output(llm: LLM, spec: dict[str, Any]) -> None:
    import re

    params = SamplingParams(temperature=1.0, seed=1, max_tokens=400, structured_output=spec)
    choice = llm.generate([PROMPT], params)[0].outputs[0]
    assert choice.finish_reason == "stop"  # the grammar completed, then only EOS was allowed
    text = llm.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    if spec["kind"] == "json_object":
        assert isinstance(json.loads(text), dict)
    elif spec["kind"] == "regex":
        assert re.fullmatch(spec["spec"], text)
    elif spec["kind"] == "choice":
        assert text in spec["spec"]
    elif "::=" in spec["spec"]:
        assert re.fullmatch(r"x[0-9]y", text)
    else:
        assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", text)


@pytest.mark.parametrize(("spec", "message"), [
    ({"kind": "json_schema", "spec": '{"type": "string", "format": "weird-format"}'}, "weird-format"),
    ({"kind": "json_schema", "spec": "{not json"}, "json_schema"),
    ({"kind": "grammar", "spec": "start: undefined_rule"}, "undefined_rule"),
    ({"kind": "regex", "spec": "(unclosed"}, "regex"),
])
def test_bad_specs_are_refused_before_anything_runs(llm: LLM, spec: dict[str, Any], message: str) -> None:
    """The grammar compiles off the engine thread (issue 41): the engine refuses the request
    once the compile failed (`take_refused`); the offline `generate` waits for it and raises."""
    params = SamplingParams(max_tokens=4, structured_output=spec)
    with pytest.raises(ValueError, match=message):
        llm.generate([PROMPT], params)
    assert_no_leaks(llm)
    llm.engine.add_request("bad-spec", PROMPT, params)
    llm.engine.wait_compiled()
    refused = llm.engine.take_refused()
    assert list(refused) == ["bad-spec"] and message in refused["bad-spec"][0]
    assert refused["bad-spec"][1] == "invalid_parameter"
    assert "bad-spec" not in llm.engine.requests
    assert_no_leaks(llm)
