"""A validated request → prompt token ids: the chat template (with tools, natively or through
the fallback system prompt), or the completion prompt; then every token id the request names
(prompt ids, stop_token_ids, logit_bias keys) is checked against the vocabulary, so nothing
out of range reaches msgpack or the engine."""

from __future__ import annotations

from typing import Any

from gateway.api.endpoint import Endpoint
from gateway.api.validation import GenerationRequest
from gateway.errors import bad_request
from gateway.text.reasoning import prompt_start
from gateway.text.tokenizer import ModelTokenizer, TemplateError
from gateway.text.tool_prompt import choice_instruction, fallback_messages, native_messages


def prompt_ids(req: GenerationRequest, tokenizer: ModelTokenizer) -> list[int]:
    """Token ids of the request's prompt; also stored in `req.prompt_token_ids`."""
    if req.kind is Endpoint.CHAT:
        ids = chat_ids(req, tokenizer)
    elif isinstance(req.prompt, list):
        check_vocab(req.prompt, tokenizer, "prompt")
        ids = req.prompt
    else:
        ids = tokenizer.encode(req.prompt)
    check_vocab(req.params.stop_token_ids, tokenizer, "stop_token_ids")
    check_vocab(list(req.params.logit_bias), tokenizer, "logit_bias")
    req.prompt_token_ids = ids
    return ids


def chat_ids(req: GenerationRequest, tokenizer: ModelTokenizer) -> list[int]:
    """Prompt ids of a chat request; with a reasoning parser also `req.reasoning_start`, from the
    text the template appends for the answer (it may open or close the thinking)."""
    try:
        messages, tools = _template_input(req, tokenizer)
        if req.reasoning_parser is None:
            return tokenizer.encode_chat(messages, tools=tools, template_args=req.extra_template_args)
        text, added = tokenizer.render_with_answer_prefix(messages, tools=tools, template_args=req.extra_template_args)
        req.reasoning_start = prompt_start(added)
        return tokenizer.encode(text, add_special_tokens=False)  # as encode_chat does
    except TemplateError as exc:
        raise bad_request(str(exc), "messages", "invalid_messages") from exc


def _template_input(req: GenerationRequest, tokenizer: ModelTokenizer) -> tuple[list[dict[str, Any]],
                                                                               list[dict[str, Any]] | None]:
    """The messages and tools the chat template renders: tools natively, or through the fallback
    system prompt."""
    tools = req.tools
    if tools.active and tokenizer.supports_tools:
        return native_messages(req.messages), tools.tools
    if tools.active:
        instruction = choice_instruction(tools.choice, tools.named, tools.parallel)
        return fallback_messages(req.messages, tools.tools, instruction), None
    if tokenizer.supports_tools:
        return native_messages(req.messages), None
    return fallback_messages(req.messages, None), None


def check_vocab(token_ids: list[int], tokenizer: ModelTokenizer, param: str) -> None:
    """400 naming `param` when a token id lies outside [0, vocab_size)."""
    size = tokenizer.vocab_size
    outside = sorted({t for t in token_ids if not 0 <= t < size})
    if outside:
        shown = ", ".join(str(t) if len(str(t)) <= 24 else str(t)[:20] + "..." for t in outside[:5])
        raise bad_request(f"'{param}' has token ids outside the vocabulary [0, {size}): {shown}", param,
                          "token_id_out_of_range")
