"""The /v1/embeddings body: every accepted `input` shape, and a 400 naming the field for the rest."""

from __future__ import annotations

from typing import Any

import pytest

from common.pooling_params import PoolingParams
from gateway.api.embedding_request import MAX_INPUTS, parse_embedding_request
from gateway.errors import OpenAIError


@pytest.mark.parametrize(("raw", "inputs"), [
    ("hi", ["hi"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
    (["a", [4]], ["a", [4]]),
])
def test_input_shapes(raw: Any, inputs: list[Any]) -> None:
    req = parse_embedding_request({"model": "m", "input": raw})
    assert req.inputs == inputs and req.encoding_format == "float" and req.pooling == PoolingParams()


def test_options() -> None:
    req = parse_embedding_request({"model": "m", "input": "x", "encoding_format": "base64", "dimensions": 8,
                                   "normalize": False, "user": "u"})
    assert req.encoding_format == "base64" and req.pooling == PoolingParams(8, False)


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "input": []}, "input"), ({"model": "m", "input": ""}, "input"),
    ({"model": "m", "input": [[]]}, "input"), ({"model": "m", "input": [1, "a"]}, "input"),
    ({"model": "m", "input": [True]}, "input"), ({"model": "m", "input": None}, "input"),
    ({"model": "m", "input": ["x"] * (MAX_INPUTS + 1)}, "input"), ({"model": "m"}, "input"),
    ({"input": "x"}, "model"), ({"model": "m", "input": "x", "encoding_format": "int8"}, "encoding_format"),
    ({"model": "m", "input": "x", "dimensions": 0}, "dimensions"),
    ({"model": "m", "input": "x", "dimensions": 1.5}, "dimensions"),
    ({"model": "m", "input": "x", "normalize": "yes"}, "normalize"),
    ({"model": "m", "input": "x", "temperature": 1}, "temperature"),
])
def test_bad_bodies_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as err:
        parse_embedding_request(body)
    assert err.value.status == 400 and err.value.param == param
