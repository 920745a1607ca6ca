"""pagedserve engine: everything that decides and computes.

Subpackages, one concern each: `kv` (paged block manager), `sched` (continuous batching),
`sample` (logits → tokens), `model` (Llama-family model, runner, KV cache), `worker` (the
Redis engine process), `launch` (`pagedserve up`), `sim` (memory simulator), `plan`
(capacity planner). At the root: the public API (`llm.LLM`, `llm_engine.LLMEngine`,
`sampling_params.SamplingParams`, `outputs.RequestOutput`), `config`, the wire `protocol`,
`pubsub`, `log`, `sizes`, `shutdown` (bounded service shutdown) and the `cli`. No torch import here or in `protocol`."""
