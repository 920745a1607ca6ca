"""From logits to tokens, changing no sequence: the sampling stage (`sample_step`) turns a
step's logits into `StepSamples` for the scheduler to apply. Parts: the batched sampler (greedy
argmax fast path, temperature, top-k/p, min-p, seeded draws, logprobs), logits processors
(penalties, logit_bias, min_tokens), structured-output masks (llguidance), prompt logprobs,
and beam search.

May import torch, llguidance, `engine.sched` (its data types), `common.sampling_params` and
`engine.outputs`; never the model, the runner or anything that does I/O."""
