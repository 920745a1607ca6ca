"""What the engine hands back: per step, the new tokens of each touched request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, kw_only=True)
class CompletionOutput:
    """One choice: tokens produced (new ones in a step delta, all of them in a final result)."""

    index: int
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[dict[str, Any]] | None = None
    cumulative_logprob: float = 0.0
    text: str = ""


@dataclass(slots=True, kw_only=True)
class RequestOutput:
    """A request's delta for one step (engine.step) or its final result (LLM.generate)."""

    request_id: str
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = None
    error_code: str | None = None  # with `error`: the OpenAI error code its client gets
    prompt_token_ids: list[int] = field(default_factory=list)
    # with SamplingParams.prompt_logprobs, on the first delta: per prompt token (None for the
    # first) {"token_id", "logprob", "top_logprobs": [(token_id, logprob), ...]}
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    embedding: bytes | None = None  # an embedding request's pooled vector (little-endian float32), when finished


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's pooled vector (vLLM's `EmbeddingOutput`)."""

    embedding: list[float]


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """`LLM.embed`'s result for one prompt (vLLM's `EmbeddingRequestOutput`)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
