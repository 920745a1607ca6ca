"""OpenAI response and chunk objects (chat.completion, text_completion, their chunks)."""

from __future__ import annotations

from typing import Any

from engine.protocol import TokenLogprob, Usage
from gateway.api.endpoint import Endpoint
from gateway.text.tokenizer import ModelTokenizer


def usage_obj(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _token_entry(tokenizer: ModelTokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: ModelTokenizer, token_ids: list[int], logprobs: list[TokenLogprob],
                  top: int) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion: {"content": [...]}."""
    content = []
    for token_id, lp in zip(token_ids, logprobs, strict=False):
        entry = _token_entry(tokenizer, token_id, lp.logprob)
        entry["top_logprobs"] = [_token_entry(tokenizer, t, p) for t, p in lp.top[:top]]
        content.append(entry)
    return {"content": content}


def completion_logprobs(tokenizer: ModelTokenizer, token_ids: list[int], logprobs: list[TokenLogprob],
                        top: int, text_offset: int) -> dict[str, Any]:
    """`choices[i].logprobs` of a legacy completion: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, lp in zip(token_ids, logprobs, strict=False):
        text = tokenizer.token_text(token_id)
        tokens.append(text)
        token_logprobs.append(lp.logprob)
        tops.append({tokenizer.token_text(t): p for t, p in lp.top[:top]} if top else None)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict[str, Any],
               finish_reason: str | None = None, logprobs: dict[str, Any] | None = None,
               include_usage: bool = False) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "system_fingerprint": None,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     finish_reason: str | None = None, logprobs: dict[str, Any] | None = None,
                     include_usage: bool = False) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "system_fingerprint": None,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(kind: Endpoint, rid: str, created: int, model: str, usage: Usage) -> dict[str, Any]:
    """The last chunk with stream_options.include_usage: empty choices, the usage."""
    return {"id": rid, "object": kind.chunk_object, "created": created, "model": model, "system_fingerprint": None,
            "choices": [], "usage": usage_obj(usage)}


def full_response(kind: Endpoint, rid: str, created: int, model: str, choices: list[dict[str, Any]],
                  usage: Usage) -> dict[str, Any]:
    """A non-streaming chat.completion or text_completion."""
    return {"id": rid, "object": kind.object, "created": created, "model": model, "system_fingerprint": None,
            "choices": choices, "usage": usage_obj(usage)}
