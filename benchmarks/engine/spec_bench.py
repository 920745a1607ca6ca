"""Speculative decoding (n-gram prompt lookup and suffix decoding) against plain decoding on
SmolLM2, in one run: three engines in one process (plain, ngram, suffix), timed in interleaved
rounds (the order rotates each round) so load from other work hits all of them alike. Prints one
JSON object per line on stdout.

- grounded: single streams whose answer repeats their context (repeat a passage, edit code,
  answer from a long context), greedy, one at a time, each a new prompt (the prefix cache reset
  before it: its prefill is timed too, the same in both engines); goal >= 1.8x tok/s with
  speculation. The suffix engine's cache of finished outputs is cleared before each of these
  runs, so a round never proposes from the same prompt's answer in an earlier round;
- grounded_cached: each grounded prompt again right after, its prompt in the prefix cache (a
  chat's or an agent's next turn re-sends a context the server has seen), suffix cache cleared;
- repeat_request: the same grounded prompt asked again with the cache kept (an agent loop or a
  retried request): what suffix decoding's global trie adds;
- batch: 32 unrepetitive prompts at once (speculation switches itself off above
  `disable_by_batch_size` running sequences); goal >= 0.97x.

    .venv/bin/python benchmarks/engine/spec_bench.py [--model FILE.gguf|DIR] [--threads 2] [--rounds 2]
        [--k 4 | --k 3,4]
        [--int8-prompt-activations]

The default model is the Q4_1 GGUF that `pagedserve up` serves (its GEMM is pagedserve's C++
kernel up to 128 rows); the fp32 directory runs its GEMMs in oneDNN.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable
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


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float, list[list[int]]]:
    """Wall seconds, this process's CPU seconds (all threads: less sensitive to other work on the
    machine than wall time, though a spinning pool thread counts too), and the outputs."""
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, time.process_time() - cpu, [o.outputs[0].token_ids for o in outs]


def spec_counts(llm: LLM) -> dict[str, float]:
    return dict(llm.engine.stats().get("spec") or {})


def forget(llm: LLM, prefixes: bool) -> None:
    """Clear the suffix engine's cache of finished outputs, and with `prefixes` the prefix cache."""
    clear_suffix_cache(llm)
    if prefixes:
        llm.reset_prefix_cache()


def clear_suffix_cache(llm: LLM) -> None:
    speculator = llm.engine.speculator
    if speculator is not None and speculator.suffix_cache is not None:
        speculator.suffix_cache.clear()


class Tally:
    """Tokens, seconds and spec counters of one (bench, mode) over the rounds; outputs of round 0."""

    def __init__(self) -> None:
        self.tokens = 0
        self.seconds = 0.0
        self.cpu_seconds = 0.0
        self.proposed = self.accepted = self.rows = 0
        self.outputs: list[list[int]] | None = None

    def add(self, llm: LLM, prompts: list[list[int]], params: SamplingParams, **label: Any) -> None:
        before = spec_counts(llm)
        seconds, cpu_seconds, outs = timed(llm, prompts, params)
        after = spec_counts(llm)
        emit(bench="run", **label, tokens=sum(len(o) for o in outs), seconds=round(seconds, 3),
             cpu_seconds=round(cpu_seconds, 3))  # progress
        self.tokens += sum(len(o) for o in outs)
        self.seconds += seconds
        self.cpu_seconds += cpu_seconds
        self.proposed += int(after.get("proposed_tokens", 0) - before.get("proposed_tokens", 0))
        self.accepted += int(after.get("accepted_tokens", 0) - before.get("accepted_tokens", 0))
        self.rows += int(after.get("verified_rows", 0) - before.get("verified_rows", 0))
        if self.outputs is None:
            self.outputs = outs

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds

    @property
    def cpu_rate(self) -> float:
        return self.tokens / self.cpu_seconds if self.cpu_seconds > 0 else 0.0

    def spec_fields(self) -> dict[str, Any]:
        return {"proposed": self.proposed, "accepted": self.accepted,
                "acceptance_rate": round(self.accepted / self.proposed, 3) if self.proposed else 0.0,
                "mean_acceptance_length": round(1 + self.accepted / self.rows, 2) if self.rows else 0.0}


def report(bench: str, tallies: dict[str, Tally], goal: float | None = None, **fields: Any) -> None:
    plain = tallies["plain"]
    row: dict[str, Any] = {"bench": bench, **fields, "plain_tok_s": round(plain.rate, 2)}
    for mode, tally in tallies.items():
        if mode == "plain":
            continue
        row[mode] = {"tok_s": round(tally.rate, 2), "speedup": round(tally.rate / plain.rate, 3),
                     "speedup_cpu": round(tally.cpu_rate / plain.cpu_rate, 3) if plain.cpu_rate else 0.0,
                     "same_tokens": tally.outputs == plain.outputs, **tally.spec_fields()}
    if goal is not None:
        row["goal"] = goal
    emit(**row)


def summed(per_prompt: Iterable[dict[str, Tally]], modes: Iterable[str]) -> dict[str, Tally]:
    """One Tally per mode over several prompts' tallies (outputs concatenated)."""
    totals = {mode: Tally() for mode in modes}
    for tallies in per_prompt:
        for mode, tally in tallies.items():
            total = totals[mode]
            total.tokens += tally.tokens
            total.seconds += tally.seconds
            total.cpu_seconds += tally.cpu_seconds
            total.proposed += tally.proposed
            total.accepted += tally.accepted
            total.rows += tally.rows
            total.outputs = (total.outputs or []) + (tally.outputs or [])
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_dir = Path.home() / ".cache/pagedserve/models/SmolLM2-135M-Instruct"
    parser.add_argument("--model", default=str(model_dir / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--k", default="4",
                        help="num_speculative_tokens (both methods); several (3,4) run one engine per method and K")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--methods", default="ngram,suffix")
    parser.add_argument("--int8-prompt-activations", action="store_true",
                        help="every engine rounds prompt rows to int8 too (exact_prompt_rows=False)")
    parser.add_argument("--dump-prompts", metavar="FILE",
                        help="write the grounded prompts' token ids for benchmarks/peer/llama_cpp_spec_bench.py, exit")
    args = parser.parse_args()
    if args.dump_prompts:
        from transformers import AutoTokenizer

        from engine.model.loader import tokenizer_dir

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir(args.model, None)))
        Path(args.dump_prompts).write_text(json.dumps({
            "max_tokens": args.max_tokens, "warm": chat_ids(tokenizer, "Say hello."),
            "grounded": {name: chat_ids(tokenizer, text) for name, text in GROUNDED.items()}}))
        return
    torch.set_num_threads(args.threads)
    configs: dict[str, dict[str, Any] | None] = {"plain": None}
    ks = [int(k) for k in args.k.split(",")]
    for method in args.methods.split(","):
        for k in ks:
            mode = method if len(ks) == 1 else f"{method}_k{k}"
            configs[mode] = ({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": args.lookup_max}
                             if method == "ngram" else {"method": method, "num_speculative_tokens": k})
    engines = {mode: LLM(args.model, kv_cache_memory=512 << 20, speculative_config=config,
                         exact_prompt_rows=not args.int8_prompt_activations)
               for mode, config in configs.items()}
    emit(bench="setup", model=args.model, threads=torch.get_num_threads(), k=ks, rounds=args.rounds,
         modes=list(engines), exact_prompt_rows=not args.int8_prompt_activations)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    some = next(iter(engines.values())).tokenizer
    warm = [chat_ids(some, "Say hello.")]
    for llm in engines.values():
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8))
    prompts = {name: [chat_ids(some, text)] for name, text in GROUNDED.items()}
    batch_prompts = [chat_ids(some, f"Write a short paragraph about {TOPICS[i % len(TOPICS)]}, idea number {i}.")
                     for i in range(args.batch)]
    batch_params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens // 2, ignore_eos=True)
    grounded = {name: {mode: Tally() for mode in engines} for name in GROUNDED}
    cached = {name: {mode: Tally() for mode in engines} for name in GROUNDED}
    repeat = {mode: Tally() for mode in engines}
    batch = {mode: Tally() for mode in engines}
    modes = list(engines)
    for r in range(args.rounds):
        order = modes[r % len(modes):] + modes[: r % len(modes)]
        for name, prompt in prompts.items():
            for mode in order:
                forget(engines[mode], prefixes=True)
                grounded[name][mode].add(engines[mode], prompt, greedy, prompt=name, mode=mode, round=r)
                forget(engines[mode], prefixes=False)
                cached[name][mode].add(engines[mode], prompt, greedy, prompt=f"{name}_cached", mode=mode, round=r)
                if name == "repeat_passage":  # again, with the output of the run just before cached
                    repeat[mode].add(engines[mode], prompt, greedy, prompt="repeat_request", mode=mode, round=r)
        for mode in order:
            batch[mode].add(engines[mode], batch_prompts, batch_params, prompt="batch", mode=mode, round=r)
    for name, tallies in grounded.items():
        report("grounded", tallies, prompt=name, prompt_tokens=len(prompts[name][0]))
    for name, tallies in cached.items():
        report("grounded_cached", tallies, prompt=name, prompt_tokens=len(prompts[name][0]))
    report("grounded_total", summed(grounded.values(), engines), goal=GOAL_GROUNDED)
    report("grounded_cached_total", summed(cached.values(), engines))
    report("repeat_request", repeat, prompt="repeat_passage")
    report("batch", batch, goal=GOAL_BATCH, num_prompts=args.batch)


if __name__ == "__main__":
    main()
