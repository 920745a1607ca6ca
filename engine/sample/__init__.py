"""From hidden states to tokens, changing no sequence: the step's plan (`step_plan`, built once
per step, read by the runner, this stage and the verifier) says what each row needs; the sampling
stage (`sample_step`) turns the model's answer (hidden states and its head) into `StepSamples`
for the scheduler to apply. Every token of a step is chosen here. Parts: the tokens asked of the
model's head (`head`: greedy screen, logits in cache-sized row groups), the batched sampler
(greedy argmax fast path, temperature, top-k/p, min-p, seeded draws, logprobs), logits
processors (penalties, logit_bias, min_tokens), structured-output masks (llguidance), prompt
logprobs, speculative verification (`verify`), and beam search.

May import torch, llguidance, `engine.sched` (its data types), `common.sampling_params` and
`engine.outputs`; never the model, the runner or anything that does I/O."""
