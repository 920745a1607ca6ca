"""The offline API: `LLM(model=...).generate(prompts, params)` runs the engine to completion."""

from __future__ import annotations

import itertools
from typing import Any

from common.pooling_params import PoolingParams, embedding_floats
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.lora import LoRARequest
from engine.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput


class LLM:
    """Batch generation in-process, with the same engine the server runs. Any `EngineConfig`
    field is a keyword, e.g. `LLM(model, tensor_parallel_size=2)`. `close()` (or leaving
    `with LLM(...) as llm:`) releases the engine (`LLMEngine.close`): ranks, process group,
    threads, weights and KV cache; afterwards every call raises `EngineClosedError`. An engine
    dropped without `close()` is closed when collected, but only `close()` says when."""

    def __init__(self, model: str, **config: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **config))
        self._tokenizer: Any = None
        self._ids = itertools.count()

    def close(self) -> None:
        """Release the engine; idempotent."""
        self.engine.close()
        self._tokenizer = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        self.engine.check_open()
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self.engine.tokenizer_dir)
        return self._tokenizer

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results in input order. A prompt the engine refuses
        (its grammar too, compiled by the engine's compile threads and waited for here) raises
        ValueError before anything runs; a closed LLM raises EngineClosedError. `lora_request`:
        the LoRA adapter of every prompt, or one per prompt (None: the base model), as vLLM's."""
        self.engine.check_open()
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("params must be one SamplingParams or one per prompt")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError("lora_request must be one LoRARequest or one per prompt")
        token_lists = [self._encode(p) for p in prompts]
        ids = [f"offline-{next(self._ids)}" for _ in prompts]
        added: list[str] = []
        try:
            for request_id, tokens, p, lora in zip(ids, token_lists, params_list, loras, strict=True):
                self.engine.add_request(request_id, tokens, p, lora_request=lora)
                added.append(request_id)
            self.engine.wait_compiled(added)
            refused = self.engine.take_refused()
            mine = [refused.pop(request_id) for request_id in added if request_id in refused]
            self.engine.refused.update(refused)  # others' refusals stay for whoever added them
            if mine:
                raise ValueError(mine[0][0])
        except ValueError:
            for request_id in added:
                self.engine.abort_request(request_id)
            raise
        results = {
            request_id: RequestOutput(request_id=request_id, prompt_token_ids=t)
            for request_id, t in zip(ids, token_lists, strict=True)
        }
        progress = _progress(len(prompts), use_tqdm)
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                _merge(results[delta.request_id], delta)
                if delta.finished and progress is not None:
                    progress.update(1)
        if progress is not None:
            progress.close()
        out = [results[request_id] for request_id in ids]
        if self._tokenizer is not None or any(isinstance(p, str) for p in prompts):
            for result in out:
                for choice in result.outputs:
                    choice.text = self.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
        return out

    def embed(self, prompts: str | list[str] | list[int] | list[list[int]],
              pooling_params: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
        """The pooled vector of each prompt (vLLM's `LLM.embed`), in input order, from an engine
        with the pooling runner (`runner="pooling"`, or an embedding model's folder). A prompt the
        engine refuses raises ValueError before anything runs."""
        self.engine.check_open()
        items: list[Any] = [prompts] if isinstance(prompts, str) or (
            prompts and all(isinstance(t, int) for t in prompts)) else list(prompts)
        token_lists = [self._encode(p) for p in items]
        ids = [f"embed-{next(self._ids)}" for _ in token_lists]
        params = SamplingParams(max_tokens=1)
        pooling = pooling_params or PoolingParams()
        try:
            for request_id, tokens in zip(ids, token_lists, strict=True):
                self.engine.add_request(request_id, tokens, params, pooling=pooling)
        except ValueError:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise
        vectors: dict[str, bytes] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.error is not None:  # refused by the scheduler: the others stop too
                    for request_id in ids:
                        self.engine.abort_request(request_id)
                    raise ValueError(out.error)
                if out.finished and out.embedding is not None:
                    vectors[out.request_id] = out.embedding
        return [EmbeddingRequestOutput(request_id, EmbeddingOutput(embedding_floats(vectors[request_id])), tokens)
                for request_id, tokens in zip(ids, token_lists, strict=True)]

    def chat(self, conversations: list[list[dict[str, str]]],
             params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        self.engine.check_open()
        prompts = [
            list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
            for messages in conversations
        ]
        outputs = self.generate(prompts, params)
        for result in outputs:
            for choice in result.outputs:
                choice.text = self.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
        return outputs

    def stats(self) -> dict[str, Any]:
        """The engine's figures (`LLMEngine.stats`)."""
        return self.engine.stats()

    def reset_prefix_cache(self) -> int:
        """Forget the cached prefixes no running request holds (vLLM's `LLM.reset_prefix_cache`):
        the next prompt is computed in full. The number of blocks dropped."""
        return self.engine.reset_prefix_cache()

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        return list(prompt)


def _merge(result: RequestOutput, delta: RequestOutput) -> None:
    """Fold a step delta into the accumulated result (final-only outputs replace)."""
    result.finished = delta.finished
    result.error = delta.error
    result.num_prompt_tokens = delta.num_prompt_tokens
    result.num_generated_tokens = delta.num_generated_tokens
    result.num_cached_tokens = delta.num_cached_tokens
    if delta.prompt_logprobs is not None:
        result.prompt_logprobs = delta.prompt_logprobs
    by_index = {c.index: c for c in result.outputs}
    for choice in delta.outputs:
        have = by_index.get(choice.index)
        if have is None:
            have = by_index[choice.index] = CompletionOutput(index=choice.index, token_ids=[], logprobs=None)
            result.outputs.append(have)
        have.token_ids.extend(choice.token_ids)
        if choice.logprobs is not None:
            have.logprobs = (have.logprobs or []) + choice.logprobs
        have.finish_reason = choice.finish_reason
        have.cumulative_logprob = choice.cumulative_logprob
    result.outputs.sort(key=lambda c: c.index)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
