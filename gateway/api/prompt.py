"""A validated request → prompt token ids: the chat template (with tools, natively or through
the fallback system prompt), or the completion prompt; then every token id the request names
(prompt ids, stop_token_ids, logit_bias keys) is checked against the vocabulary, so nothing
out of range reaches msgpack or the engine."""

from __future__ import annotations

from gateway.api.endpoint import Endpoint
from gateway.api.validation import GenerationRequest
from gateway.errors import bad_request
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
    tools = req.tools
    try:
        if tools.active and tokenizer.supports_tools:
            return tokenizer.encode_chat(native_messages(req.messages), tools=tools.tools,
                                         template_args=req.extra_template_args)
        if tools.active:
            instruction = choice_instruction(tools.choice, tools.named, tools.parallel)
            messages = fallback_messages(req.messages, tools.tools, instruction)
        elif tokenizer.supports_tools:
            messages = native_messages(req.messages)
        else:
            messages = fallback_messages(req.messages, None)
        return tokenizer.encode_chat(messages, template_args=req.extra_template_args)
    except TemplateError as exc:
        raise bad_request(str(exc), "messages", "invalid_messages") from exc


def check_vocab(token_ids: list[int], tokenizer: ModelTokenizer, param: str) -> None:
    """400 naming `param` when a token id lies outside [0, vocab_size)."""
    size = tokenizer.vocab_size
    outside = sorted({t for t in token_ids if not 0 <= t < size})
    if outside:
        shown = ", ".join(str(t) if len(str(t)) <= 24 else str(t)[:20] + "..." for t in outside[:5])
        raise bad_request(f"'{param}' has token ids outside the vocabulary [0, {size}): {shown}", param,
                          "token_id_out_of_range")
