"""vLLM's side of the offline parts of benchmarks/peer/peer_bench.py, run with the vLLM venv's python.

    VLLM_CPU_KVCACHE_SPACE=2 VENV/bin/python benchmarks/peer/vllm_offline.py JOB.json RESULT.json

JOB: {"model", "dtype" (default float32), "max_model_len", "warmup": [[ids], out_len],
"runs": [{"name", "prompts": [[ids]...], "output_lens": [...], "return_tokens": bool}]}. Each run is
one `LLM.generate` call, greedy, every request exactly its output length (ignore_eos, min_tokens),
timed around the call. RESULT:
{"startup_s", "config", "runs": {name: {"seconds", "output_tokens", "token_ids"?}}}.
Standalone on purpose: the vLLM venv has no pagedserve installed."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


def main(job_path: str, result_path: str) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    job: dict[str, Any] = json.loads(Path(job_path).read_text())
    start = time.perf_counter()
    llm = LLM(model=job["model"], dtype=job.get("dtype", "float32"), max_model_len=job["max_model_len"], seed=0)
    startup = time.perf_counter() - start

    def generate(prompts: list[list[int]], output_lens: list[int]) -> tuple[float, list[list[int]]]:
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        params = [SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True) for n in output_lens]
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return seconds, [list(o.outputs[0].token_ids) for o in outs]

    warm_prompt, warm_len = job["warmup"]
    generate([warm_prompt], [warm_len])  # first-call costs (compiled graphs for new shapes) off the clock
    results: dict[str, Any] = {}
    for run in job["runs"]:
        print(f"vllm: {run['name']} ({len(run['prompts'])} requests)", file=sys.stderr, flush=True)
        seconds, token_ids = generate(run["prompts"], run["output_lens"])
        record: dict[str, Any] = {"seconds": seconds, "output_tokens": sum(len(t) for t in token_ids)}
        if run.get("return_tokens"):
            record["token_ids"] = token_ids
        results[run["name"]] = record
    sched = llm.llm_engine.vllm_config.scheduler_config
    config = {"max_num_seqs": sched.max_num_seqs, "max_num_batched_tokens": sched.max_num_batched_tokens}
    Path(result_path).write_text(json.dumps({"startup_s": startup, "config": config, "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
