"""Greedy decode speed of llama.cpp (llama-cpp-python's low-level batch API) on a GGUF, JSON lines:
the peer of ``benchmarks/kernels/quant_bench.py --parts engine``, which runs it interleaved with its own
rounds (``--peer-python``). Run alone with the venv of ``setup_llama_cpp.sh``:

    ~/.cache/pagedserve/peer/llama-cpp-venv/bin/python benchmarks/peer/llama_cpp_bench.py \\
        --gguf ~/.cache/pagedserve/models/SmolLM2-135M-Instruct/SmolLM2-135M-Instruct.Q4_1.gguf --batches 1,32

A batch of B is B sequences (sequence ids 0..B-1) in one context with a unified KV cache: each
prompt is prefilled as its own ``llama_decode`` call, then every decode step is one
``llama_decode`` of B tokens (one per sequence) and a greedy argmax of each row's logits in
numpy: llama.cpp's own batched decoding, as its ``batched`` example does it. EOS is ignored.
A round clears the KV cache and prefills fresh prompts; the best round's median step counts
(``tok_s`` = B / step time). Prompts are ``--prompts FILE`` (a JSON list of token-id lists, what
quant_bench passes so both sides decode the same tokens), else random ids.
The model is loaded with llama.cpp's default parameters, as its users run it: its repacked
(interleaved) Q4_0 / Q4_K / IQ4_NL layouts on. Each line names the weight buffers llama.cpp
reported (``buffers``; ``CPU_REPACK`` when the repack ran). On a CPU with AMX, build llama.cpp
without AMX (``setup_llama_cpp.sh`` does): its AMX matmul dies with SIGILL on the VMs that report AMX.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import numpy as np


class Peer:
    """One llama.cpp model and a context of `max_seqs` sequences of up to `seq_len` tokens each."""

    def __init__(self, path: str, threads: int, max_seqs: int, seq_len: int) -> None:
        import llama_cpp
        from llama_cpp_buffers import BufferLog

        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self.buffers = BufferLog(llama_cpp)
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), llama_cpp.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = max_seqs * seq_len
        cparams.n_batch = cparams.n_ubatch = max(512, max_seqs)
        cparams.n_seq_max = max_seqs
        cparams.n_threads = cparams.n_threads_batch = threads
        if hasattr(cparams, "kv_unified"):
            cparams.kv_unified = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.batch = llama_cpp.llama_batch_init(max(512, max_seqs, seq_len), 0, 1)

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[int], logits: list[bool]) -> None:
        b = self.batch
        for i, (tok, pos, seq, want) in enumerate(zip(tokens, positions, seqs, logits, strict=True)):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, want
            b.seq_id[i][0] = seq
        b.n_tokens = len(tokens)
        code = self.lib.llama_decode(self.ctx, b)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code}")

    def _argmax(self, row: int) -> int:
        ptr = self.lib.llama_get_logits_ith(self.ctx, row)
        return int(np.ctypeslib.as_array(ptr, shape=(self.vocab,)).argmax())

    def round_median(self, prompts: list[list[int]], steps: int) -> float:
        """Median seconds per decode step of all `prompts` together, after a fresh prefill of each."""
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)
        last: list[int] = []
        for seq, prompt in enumerate(prompts):
            n = len(prompt)
            self._decode(prompt, list(range(n)), [seq] * n, [i == n - 1 for i in range(n)])
            last.append(self._argmax(n - 1))
        seqs = list(range(len(prompts)))
        times: list[float] = []
        for step in range(steps):
            start = time.perf_counter()
            self._decode(last, [len(p) + step for p in prompts], seqs, [True] * len(prompts))
            last = [self._argmax(i) for i in seqs]
            times.append(time.perf_counter() - start)
        return statistics.median(times)


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", default="1", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--prompts", help="JSON file: a list of token-id lists (at least the largest batch)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    given: list[list[int]] | None = None
    if args.prompts:
        with open(args.prompts) as f:
            given = json.load(f)
        if len(given) < max(batches):
            raise SystemExit(f"--prompts has {len(given)} prompts; the largest batch is {max(batches)}")
    longest = max(len(p) for p in given) if given else args.prompt_len
    peer = Peer(args.gguf, args.threads, max(batches), longest + args.steps + 8)
    for batch in batches:
        best = float("inf")
        for r in range(args.rounds):
            prompts = given[:batch] if given else random_prompts(batch, args.prompt_len, 1000 * batch + r)
            best = min(best, peer.round_median(prompts, args.steps))
        print(json.dumps({"part": "peer", "system": "llama.cpp", "threads": args.threads, "batch": batch,
                          "tok_s": round(batch / best, 2), "step_ms": round(best * 1e3, 2),
                          "buffers": peer.buffers.names}), flush=True)


if __name__ == "__main__":
    main()
