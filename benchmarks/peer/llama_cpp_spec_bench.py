"""llama.cpp's prompt-lookup speculation (llama-cpp-python's `LlamaPromptLookupDecoding`) against
its plain decoding, on the prompts of ``benchmarks/engine/spec_bench.py`` (token ids it writes with
``--dump-prompts FILE``, so both sides decode the very same chat-templated tokens), greedy, one
stream, the same token limit, stopping at EOS; rounds interleaved, ratios from one run. Run it
with the venv of ``setup_llama_cpp.sh``:

    .venv/bin/python benchmarks/engine/spec_bench.py --dump-prompts /tmp/spec_prompts.json
    ~/.cache/pagedserve/peer/llama-cpp-venv/bin/python benchmarks/peer/llama_cpp_spec_bench.py \\
        --gguf ~/.cache/pagedserve/models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf \\
        --prompts /tmp/spec_prompts.json

One JSON line per prompt and a total, like spec_bench's grounded rows."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def load(path: str, threads: int, **options: Any) -> Any:
    """A `llama_cpp.Llama` on `path` with llama.cpp's default model params, as its users run it
    (`options`: more Llama arguments, e.g. draft_model). On AMX CPUs llama.cpp is built without AMX
    (setup_llama_cpp.sh): its AMX matmul dies with SIGILL on the VMs that report AMX."""
    import llama_cpp

    return llama_cpp.Llama(model_path=path, n_threads=threads, n_batch=512, n_ctx=2048, verbose=False, **options)


def decode(llm: Any, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
    """Seconds and tokens of one greedy completion (prefill included, as spec_bench times it)."""
    eos = llm.token_eos()
    out: list[int] = []
    start = time.perf_counter()
    for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
        if token == eos:
            break
        out.append(token)
        if len(out) >= max_tokens:
            break
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--prompts", required=True, help="JSON written by spec_bench.py --dump-prompts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="num_pred_tokens")
    parser.add_argument("--max-ngram", type=int, default=4, help="max_ngram_size")
    args = parser.parse_args()
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    data = json.loads(Path(args.prompts).read_text())
    engines = {"plain": load(args.gguf, args.threads),
               "lookup": load(args.gguf, args.threads, draft_model=LlamaPromptLookupDecoding(
                   max_ngram_size=args.max_ngram, num_pred_tokens=args.k))}
    for llm in engines.values():
        decode(llm, data["warm"], 8)
    tallies = {name: {mode: [0, 0.0] for mode in engines} for name in data["grounded"]}
    outputs: dict[tuple[str, str], list[int]] = {}
    modes = list(engines)
    for r in range(args.rounds):
        for name, prompt in data["grounded"].items():
            for mode in modes[r % 2:] + modes[: r % 2]:
                seconds, out = decode(engines[mode], prompt, data["max_tokens"])
                tallies[name][mode][0] += len(out)
                tallies[name][mode][1] += seconds
                outputs.setdefault((name, mode), out)
    total = {mode: [0, 0.0] for mode in engines}
    for name, tally in tallies.items():
        rates = {mode: t[0] / t[1] for mode, t in tally.items()}
        for mode, t in tally.items():
            total[mode][0] += t[0]
            total[mode][1] += t[1]
        print(json.dumps({"bench": "llama.cpp grounded", "prompt": name, "threads": args.threads,
                          "output_tokens": len(outputs[(name, "plain")]), "plain_tok_s": round(rates["plain"], 2),
                          "lookup_tok_s": round(rates["lookup"], 2),
                          "speedup": round(rates["lookup"] / rates["plain"], 3),
                          "same_tokens": outputs[(name, "plain")] == outputs[(name, "lookup")]}), flush=True)
    rates = {mode: t[0] / t[1] for mode, t in total.items()}
    print(json.dumps({"bench": "llama.cpp grounded_total", "threads": args.threads, "k": args.k,
                      "plain_tok_s": round(rates["plain"], 2), "lookup_tok_s": round(rates["lookup"], 2),
                      "speedup": round(rates["lookup"] / rates["plain"], 3)}), flush=True)


if __name__ == "__main__":
    main()
