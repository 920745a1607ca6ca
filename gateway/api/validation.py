"""OpenAI request bodies → a validated `GenerationRequest`, or OpenAIError(400).

Unknown fields are ignored (as vLLM does); fields we cannot honour (images, audio, the legacy
`functions`, `suffix`) are rejected instead of silently ignored."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from common.sampling_params import BODY_FIELDS, ParamError, SamplingParams, check_limits
from gateway.api.endpoint import Endpoint
from gateway.api.fields import as_bool, parse_logit_bias, parse_prompt, parse_stop, reject_unsupported
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
    # chat on a model with a reasoning parser (set once the model is known): its name, and where the
    # output starts as the chat template left it (gateway/text/reasoning.py `prompt_start`)
    reasoning_parser: str | None = None
    reasoning_start: str = "model"


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


def _logprobs(body: dict[str, Any], kind: Endpoint) -> Any:
    """The count of alternatives per token (unchecked: SamplingParams' `logprobs` rule), None for none."""
    if kind is Endpoint.COMPLETION:
        return body.get("logprobs")
    wanted = as_bool(body, "logprobs", False)
    top = body.get("top_logprobs")
    if top is not None and not wanted:
        raise bad_request("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    return (0 if top is None else top) if wanted else None


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


def _params(body: dict[str, Any], kind: Endpoint, cfg: GatewayConfig) -> tuple[SamplingParams, bool]:
    """The engine's SamplingParams from the body, and whether max_tokens was given. Every rule is
    SamplingParams' own (`common.sampling_params`) and the server's caps `check_limits`; the
    gateway only finds the values and turns a ParamError into a 400 naming the body's field."""
    name = "max_completion_tokens" if kind is Endpoint.CHAT and "max_completion_tokens" in body else "max_tokens"
    body_names = {"max_tokens": name, "logprobs": "logprobs" if kind is Endpoint.COMPLETION else "top_logprobs"}
    max_tokens = body.get(name)
    given = {key: body[key] for key in BODY_FIELDS if body.get(key) is not None}
    try:
        params = SamplingParams(
            **given, n=_or(body.get("n"), 1), best_of=body.get("best_of") if kind is Endpoint.COMPLETION else None,
            # without max_tokens, check_context fills in the default once the prompt is known
            max_tokens=_or(max_tokens, cfg.max_tokens_limit), logprobs=_logprobs(body, kind),
            logit_bias=parse_logit_bias(body.get("logit_bias")), prompt_logprobs=_prompt_logprobs(body, kind),
        )
        check_limits(params, cfg.max_n, cfg.max_tokens_limit, cfg.max_top_logprobs)
    except ParamError as exc:
        raise bad_request(str(exc), body_names.get(exc.param, exc.param), exc.code) from exc
    return params, max_tokens is not None


def _or(value: Any, default: Any) -> Any:
    """JSON's null is the default."""
    return default if value is None else value


def _prompt_logprobs(body: dict[str, Any], kind: Endpoint) -> Any:
    """vLLM's `prompt_logprobs` extra; for completions `echo` with `logprobs` asks for them too."""
    given = body.get("prompt_logprobs")
    if given is None and kind is Endpoint.COMPLETION and as_bool(body, "echo", False):
        return body.get("logprobs")
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
    req.tokens_as_ids = as_bool(body, "return_tokens_as_token_ids", False)
    req.params, req.max_tokens_given = _params(body, kind, cfg)
    req.top_logprobs = req.params.logprobs
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
