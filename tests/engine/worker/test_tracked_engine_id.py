"""An engine names itself on the first message it writes for a request (issue 40): that one
carries its id, the rest leave the field out; a request resumed here after a takeover names
this engine again on its first message."""

from __future__ import annotations

from common.protocol import EngineRequest, Progress, decode_outputs, encode_outputs
from common.sampling_params import SamplingParams
from engine.outputs import CompletionOutput, RequestOutput
from engine.worker.tracked import Tracked, error_output, resume, to_wire


def _delta(token: int, finished: bool = False) -> RequestOutput:
    choice = CompletionOutput(index=0, token_ids=[token], finish_reason="length" if finished else None)
    return RequestOutput(request_id="r1", outputs=[choice], finished=finished, num_prompt_tokens=3,
                         num_generated_tokens=1)


def test_the_first_message_names_the_engine_and_the_rest_do_not() -> None:
    request = EngineRequest(id="r1", gateway="gw", model="tiny", prompt_token_ids=[1, 2, 3],
                            params=SamplingParams(max_tokens=3), arrival=0.0)
    tracked = Tracked(request, "1-0", engine="engine-a")
    messages = [to_wire(tracked, _delta(7)), to_wire(tracked, _delta(8)), to_wire(tracked, _delta(9, True))]
    assert [m.engine for m in decode_outputs(encode_outputs(messages))] == ["engine-a", None, None]
    assert Tracked(request, "1-0").engine_id() is None  # no id given: never named


def test_a_resumed_request_names_its_new_engine_first() -> None:
    request = EngineRequest(id="r1", gateway="gw", model="tiny", prompt_token_ids=[1, 2, 3],
                            params=SamplingParams(max_tokens=8), arrival=0.0)
    resumed = resume(request, "2-0", Progress(last_seq=4, token_ids={0: [7, 8]}), engine="engine-b")
    assert resumed is not None
    tracked, _ = resumed
    first, second = to_wire(tracked, _delta(9)), to_wire(tracked, _delta(10))
    assert (first.seq, first.engine, second.engine) == (5, "engine-b", None)
    failing = Tracked(request, "3-0", engine="engine-c")
    assert error_output(failing, "deadline passed", "timeout", "timeout").engine == "engine-c"
