"""Continuous batching: request and sequence state, the FCFS scheduler over the waiting,
running and swapped queues, chunked prefill and preemption (swap or recompute).

May import `engine.kv`, `engine.sampling_params` and `engine.log`; never torch, the model or
the runner: what a step needs is handed over in the scheduler's output."""
