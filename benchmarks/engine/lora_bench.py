"""Multi-LoRA decode speed, JSON lines: greedy decode of a batch of `--batch` requests spread over
`--adapters` random PEFT adapters (rank `--rank` on q/k/v/o/gate/up/down) against the same requests
on the base alone, one engine (the default SmolLM2-135M Q4_1 GGUF, ``pagedserve fetch-model``)
in one process, the two taking turns round by round so load from other processes hits both alike.
A round: prefill everything, then the median decode step; the best round counts, tok/s = batch /
step. The last line is the ratio (LoRA tok/s over base tok/s).

    python benchmarks/engine/lora_bench.py [--batch 32] [--adapters 8] [--rank 16] [--rounds 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root: benchmarks.* importable
import engine.llm  # noqa: F401, I001  (before torch: the engine sets OpenMP's spin count while it still can)
import torch
from benchmarks.kernels.quant_bench import engine_round  # imports torch too: after the engine

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    """`count` random LoRA adapters of `model_dir` written by PEFT (`save_pretrained`), seeds 0.."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0))
    paths = []
    for seed in range(count):
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_A" in name or "lora_B" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
        path = out / f"adapter{seed}"
        model.save_pretrained(str(path))
        paths.append(path)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32, help="concurrent requests")
    parser.add_argument("--adapters", type=int, default=8, help="adapters the LoRA batch is spread over")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="decode steps timed per round")
    parser.add_argument("--prompt-len", type=int, default=32)
    args = parser.parse_args()

    from engine.llm import LLM
    from engine.model.fetch import default_gguf_path, default_model_dir
    from engine.model.lora import LoRARequest

    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        paths = make_adapters(default_model_dir(progress=False), Path(tmp), args.adapters, args.rank)
        requests = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(paths)]
        systems: dict[str, list[Any]] = {
            "base": [None] * args.batch,
            "lora": [requests[i % len(requests)] for i in range(args.batch)],
        }
        engine = LLM(str(default_gguf_path()), kv_cache_memory=1 << 28, enable_lora=True, max_loras=args.adapters,
                     max_lora_rank=args.rank).engine
        engine_round(engine, prompts, 1, systems["lora"])  # loads the adapters into their slots
        best = dict.fromkeys(systems, float("inf"))
        for _ in tqdm(range(args.rounds), desc="rounds", unit="round", file=sys.stderr):
            for name, loras in systems.items():
                best[name] = min(best[name], engine_round(engine, prompts, args.steps, loras)[0])
    tok_s = {name: args.batch / seconds for name, seconds in best.items()}
    common = {"batch": args.batch, "adapters": args.adapters, "rank": args.rank,
              "threads": torch.get_num_threads()}
    for name, seconds in best.items():
        print(json.dumps({"system": name, **common, "tok_s": round(tok_s[name], 2),
                          "step_ms": round(seconds * 1e3, 2)}), flush=True)
    print(json.dumps({"ratio": round(tok_s["lora"] / tok_s["base"], 3), **common}), flush=True)


if __name__ == "__main__":
    main()
