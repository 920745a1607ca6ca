"""Pooling on the wire: `PoolingParams` round-trips inside `EngineRequest` (absent for generation),
the pooled vector inside `OutputMessage`, and bad values decode only to ProtocolError."""

from __future__ import annotations

import struct

import pytest

from common.pooling_params import PoolingParamError, PoolingParams, embedding_floats
from common.protocol import EngineRequest, OutputMessage, ProtocolError, SeqOutput
from common.protocol.fields import pack, unpack
from common.sampling_params import SamplingParams


def _request(pooling: PoolingParams | None) -> EngineRequest:
    return EngineRequest(id="r1", gateway="gw", model="m", prompt_token_ids=[1, 2, 3],
                         params=SamplingParams(max_tokens=1), arrival=1.0, pooling=pooling)


def test_pooling_round_trips_and_generation_carries_none() -> None:
    pooling = PoolingParams(dimensions=32, normalize=False)
    assert EngineRequest.decode(_request(pooling).encode()).pooling == pooling
    plain = _request(None).encode()
    assert "pooling" not in unpack(plain)
    assert EngineRequest.decode(plain).pooling is None


@pytest.mark.parametrize("bad", [{"dimensions": 0}, {"dimensions": True}, {"dimensions": "8"},
                                 {"normalize": 1}, {"pooling_type": "MAX"}, {"other": 1}, [1]])
def test_bad_pooling_decodes_to_protocol_error(bad: object) -> None:
    obj = unpack(_request(None).encode())
    obj["pooling"] = bad
    with pytest.raises(ProtocolError):
        EngineRequest.decode(pack(obj))


def test_params_validate() -> None:
    with pytest.raises(PoolingParamError) as err:
        PoolingParams(dimensions=-3).validate()
    assert err.value.param == "dimensions"
    PoolingParams(dimensions=8, normalize=True, pooling_type="MEAN").validate()


def test_embedding_round_trips_as_float32_bytes() -> None:
    vector = struct.pack("<3f", 0.5, -1.25, 3.0)
    out = OutputMessage(id="r1", seq=0, outputs=[SeqOutput(index=0, token_ids=[], offset=0, finish_reason="stop")],
                        embedding=vector)
    back = OutputMessage.decode(out.encode())
    assert back.embedding == vector and embedding_floats(back.embedding) == [0.5, -1.25, 3.0]
    assert OutputMessage.decode(OutputMessage(id="r1", seq=0).encode()).embedding is None
    assert out.checkpoint().embedding is None  # progress keeps tokens and finish state only


@pytest.mark.parametrize("bad", [b"abc", "text", [1.0, 2.0], 7])
def test_bad_embedding_decodes_to_protocol_error(bad: object) -> None:
    obj = OutputMessage(id="r1", seq=0).to_obj()
    obj["embedding"] = bad
    with pytest.raises(ProtocolError):
        OutputMessage.from_obj(obj)
