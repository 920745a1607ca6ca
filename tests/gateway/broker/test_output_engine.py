"""The serving engine's id on output messages (issue 40): optional on the wire, in both
directions. A gateway reads old-style messages that do not carry it, and the message a new engine
writes differs from the old one by that one key only (an older reader ignores keys it does not
know)."""

from __future__ import annotations

import msgpack
import pytest

from common.protocol import PROTOCOL_VERSION, OutputMessage, ProtocolError, SeqOutput, Usage, decode_outputs
from common.protocol.output import encode_outputs
from gateway.broker.collector import RequestCollector


def _old_style(seq: int, tokens: list[int], offset: int, finish: str | None = None) -> dict[str, object]:
    """An output message as an engine before the field wrote it."""
    return {"v": PROTOCOL_VERSION, "id": "r1", "seq": seq,
            "outputs": [{"index": 0, "offset": offset, "token_ids": tokens, "finish_reason": finish}]}


def test_an_old_style_message_decodes_without_an_engine() -> None:
    (out,) = decode_outputs(msgpack.packb([_old_style(0, [5, 6], 0)]))
    assert out.engine is None and out.outputs[0].token_ids == [5, 6]


def test_the_engine_id_round_trips_and_is_the_only_new_key() -> None:
    named = OutputMessage(id="r1", seq=0, outputs=[SeqOutput(index=0, token_ids=[5, 6], offset=0)], engine="engine-a")
    assert decode_outputs(encode_outputs([named])) == [named]
    obj = named.to_obj()
    assert obj.pop("engine") == "engine-a"
    # nothing else changed
    assert obj == OutputMessage(id="r1", seq=0, outputs=[SeqOutput(index=0, token_ids=[5, 6], offset=0)]).to_obj()
    assert "engine" not in OutputMessage(id="r1", seq=0).to_obj()  # unnamed: the key is left out
    assert "engine" not in named.checkpoint().to_obj()  # progress checkpoints do not carry it


@pytest.mark.parametrize("bad", [7, ["engine-a"], "x" * 70_000])
def test_a_mistyped_engine_id_is_a_protocol_error(bad: object) -> None:
    message = _old_style(0, [5], 0) | {"engine": bad}
    with pytest.raises(ProtocolError, match="engine"):
        decode_outputs(msgpack.packb([message]))


async def test_the_collector_names_the_engine_that_named_itself_last() -> None:
    """None from an old engine; an engine names itself on its first message only; a request
    resumed on another engine names the new one."""
    collector = RequestCollector("r1", 1)
    collector.feed(decode_outputs(msgpack.packb([_old_style(0, [5], 0)]))[0])
    update = await collector.next_update(1.0)
    assert update is not None and update.engine is None and update.choices[0].token_ids == [5]
    collector.feed(OutputMessage(id="r1", seq=1, outputs=[SeqOutput(index=0, token_ids=[6], offset=1)],
                                 engine="engine-a"))
    update = await collector.next_update(1.0)
    assert update is not None and update.engine == "engine-a"
    collector.feed(decode_outputs(msgpack.packb([_old_style(2, [7], 2)]))[0])  # engine-a's later messages
    update = await collector.next_update(1.0)
    assert update is not None and update.engine == "engine-a" and update.choices[0].token_ids == [7]
    # engine-a died; engine-b resumes from the checkpoint, repeating a token the gateway already has
    final = SeqOutput(index=0, token_ids=[7, 8], offset=2, finish_reason="stop")
    collector.feed(OutputMessage(id="r1", seq=3, outputs=[final], usage=Usage(3, 4), engine="engine-b"))
    update = await collector.next_update(1.0)
    assert update is not None and update.engine == "engine-b" and update.done
    assert update.choices[0].token_ids == [8]
