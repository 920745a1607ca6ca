"""Which reasoning parser a chat request gets, and what it rules out.

The parser of a model: this gateway's ``--reasoning-parser`` for it, else what its engines
announce (their ``--reasoning-parser``), else what its chat template implies
(`gateway.text.reasoning.template_default`); "none" at any level turns it off. Completions are
never split: their text is the raw continuation."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from common.log import get_logger
from common.protocol import REASONING_PARSER_NAMES
from gateway.api.endpoint import Endpoint
from gateway.api.validation import GenerationRequest
from gateway.broker.engines import ModelInfo
from gateway.config import GatewayConfig
from gateway.errors import bad_request
from gateway.text.reasoning import ReasoningParser, Start, get_reasoning_parser, template_default
from gateway.text.tokenizer import ModelTokenizer

log = get_logger("gateway.reasoning")


def parser_name(cfg: GatewayConfig, model: ModelInfo, tokenizer: ModelTokenizer) -> str | None:
    """The model's reasoning parser (see the module docstring), None for none."""
    name = cfg.reasoning_parser_for(model.name) or model.reasoning_parser or template_default(tokenizer.chat_template)
    if name is None or name == "none":
        return None
    if name not in REASONING_PARSER_NAMES:  # announced by an engine newer than this gateway
        log.warning("unknown reasoning parser; output not split", model=model.name, parser=name)
        return None
    return name


def choose(req: GenerationRequest, cfg: GatewayConfig, model: ModelInfo, tokenizer: ModelTokenizer) -> None:
    """Set `req.reasoning_parser` for a chat request (before its prompt is rendered)."""
    if req.kind is Endpoint.CHAT:
        req.reasoning_parser = parser_name(cfg, model, tokenizer)


def check_constraint(req: GenerationRequest) -> None:
    """400 for an output constraint (structured output, tool_choice required or named) where the
    model would think first: the engine applies a grammar from the first generated token, so it
    would constrain the thinking too. Allowed where the prompt closed the thinking
    (``chat_template_kwargs: {"enable_thinking": false}`` on Qwen3-style templates)."""
    if req.reasoning_parser is None or req.params.structured_output is None or req.reasoning_start == "content":
        return
    param = req.structured_param or "response_format"
    what = "tool_choice 'required' or a named function" if param == "tools" else f"'{param}'"
    raise bad_request(f"{what} is not supported while the model thinks first (reasoning parser "
                      f"'{req.reasoning_parser}'): the output constraint would apply to the thinking; turn "
                      "thinking off with chat_template_kwargs {\"enable_thinking\": false} where the chat template "
                      "has that switch", "tool_choice" if param == "tools" else param, "unsupported_parameter")


def factory(req: GenerationRequest) -> Callable[[], ReasoningParser] | None:
    """Makes one parser per choice, or None without a parser."""
    if req.reasoning_parser is None:
        return None
    cls, start = get_reasoning_parser(req.reasoning_parser), cast(Start, req.reasoning_start)
    return lambda: cls(start)
