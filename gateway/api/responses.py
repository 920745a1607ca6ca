"""OpenAI response and chunk objects (chat.completion, text_completion, their chunks)."""

from __future__ import annotations

from typing import Any, Protocol

from common.protocol import TokenLogprob, Usage
from gateway.api.endpoint import Endpoint
from gateway.text.tool_parser import ToolCall

ENGINE_HEADER = "x-pagedserve-engine"  # the id of the engine that served a request


class TokenNames(Protocol):
    """How logprobs name tokens: their text (a ModelTokenizer) or `TokenIdNames`."""

    def token_text(self, token_id: int) -> str: ...


class TokenIdNames:
    """vLLM's `return_tokens_as_token_ids`: tokens named ``token_id:<id>``, unambiguous where
    byte-level tokens decode to the same text (partial UTF-8)."""

    def token_text(self, token_id: int) -> str:
        return f"token_id:{token_id}"


def usage_obj(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _token_entry(tokenizer: TokenNames, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: TokenNames, token_ids: list[int], logprobs: list[TokenLogprob],
                  top: int) -> dict[str, Any]:
    """`choices[i].logprobs` of a chat completion: {"content": [...]}."""
    content = []
    for token_id, lp in zip(token_ids, logprobs, strict=False):
        entry = _token_entry(tokenizer, token_id, lp.logprob)
        entry["top_logprobs"] = [_token_entry(tokenizer, t, p) for t, p in lp.top[:top]]
        content.append(entry)
    return {"content": content}


def completion_logprobs(tokenizer: TokenNames, token_ids: list[int], logprobs: list[TokenLogprob],
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


def prompt_completion_logprobs(tokenizer: TokenNames, prompt_ids: list[int],
                               logprobs: list[TokenLogprob | None] | None, top: int) -> dict[str, Any]:
    """The echoed prompt's part of a legacy completion's logprobs: the first token's are null
    (nothing predicts it), as are all when the engine sent none."""
    lps = list(logprobs or [])[:len(prompt_ids)]
    lps += [None] * (len(prompt_ids) - len(lps))
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = 0
    for token_id, lp in zip(prompt_ids, lps, strict=True):
        text = tokenizer.token_text(token_id)
        tokens.append(text)
        token_logprobs.append(None if lp is None else lp.logprob)
        tops.append(None if lp is None or not top else {tokenizer.token_text(t): p for t, p in lp.top[:top]})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def vllm_prompt_logprobs(tokenizer: TokenNames, prompt_ids: list[int],
                         logprobs: list[TokenLogprob | None] | None, top: int) -> list[dict[str, Any] | None]:
    """vLLM's top-level `prompt_logprobs`: per prompt token None (the first) or
    ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` for the token and its top alternatives
    (`rank` is the position among the alternatives, None when the token is not among them)."""
    out: list[dict[str, Any] | None] = []
    lps = list(logprobs or [])
    for i, token_id in enumerate(prompt_ids):
        lp = lps[i] if i < len(lps) else None
        if lp is None:
            out.append(None)
            continue
        ranks = {t: r + 1 for r, (t, _) in enumerate(lp.top[:top])}
        entry = {str(token_id): {"logprob": lp.logprob, "rank": ranks.get(token_id),
                                 "decoded_token": tokenizer.token_text(token_id)}}
        for t, p in lp.top[:top]:
            entry.setdefault(str(t), {"logprob": p, "rank": ranks[t], "decoded_token": tokenizer.token_text(t)})
        out.append(entry)
    return out


def reasoning_fields(reasoning: str | None) -> dict[str, Any]:
    """The thinking of a chat message or delta under both of vLLM's names: `reasoning_content`
    and the newer `reasoning`."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}


def tool_call_obj(call: ToolCall) -> dict[str, Any]:
    """An OpenAI `tool_calls` entry of a chat message."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_deltas(call: ToolCall, index: int) -> list[dict[str, Any]]:
    """A call as OpenAI streams it: id, type and name (empty arguments) first, then the arguments."""
    return [{"tool_calls": [{"index": index, "id": call.id, "type": "function",
                             "function": {"name": call.name, "arguments": ""}}]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict[str, Any],
               finish_reason: str | None = None, logprobs: dict[str, Any] | None = None,
               include_usage: bool = False, fingerprint: str | None = None) -> dict[str, Any]:
    """`fingerprint` (here and below): `system_fingerprint`, which names the serving engine
    (`Generation.system_fingerprint`); None until one is known."""
    chunk: dict[str, Any] = {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "system_fingerprint": fingerprint,
        "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     finish_reason: str | None = None, logprobs: dict[str, Any] | None = None,
                     include_usage: bool = False, fingerprint: str | None = None) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "system_fingerprint": fingerprint,
        "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
    }
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(kind: Endpoint, rid: str, created: int, model: str, usage: Usage,
                fingerprint: str | None = None) -> dict[str, Any]:
    """The last chunk with stream_options.include_usage: empty choices, the usage."""
    return {"id": rid, "object": kind.chunk_object, "created": created, "model": model,
            "system_fingerprint": fingerprint, "choices": [], "usage": usage_obj(usage)}


def full_response(kind: Endpoint, rid: str, created: int, model: str, choices: list[dict[str, Any]],
                  usage: Usage, fingerprint: str | None = None) -> dict[str, Any]:
    """A non-streaming chat.completion or text_completion."""
    return {"id": rid, "object": kind.object, "created": created, "model": model,
            "system_fingerprint": fingerprint, "choices": choices, "usage": usage_obj(usage)}
