"""pagedserve engine: everything that decides and computes.

Subpackages, one concern each: `kv` (paged block manager), `sched` (continuous batching),
`sample` (logits → tokens), `model` (Llama-family model, runner, KV cache), `worker` (the
Redis engine process, `pagedserve engine`). At the root: the public API (`llm.LLM`,
`llm_engine.LLMEngine`, `outputs.RequestOutput`) and `config`.

Imports `common` (wire protocol, `SamplingParams`, Redis, logging) and `ops`; never `gateway`
or `pagedserve`. No torch import here."""

from common.openmp_env import bound_openmp_spin

bound_openmp_spin()  # before any torch import: libgomp reads it once (common/openmp_env.py)
