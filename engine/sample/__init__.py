"""From logits to tokens: the batched sampler (greedy, temperature, top-k/p, min-p, seeded
draws, logprobs), beam search, and the output processor that appends tokens, forks parallel
samples, detects stops and builds per-request deltas.

May import torch, `engine.sched`, `engine.sampling_params` and `engine.outputs`; never the
model, the runner or anything that does I/O."""
