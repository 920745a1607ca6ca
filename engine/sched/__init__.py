"""Continuous batching: request and sequence state, the FCFS scheduler over the waiting,
running and swapped queues, chunked prefill and preemption (swap or recompute), and the one
owner of post-step sequence state (`Scheduler.update_from_output` → `postprocess`): computed
counts, appended tokens, forks, frees, stops and the step's deltas.

`output` holds the data handed between a step's stages (`SchedulerOutput` to the runner,
`StepSamples` back from the sampler). May import `engine.kv`, `common.sampling_params`,
`engine.outputs` and `common.log`; never torch, the model or the runner."""
