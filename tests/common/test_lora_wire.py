"""The LoRA fields on the wire: a request's adapter name round-trips (an older message without it
is a base-model request), a heartbeat's adapter list is checked, and adapter prefix keys differ
from the base model's and from each other's."""

from __future__ import annotations

import json

import pytest

from common.block_hash import adapter_root, prefix_keys
from common.protocol import EngineHeartbeat, EngineRequest, ProtocolError
from common.protocol.fields import pack, unpack
from common.sampling_params import SamplingParams


def test_request_carries_its_adapter() -> None:
    request = EngineRequest(id="r1", gateway="g1", model="base", prompt_token_ids=[1, 2, 3],
                            params=SamplingParams(max_tokens=4), arrival=1.0, lora_name="sql")
    assert EngineRequest.decode(request.encode()).lora_name == "sql"
    older = unpack(request.encode())
    del older["lora_name"]
    assert EngineRequest.decode(pack(older)).lora_name == ""


def test_heartbeat_adapters_must_be_names() -> None:
    sent = EngineHeartbeat(engine_id="e1", model="m", tokenizer="/tok", max_model_len=512, time=1.0,
                           loras=["a"], lora_errors={"b": "no folder"})
    fields = sent.to_hash()
    got = EngineHeartbeat.from_hash(fields)
    assert (got.loras, got.lora_errors) == (["a"], {"b": "no folder"})
    for bad in ([1], "a", [""], {"a": 1}):
        with pytest.raises(ProtocolError):
            EngineHeartbeat.from_hash({**fields, "loras": json.dumps(bad)})
    for bad_errors in (["b"], {"b": 1}):
        with pytest.raises(ProtocolError):
            EngineHeartbeat.from_hash({**fields, "lora_errors": json.dumps(bad_errors)})


def test_adapter_keys_are_apart() -> None:
    tokens = list(range(64))
    assert adapter_root(None) is None and adapter_root("") is None
    keys = {name: prefix_keys(tokens, 16, name) for name in (None, "a", "b")}
    assert len({k for ks in keys.values() for k in ks}) == 3 * 3
    assert keys[None] == prefix_keys(tokens, 16)
