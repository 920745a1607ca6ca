"""Speculative decoding (n-gram prompt lookup) against plain decoding on SmolLM2, in one run.
Prints one JSON object per line on stdout.

- grounded: single streams whose answer repeats their context (repeat a passage, edit code,
  answer from a long context), greedy, one at a time; goal >= 1.8x tok/s with speculation;
- batch: 32 unrepetitive prompts at once (speculation switches itself off above
  `disable_by_batch_size` running sequences); goal >= 0.97x.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/spec_bench.py [--k 4] [--max-tokens 128] [--threads N]

On a shared 2-core machine, oneDNN's 2-thread GEMM at 4-16 rows (a verified row of 1 + K tokens)
stalls when the cores are oversubscribed (22 ms against 1.2 ms single-threaded for SmolLM2's
576x3072 layer, load average 9); `--threads 1` measures the kernel cost without that noise.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

from common.sampling_params import SamplingParams
from engine.llm import LLM

GOAL_GROUNDED = 1.8
GOAL_BATCH = 0.97
PASSAGE = (
    "Paged attention stores the key and value cache in fixed-size blocks, like pages of virtual memory. "
    "A block table maps each sequence's logical blocks to physical ones, so memory is allocated on demand, "
    "fragmentation stays below one block per sequence, and sequences that share a prefix share its blocks. "
    "When the pool runs dry the scheduler preempts the newest request, either swapping its blocks to host "
    "memory or dropping them to recompute later."
)
CODE = '''def load_config(path):
    with open(path) as handle:
        data = json.load(handle)
    if "name" not in data:
        raise ValueError("config needs a name")
    data.setdefault("workers", 4)
    data.setdefault("timeout", 30.0)
    return data


def save_config(path, data):
    with open(path, "w") as handle:
        json.dump(data, handle, indent=2)
'''
CONTEXT = " ".join([
    "The Redis stream holds every request until an engine acknowledges it.",
    "Engines send a heartbeat each second; a silent engine's requests move after five intervals.",
    "The gateway detokenizes incrementally and streams server-sent events to the client.",
    "Prefix caching hashes full blocks by their tokens and the hash of the block before them.",
    "The scheduler runs waiting requests while the token budget of the step allows.",
] * 3)
GROUNDED = {
    "repeat_passage": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    "edit_code": f"Rename the variable `data` to `config` everywhere in this code and print the whole code:\n\n{CODE}",
    "answer_from_context": f"{CONTEXT}\n\nQuote the sentence above that explains what engines send, then the "
                           "sentence about prefix caching, then the one about the gateway.",
}
TOPICS = ["volcanoes", "chess openings", "bread baking", "the history of jazz", "black holes", "tax law",
          "origami", "bees", "the Roman senate", "submarines", "tea ceremonies", "glaciers", "marathon training",
          "cryptography", "coral reefs", "medieval castles"]


def emit(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def chat_ids(llm: LLM, text: str) -> list[int]:
    return list(llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(Path.home() / ".cache/pagedserve/models/SmolLM2-135M-Instruct"))
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    spec: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.lookup_max}
    engines = {"plain": LLM(args.model, kv_cache_memory=512 << 20),
               "spec": LLM(args.model, kv_cache_memory=512 << 20, speculative_config=spec)}
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    warm = [chat_ids(engines["plain"], "Say hello.")]
    for llm in engines.values():
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8))
    totals = {"plain": [0, 0.0], "spec": [0, 0.0]}
    for name, text in GROUNDED.items():
        prompt = [chat_ids(engines["plain"], text)]
        result: dict[str, Any] = {}
        outputs = {}
        for mode, llm in engines.items():
            before = dict(llm.engine.stats().get("spec") or {})
            seconds, outs = timed(llm, prompt, greedy)
            outputs[mode] = outs
            tokens = len(outs[0])
            totals[mode][0] += tokens
            totals[mode][1] += seconds
            result[f"{mode}_tok_s"] = round(tokens / seconds, 2)
            if mode == "spec":
                after = llm.engine.stats()["spec"]
                proposed = after["proposed_tokens"] - before.get("proposed_tokens", 0)
                accepted = after["accepted_tokens"] - before.get("accepted_tokens", 0)
                rows = after["verified_rows"] - before.get("verified_rows", 0)
                result |= {"proposed": proposed, "accepted": accepted,
                           "acceptance_rate": round(accepted / proposed, 3) if proposed else 0.0,
                           "mean_acceptance_length": round(1 + accepted / rows, 2) if rows else 0.0}
        emit(bench="grounded", prompt=name, prompt_tokens=len(prompt[0]), output_tokens=len(outputs["plain"][0]),
             speedup=round(result["spec_tok_s"] / result["plain_tok_s"], 3),
             same_tokens=outputs["plain"] == outputs["spec"], **result)
    plain_rate, spec_rate = (totals[m][0] / totals[m][1] for m in ("plain", "spec"))
    emit(bench="grounded_total", plain_tok_s=round(plain_rate, 2), spec_tok_s=round(spec_rate, 2),
         speedup=round(spec_rate / plain_rate, 3), goal=GOAL_GROUNDED)
    prompts = [chat_ids(engines["plain"], f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}, "
                                          f"idea number {i}.") for i in range(args.batch)]
    batch_params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens // 2, ignore_eos=True)
    rates = {}
    for mode, llm in engines.items():
        seconds, outs = timed(llm, prompts, batch_params)
        rates[mode] = sum(len(o) for o in outs) / seconds
    emit(bench="batch", num_prompts=args.batch, plain_tok_s=round(rates["plain"], 2),
         spec_tok_s=round(rates["spec"], 2), ratio=round(rates["spec"] / rates["plain"], 3), goal=GOAL_BATCH,
         spec_stats=engines["spec"].engine.stats()["spec"])


if __name__ == "__main__":
    main()
