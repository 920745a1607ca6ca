"""Wire protocol: round-trips, versioning, key names, progress folding, no torch."""

from __future__ import annotations

import subprocess
import sys

import msgpack
import pytest

from common.block_hash import hash_block, prefix_keys
from common.protocol import (
    PROTOCOL_VERSION,
    AbortMessage,
    EngineHeartbeat,
    EngineRequest,
    ErrorInfo,
    Keys,
    OutputMessage,
    ProtocolError,
    SeqOutput,
    TokenLogprob,
    Usage,
    decode_outputs,
    encode_outputs,
    merge_progress,
)
from common.protocol.heartbeat import pack_keys
from common.sampling_params import SamplingParams


def test_keys_follow_prefix() -> None:
    keys = Keys("tst")
    assert keys.requests("smol") == "tst:{m:smol}:requests"  # one stream per served model name
    assert keys.dead("smol") == "tst:{m:smol}:dead"
    assert keys.epoch("smol") == "tst:{m:smol}:epoch"
    assert keys.alive("smol", "e0") == "tst:{m:smol}:alive:e0"
    assert keys.group == "engines"
    assert keys.out("gw1") == "tst:{g:gw1}:out"
    assert keys.gateway("gw1") == "tst:{g:gw1}:gateway"
    assert keys.progress("gw1", "r1") == "tst:{g:gw1}:progress:r1"
    assert keys.abort == "tst:abort"
    assert keys.engine("e0") == "tst:{e:e0}:engine"
    assert keys.engine_pattern == "tst:{e:*}:engine"
    assert Keys().requests("m") == "ps:{m:m}:requests"


def test_a_prefix_with_braces_is_refused() -> None:
    with pytest.raises(ValueError, match="braces"):
        Keys("a{b}")


def test_version_2_fields_round_trip_and_version_1_is_refused() -> None:
    req = EngineRequest(id="r1", gateway="gw", model="m", prompt_token_ids=[1], params=SamplingParams(n=1),
                        arrival=1.0, deadline=2.0, handoffs=2, epoch="abc")
    back = EngineRequest.decode(req.encode())
    assert (back.handoffs, back.epoch, back.deadline) == (2, "abc", 2.0)
    old = msgpack.packb({"v": 1, "id": "r", "gateway": "g", "model": "m", "prompt_token_ids": [1],
                         "params": {}, "arrival": 0.0})
    with pytest.raises(ProtocolError, match="version 1"):
        EngineRequest.decode(old)
    beat = EngineHeartbeat(engine_id="e", model="m", tokenizer="/tok", max_model_len=512, time=1.0, config_hash="h1",
                           vocab_size=320, draining=True)
    again = EngineHeartbeat.from_hash(beat.to_hash())
    assert again.identity() == ("h1", 320, 512) and again.draining


def test_heartbeat_reasoning_parser_round_trips() -> None:
    beat = EngineHeartbeat(engine_id="e", model="m", tokenizer="/tok", max_model_len=512, time=1.0,
                           reasoning_parser="qwen3")
    assert beat.to_hash()["reasoning_parser"] == "qwen3"
    assert EngineHeartbeat.from_hash(beat.to_hash()) == beat
    plain = EngineHeartbeat(engine_id="e", model="m", tokenizer="/tok", max_model_len=512, time=1.0).to_hash()
    assert "reasoning_parser" not in plain and EngineHeartbeat.from_hash(plain).reasoning_parser == ""


def test_heartbeat_routing_fields_round_trip_and_bad_ones_are_refused() -> None:
    keys = [0, 1, 2**64 - 1, hash_block(None, (1, 2, 3))]
    beat = EngineHeartbeat(engine_id="e", model="m", tokenizer="/tok", max_model_len=512, time=1.0, routed=True,
                           block_size=16, cached=keys)
    again = EngineHeartbeat.from_hash(beat.to_hash())
    assert (again.routed, again.block_size, again.cached) == (True, 16, keys)
    plain = EngineHeartbeat.from_hash(EngineHeartbeat(engine_id="e", model="m", tokenizer="/tok", max_model_len=512,
                                                      time=1.0).to_hash())
    assert (plain.routed, plain.block_size, plain.cached) == (False, 0, [])
    for bad in ({"cached": "!!!"}, {"cached": pack_keys([1])[:-4] + "AA=="}, {"block_size": "-1"},
                {"block_size": "0"}):
        fields = beat.to_hash() | bad
        with pytest.raises(ProtocolError):
            EngineHeartbeat.from_hash(fields)


def test_prefix_keys_follow_the_engine_rule() -> None:
    """Every full block but the one holding the last prompt token, chained like the engine."""
    assert prefix_keys([1, 2, 3, 4], 4) == []
    first = hash_block(None, (1, 2, 3, 4))
    assert prefix_keys([1, 2, 3, 4, 5], 4) == [first]
    assert prefix_keys(list(range(1, 10)), 4) == [first, hash_block(first, (5, 6, 7, 8))]


def test_request_round_trip() -> None:
    params = SamplingParams(n=2, temperature=0.5, top_k=4, seed=7, max_tokens=9, stop_token_ids=[2], logprobs=3)
    req = EngineRequest(id="r1", gateway="gw", model="m", prompt_token_ids=[1, 2, 3], params=params, arrival=1.5,
                        deadline=None)
    data = req.encode()
    assert isinstance(data, bytes)
    assert msgpack.unpackb(data)["v"] == PROTOCOL_VERSION
    back = EngineRequest.decode(data)
    assert back == req
    assert back.params == params and isinstance(back.params, SamplingParams)


def test_sampling_params_travel_whole_and_unknown_keys_are_ignored() -> None:
    params = SamplingParams(n=2, best_of=3, temperature=0.5, top_k=4, top_p=0.9, min_p=0.1, seed=7,
                            max_tokens=9, min_tokens=2, stop_token_ids=[2], ignore_eos=True, logprobs=3)
    back = EngineRequest.decode(EngineRequest(id="r", gateway="gw", model="m", prompt_token_ids=[1], params=params,
                                              arrival=0.0).encode())
    assert back.params == params
    assert SamplingParams.from_dict({"n": 3, "unknown": 1}).n == 3


def test_output_batch_round_trip() -> None:
    outs = [
        OutputMessage(id="a", seq=0, outputs=[SeqOutput(index=0, token_ids=[5, 6], offset=0)]),
        OutputMessage(id="b", seq=3, outputs=[SeqOutput(index=1, token_ids=[7], offset=4, finish_reason="stop",
                                         logprobs=[TokenLogprob(-0.5, [(7, -0.5), (8, -1.25)])])],
                      usage=Usage(3, 5)),
        OutputMessage(id="c", seq=1, error=ErrorInfo("prompt too long", "invalid_request_error", "context_length")),
    ]
    assert decode_outputs(encode_outputs(outs)) == outs


@pytest.mark.parametrize("bad", [
    msgpack.packb({"v": 99, "id": "x"}),
    msgpack.packb({"v": PROTOCOL_VERSION, "id": "x"}),
    msgpack.packb([1, 2]),
    b"\xc1",
])
def test_request_rejects_bad_messages(bad: bytes) -> None:
    with pytest.raises(ProtocolError):
        EngineRequest.decode(bad)


def test_output_batch_rejects_wrong_version_and_shape() -> None:
    with pytest.raises(ProtocolError):
        decode_outputs(msgpack.packb([{"v": PROTOCOL_VERSION + 1, "id": "a", "seq": 0, "outputs": []}]))
    with pytest.raises(ProtocolError):
        decode_outputs(msgpack.packb({"id": "a"}))


def test_abort_round_trip() -> None:
    assert AbortMessage.decode(AbortMessage(["a", "b"]).encode()).ids == ["a", "b"]


def test_heartbeat_hash_round_trip_with_bytes() -> None:
    hb = EngineHeartbeat(engine_id="e0", model="smollm2", tokenizer="/models/smol", max_model_len=2048, time=12.5,
                         stats={"kv_free": 10.0})
    raw = {k.encode(): v.encode() for k, v in hb.to_hash().items()}
    assert EngineHeartbeat.from_hash(raw) == hb


def test_merge_progress_dedups_by_offset() -> None:
    entries = [
        OutputMessage(id="r", seq=0, outputs=[SeqOutput(index=0, token_ids=[1, 2], offset=0),
                                              SeqOutput(index=1, token_ids=[9], offset=0)]).encode(),
        # resumed: token 2 repeated
        OutputMessage(id="r", seq=1, outputs=[SeqOutput(index=0, token_ids=[2, 3], offset=1)]).encode(),
        OutputMessage(id="r", seq=2,
                      outputs=[SeqOutput(index=0, token_ids=[4], offset=3, finish_reason="length")]).encode(),
    ]
    progress = merge_progress(entries)
    assert progress.last_seq == 2
    assert progress.token_ids == {0: [1, 2, 3, 4], 1: [9]}
    assert progress.finished == {0: "length"}
    with pytest.raises(ProtocolError):
        merge_progress([OutputMessage(id="r", seq=0, outputs=[SeqOutput(index=0, token_ids=[1], offset=2)]).encode()])


def test_protocol_import_is_torch_free() -> None:
    code = "import sys, engine, common.protocol; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prompt_logprobs_and_cached_tokens_round_trip() -> None:
    message = OutputMessage(id="r", seq=0, outputs=[], usage=Usage(4, 1, cached_tokens=16),
                            prompt_logprobs=[None, TokenLogprob(-1.5, [(7, -0.5)]), TokenLogprob(-0.25)])
    back = OutputMessage.decode(message.encode())
    assert back == message
    assert OutputMessage.decode(OutputMessage(id="r", seq=1).encode()).prompt_logprobs is None
