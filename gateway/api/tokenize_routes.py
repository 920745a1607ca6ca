"""POST /tokenize and POST /detokenize in vLLM's shapes:
``{model, prompt, add_special_tokens=true}`` or ``{model, messages, add_generation_prompt=true,
chat_template_kwargs, tools}`` → ``{count, max_model_len, tokens, token_strs}``, and
``{model, tokens}`` → ``{prompt}``. Chat messages go through the same template path as
/v1/chat/completions (tools included), so the counts agree."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.api.body import read_json
from gateway.api.endpoint import Endpoint
from gateway.api.fields import as_bool, parse_prompt
from gateway.api.messages import parse_messages
from gateway.api.offload import off_loop
from gateway.api.openai_routes import find_model
from gateway.api.prompt import chat_ids, check_vocab
from gateway.api.tools import parse_tools
from gateway.api.validation import GenerationRequest, template_kwargs
from gateway.errors import bad_request
from gateway.state import REGISTRY
from gateway.text.tokenizer import ModelTokenizer, TemplateError


async def _model_body(request: web.Request) -> tuple[dict[str, Any], ModelTokenizer, int]:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_type")
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise bad_request("'model' must be a non-empty string", "model", "invalid_type")
    model = await find_model(request, name)
    return body, await request.app[REGISTRY].tokenizer(model), model.max_model_len


def _chat_tokens(body: dict[str, Any], tok: ModelTokenizer) -> list[int]:
    req = GenerationRequest(kind=Endpoint.CHAT, model=body["model"], messages=parse_messages(body["messages"]),
                            extra_template_args=template_kwargs(body), tools=parse_tools(body))
    if not as_bool(body, "add_generation_prompt", True):
        try:  # the one variation /v1/chat/completions never needs
            return tok.encode_chat(req.messages, template_args=req.extra_template_args, add_generation_prompt=False)
        except TemplateError as exc:
            raise bad_request(str(exc), "messages", "invalid_messages") from exc
    return chat_ids(req, tok)


async def tokenize(request: web.Request) -> web.Response:
    body, tok, max_model_len = await _model_body(request)
    if ("prompt" in body) == ("messages" in body):
        raise bad_request("give exactly one of 'prompt' and 'messages'", "prompt")
    tokens, strs = await off_loop(request.app, _tokenize, body, tok)
    return web.json_response({"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens,
                              "token_strs": strs})


def _tokenize(body: dict[str, Any], tok: ModelTokenizer) -> tuple[list[int], list[str] | None]:
    """The body's token ids (and their texts when asked); runs off the event loop."""
    if "messages" in body:
        tokens = _chat_tokens(body, tok)
    else:
        prompt = parse_prompt(body["prompt"])
        if not isinstance(prompt, str):
            raise bad_request("'prompt' must be a string", "prompt", "invalid_type")
        tokens = tok.encode(prompt, add_special_tokens=as_bool(body, "add_special_tokens", True))
    strs = [tok.token_text(t) for t in tokens] if as_bool(body, "return_token_strs", False) else None
    return tokens, strs


async def detokenize(request: web.Request) -> web.Response:
    body, tok, _ = await _model_body(request)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise bad_request("'tokens' must be a list of token ids", "tokens", "invalid_type")
    check_vocab(tokens, tok, "tokens")
    return web.json_response({"prompt": await off_loop(request.app, tok.decode, tokens)})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
