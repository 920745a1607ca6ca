"""OpenAI request bodies → a validated `GenerationRequest`, or OpenAIError(400).

Unknown fields are ignored (as vLLM does); fields we cannot honour (images, audio, the legacy
`functions`, `suffix`) are rejected instead of silently ignored."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from common.sampling_params import ParamError, SamplingParams
from gateway.api.endpoint import Endpoint
from gateway.api.fields import (
    as_bool,
    as_float,
    as_int,
    opt_int,
    parse_logit_bias,
    parse_prompt,
    parse_stop,
    reject_unsupported,
    token_id_list,
)
from gateway.api.messages import parse_messages
from gateway.api.structured import parse_structured
from gateway.api.tools import ToolConfig, parse_tools
from gateway.config import GatewayConfig
from gateway.errors import OpenAIError, bad_request
from gateway.text.tokenizer import RESERVED_TEMPLATE_ARGS


@dataclass(slots=True)
class GenerationRequest:
    """A chat or completion request after validation."""

    kind: Endpoint
    model: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt: str | list[int] = ""
    params: SamplingParams = field(default_factory=SamplingParams)
    max_tokens_given: bool = False
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    top_logprobs: int | None = None  # None: no logprobs; k: k alternatives per token
    extra_template_args: dict[str, Any] = field(default_factory=dict)
    tools: ToolConfig = field(default_factory=ToolConfig)
    structured_param: str | None = None  # the body field the output constraint came from
    echo: bool = False  # completions: the prompt goes before each choice's text
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    prompt_token_ids: list[int] = field(default_factory=list)  # set once tokenized


def _require_object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_type")
    return body


def _model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise bad_request("'model' is required", "model", "missing_required_parameter")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' must be a non-empty string", "model", "invalid_type")
    return model


def _logprobs(body: dict[str, Any], kind: Endpoint, cfg: GatewayConfig) -> int | None:
    if kind is Endpoint.COMPLETION:
        return opt_int(body, "logprobs", 0, cfg.max_top_logprobs)
    wanted = as_bool(body, "logprobs", False)
    top = opt_int(body, "top_logprobs", 0, cfg.max_top_logprobs)
    if top is not None and not wanted:
        raise bad_request("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = as_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options", "invalid_type")
    if not stream:
        raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")
    return stream, as_bool(options, "include_usage", False, prefix="stream_options.")


def _params(body: dict[str, Any], kind: Endpoint, cfg: GatewayConfig, logprobs: int | None
            ) -> tuple[SamplingParams, bool]:
    """The engine's SamplingParams (its own checks run too: a ParamError becomes a 400), and
    whether max_tokens was given."""
    n = as_int(body, "n", 1, 1, cfg.max_n)
    best_of = opt_int(body, "best_of", 1, cfg.max_n) if kind is Endpoint.COMPLETION else None
    name = "max_completion_tokens" if kind is Endpoint.CHAT and "max_completion_tokens" in body else "max_tokens"
    max_tokens = opt_int(body, name, 1, cfg.max_tokens_limit)
    min_tokens = as_int(body, "min_tokens", 0, 0, cfg.max_tokens_limit)
    if max_tokens is not None and min_tokens > max_tokens:
        raise bad_request("'min_tokens' must not exceed 'max_tokens'", "min_tokens")
    top_k = as_int(body, "top_k", -1, -1, 1 << 20)
    try:
        params = SamplingParams(
            n=n, best_of=best_of, use_beam_search=as_bool(body, "use_beam_search", False),
            length_penalty=as_float(body, "length_penalty", 1.0, -10.0, 10.0),
            temperature=as_float(body, "temperature", 1.0, 0.0, 2.0),
            top_p=as_float(body, "top_p", 1.0, 0.0, 1.0, open_low=True),
            top_k=-1 if top_k == 0 else top_k, min_p=as_float(body, "min_p", 0.0, 0.0, 1.0),
            seed=opt_int(body, "seed", -(1 << 63), (1 << 64) - 1),
            # without max_tokens, check_context fills in the default once the prompt is known
            max_tokens=max_tokens or cfg.max_tokens_limit, min_tokens=min_tokens,
            stop_token_ids=token_id_list(body, "stop_token_ids"), ignore_eos=as_bool(body, "ignore_eos", False),
            logprobs=logprobs, presence_penalty=as_float(body, "presence_penalty", 0.0, -2.0, 2.0),
            frequency_penalty=as_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
            repetition_penalty=as_float(body, "repetition_penalty", 1.0, 0.0, 1e6, open_low=True),
            logit_bias=parse_logit_bias(body.get("logit_bias")), prompt_logprobs=_prompt_logprobs(body, kind, cfg),
        )
    except ParamError as exc:
        raise bad_request(str(exc), exc.param) from exc
    return params, max_tokens is not None


def _prompt_logprobs(body: dict[str, Any], kind: Endpoint, cfg: GatewayConfig) -> int | None:
    """vLLM's `prompt_logprobs` extra; for completions `echo` with `logprobs` asks for them too."""
    given = opt_int(body, "prompt_logprobs", 0, cfg.max_top_logprobs)
    if given is None and kind is Endpoint.COMPLETION and as_bool(body, "echo", False):
        return opt_int(body, "logprobs", 0, cfg.max_top_logprobs)
    return given


def template_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """`chat_template_kwargs`: an object that does not override what the gateway passes."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs", "invalid_type")
    clash = sorted(RESERVED_TEMPLATE_ARGS & kwargs.keys())
    if clash:
        raise bad_request(f"'chat_template_kwargs' may not set {clash}: the gateway passes them",
                          "chat_template_kwargs", "reserved_name")
    return kwargs


def _constraint(body: dict[str, Any], req: GenerationRequest) -> None:
    """One output constraint at most: response_format / guided_* / structured_outputs, or the
    grammar of a required or named tool call."""
    structured, param = parse_structured(body)
    from_tools = req.tools.structured_output()
    if structured is not None and from_tools is not None:
        raise bad_request(f"'{param}' cannot be combined with tool_choice '{req.tools.choice}'", param)
    if from_tools is not None:
        structured, param = from_tools, "tools"
    if structured is None:
        return
    try:
        req.params = replace(req.params, structured_output=structured)
    except ParamError as exc:
        raise bad_request(str(exc), param) from exc
    req.structured_param = param


def parse_request(body: Any, kind: Endpoint, cfg: GatewayConfig) -> GenerationRequest:
    """Validate a /v1/chat/completions or /v1/completions body (the output constraint's grammar
    is checked by `structured.check_structured`, off the event loop)."""
    body = _require_object(body)
    model = _model(body)
    reject_unsupported(body, kind)
    req = GenerationRequest(kind=kind, model=model)
    if kind is Endpoint.CHAT:
        req.messages = parse_messages(body.get("messages"))
        req.extra_template_args = template_kwargs(body)
        req.tools = parse_tools(body)
    else:
        req.prompt = parse_prompt(body.get("prompt"))
        req.echo = as_bool(body, "echo", False)
    req.top_logprobs = _logprobs(body, kind, cfg)
    req.tokens_as_ids = as_bool(body, "return_tokens_as_token_ids", False)
    req.params, req.max_tokens_given = _params(body, kind, cfg, req.top_logprobs)
    _constraint(body, req)
    req.stop = parse_stop(body.get("stop"), cfg.max_stop_strings, cfg.max_stop_length)
    req.stream, req.include_usage = _stream(body)
    if req.stream and req.params.best_of is not None and req.params.best_of > req.params.n:
        raise bad_request("'best_of' greater than 'n' cannot be streamed", "best_of")
    if req.params.use_beam_search and req.stream:
        raise bad_request("beam search cannot be streamed", "use_beam_search")
    if req.stream and req.params.prompt_logprobs is not None and not req.echo:
        raise bad_request("'prompt_logprobs' cannot be streamed (with completions, use 'echo' and 'logprobs')",
                          "prompt_logprobs")
    return req


def check_context(req: GenerationRequest, prompt_len: int, max_model_len: int, cfg: GatewayConfig) -> None:
    """Fit prompt + max_tokens into the model's context; fills in the default max_tokens."""
    if prompt_len == 0:
        raise bad_request("the prompt is empty", req.kind.prompt_param)
    if max_model_len <= 0:
        return
    room = max_model_len - prompt_len
    if room <= 0:
        raise OpenAIError(400, f"the prompt has {prompt_len} tokens; this model's context is {max_model_len}",
                          req.kind.prompt_param, "context_length_exceeded")
    if not req.max_tokens_given:
        default = min(room, cfg.max_tokens_limit) if req.kind is Endpoint.CHAT else min(16, room)
        if req.params.min_tokens > default:
            raise bad_request(f"'min_tokens' {req.params.min_tokens} exceeds the default max_tokens {default}",
                              "min_tokens")
        req.params = replace(req.params, max_tokens=default)
    elif req.params.max_tokens > room:
        raise OpenAIError(400, f"max_tokens {req.params.max_tokens} + prompt {prompt_len} tokens exceeds the "
                          f"context length {max_model_len}", "max_tokens", "context_length_exceeded")
