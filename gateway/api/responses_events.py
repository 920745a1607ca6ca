"""Output items and streaming events of a /v1/responses response, built from `Step`s.

`OutputBuilder` keeps the output list and returns, for each step, the events a stream sends
(each with its `sequence_number`); a whole response uses the same builder and drops the events,
so streamed and whole outputs are the same items. Items in order: a `reasoning` item (with
`summary: []` and its text as `reasoning_text` content) when the model reasoned, a `message`
item with one `output_text` part when it wrote text, a `function_call` item per call. An item
opens at its first delta and closes when another kind starts or the response ends."""

from __future__ import annotations

import time
import uuid
from typing import Any

from common.protocol import Usage
from gateway.api.responses_output import Step
from gateway.text.tool_parser import ToolCall

Event = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_obj(usage: Usage, reasoning_tokens: int = 0) -> dict[str, Any]:
    """The Responses API's `usage`."""
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def response_object(rid: str, echo: dict[str, Any], status: str, output: list[dict[str, Any]],
                    usage: dict[str, Any] | None, store: bool, created_at: int | None = None,
                    error: dict[str, Any] | None = None) -> dict[str, Any]:
    """A `response` object; `echo` holds the request fields it repeats."""
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": rid, "object": "response", "created_at": created_at or int(time.time()), "status": status,
            "error": error, "incomplete_details": incomplete, "output": output, "usage": usage, "store": store,
            "background": False, "user": None, **echo}


class OutputBuilder:
    """The output items of one response and the events that build them (see the module docstring)."""

    def __init__(self, first_seq: int = 0) -> None:
        self.output: list[dict[str, Any]] = []
        self.seq = first_seq
        self._open: dict[str, Any] | None = None  # the reasoning or message item still growing
        self._text = ""

    def event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def step(self, step: Step) -> list[Event]:
        events = []
        if step.reasoning:
            events += self._delta("reasoning", step.reasoning)
        if step.text:
            events += self._delta("message", step.text)
        for call in step.calls:
            events += self._call(call)
        return events

    def finish(self, incomplete: bool) -> list[Event]:
        """Close the open item; an answer with neither text nor calls still gets its (empty) message."""
        events = [] if self.output else self._open_item("message")
        return events + self._close("incomplete" if incomplete else "completed")

    @property
    def text(self) -> str:
        """The answer's text: what every `message` item says."""
        return "".join(p["text"] for item in self.output if item["type"] == "message" for p in item["content"])

    def _delta(self, kind: str, delta: str) -> list[Event]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self._close("completed")
            events += self._open_item(kind)
        assert self._open is not None
        self._text += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        events.append(self.event(name, item_id=self._open["id"], output_index=len(self.output) - 1,
                                 content_index=0, delta=delta, **extra))
        return events

    def _open_item(self, kind: str) -> list[Event]:
        if kind == "reasoning":
            item: dict[str, Any] = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                                    "status": "in_progress"}
        else:
            item = {"id": new_id("msg"), "type": "message", "role": "assistant", "content": [],
                    "status": "in_progress"}
        self.output.append(item)
        self._open, self._text = item, ""
        index = len(self.output) - 1
        return [self.event("response.output_item.added", output_index=index, item=_copy(item)),
                self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                           part=self._part(kind, ""))]

    def _close(self, status: str) -> list[Event]:
        item, text = self._open, self._text
        if item is None:
            return []
        self._open, self._text = None, ""
        index, part = len(self.output) - 1, self._part(item["type"], text)
        item["content"], item["status"] = [part], status
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            done = self.event("response.reasoning_text.done", **where, text=text)
        else:
            done = self.event("response.output_text.done", **where, text=text, logprobs=[])
        return [done, self.event("response.content_part.done", **where, part=_copy(part)),
                self.event("response.output_item.done", output_index=index, item=_copy(item))]

    def _call(self, call: ToolCall) -> list[Event]:
        events = self._close("completed")
        item = {"id": new_id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
                "arguments": "", "status": "in_progress"}
        self.output.append(item)
        index = len(self.output) - 1
        where = {"item_id": item["id"], "output_index": index}
        events.append(self.event("response.output_item.added", output_index=index, item=_copy(item)))
        events.append(self.event("response.function_call_arguments.delta", **where, delta=call.arguments))
        item["arguments"], item["status"] = call.arguments, "completed"
        events.append(self.event("response.function_call_arguments.done", **where, name=call.name,
                                 arguments=call.arguments))
        events.append(self.event("response.output_item.done", output_index=index, item=_copy(item)))
        return events

    @staticmethod
    def _part(kind: str, text: str) -> dict[str, Any]:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _copy(obj: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item or part as it is now (it keeps growing after the event)."""
    return {k: list(v) if isinstance(v, list) else v for k, v in obj.items()}
