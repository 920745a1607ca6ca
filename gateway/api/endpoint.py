"""The two generation endpoints and what differs between their OpenAI shapes."""

from __future__ import annotations

import enum


class Endpoint(enum.Enum):
    """`/v1/chat/completions` (CHAT) or the legacy `/v1/completions` (COMPLETION)."""

    CHAT = "chat"
    COMPLETION = "completion"

    @property
    def id_prefix(self) -> str:
        return "chatcmpl-" if self is Endpoint.CHAT else "cmpl-"

    @property
    def object(self) -> str:
        """`object` of a whole response."""
        return "chat.completion" if self is Endpoint.CHAT else "text_completion"

    @property
    def chunk_object(self) -> str:
        """`object` of a streamed chunk."""
        return "chat.completion.chunk" if self is Endpoint.CHAT else "text_completion"

    @property
    def prompt_param(self) -> str:
        """The body field that carries the prompt (named in context-length errors)."""
        return "messages" if self is Endpoint.CHAT else "prompt"
