"""What a request must satisfy before it is queued: a prompt that fits the context and the
vocabulary, token ids the model has, and a worst case that fits the whole KV pool. A request
that fails here is refused with the numbers, never queued to hang or to crash a step."""

from __future__ import annotations

from common.sampling_params import ParamError, SamplingParams
from engine.kv.block_manager import BlockManager


class RequestRejected(ValueError):
    """A request that can never run here; `code` is the OpenAI error code its client gets
    (`context_length_exceeded`, `invalid_token_id`, `invalid_parameter`, `empty_prompt`, ...)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def check_request(prompt: list[int], params: SamplingParams, vocab_size: int, max_model_len: int,
                  block_manager: BlockManager, max_num_seqs: int | None = None) -> None:
    """Raise RequestRejected (message and code for the client) when the request can never run.
    The parameters' own rules are `SamplingParams.validate` (run again here: the object may have
    been changed since it was built); the rest is what this engine can hold."""
    try:
        params.validate()
    except ParamError as exc:
        raise RequestRejected(str(exc), "invalid_parameter") from exc
    _check_prompt(prompt, vocab_size, max_model_len, block_manager)
    if max_num_seqs is not None and params.num_candidates > max_num_seqs:
        raise RequestRejected(
            f"the request runs {params.num_candidates} sequences at once (n / best_of / beam width) but this "
            f"engine runs at most {max_num_seqs} (--max-num-seqs)", "invalid_parameter")
    outside = sorted(t for t in params.token_ids_to_check if t >= vocab_size)
    if outside:
        raise RequestRejected(f"token ids {outside[:5]} are outside the vocabulary [0, {vocab_size})",
                              "invalid_token_id")
    _check_fits_pool(len(prompt), params, max_model_len, block_manager)


def _check_prompt(prompt: list[int], vocab_size: int, max_model_len: int, block_manager: BlockManager) -> None:
    if not prompt:
        raise RequestRejected("the prompt is empty", "empty_prompt")
    if len(prompt) >= max_model_len:
        raise RequestRejected(f"prompt of {len(prompt)} tokens does not fit max_model_len {max_model_len}",
                              "context_length_exceeded")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise RequestRejected(f"prompt token ids must lie in [0, {vocab_size})", "invalid_token_id")
    if not block_manager.can_ever_allocate(len(prompt) + 1):
        raise RequestRejected(
            f"prompt of {len(prompt)} tokens is larger than the whole KV cache "
            f"({block_manager.num_blocks} blocks of {block_manager.block_size})", "context_length_exceeded")


def _check_fits_pool(prompt_len: int, params: SamplingParams, max_model_len: int,
                     block_manager: BlockManager) -> None:
    """All `num_candidates` sequences at full length, sharing the prompt's full blocks, must fit
    the pool: otherwise the request would preempt itself forever."""
    size = block_manager.block_size
    length = min(prompt_len + params.max_tokens, max_model_len)
    shared = prompt_len // size
    per_seq = -(-length // size) - shared
    need = shared + params.num_candidates * per_seq
    have = block_manager.num_blocks - block_manager.watermark_blocks
    if need > have:
        raise RequestRejected(
            f"{params.num_candidates} sequence(s) of up to {length} tokens (prompt {prompt_len} + max_tokens "
            f"{params.max_tokens}) need {need} KV blocks of {size} tokens; the whole cache has {have}: "
            f"lower n, best_of or max_tokens", "context_length_exceeded")
