"""Multi-LoRA decode speed, JSON lines: greedy decode of a batch of `--batch` requests spread over
`--adapters` random LoRA adapters (rank `--rank` on q/k/v/o/gate/up/down, in PEFT's folder format)
against the same requests on the base alone, one engine (the default SmolLM2-135M Q4_1 GGUF,
``pagedserve fetch-model``, or the GGUF at `--model`, with its tokenizer beside it or at
`--tokenizer`) in one process, the two taking turns round by round so load from other processes
hits both alike. A round: prefill everything, then the median decode step; the best round counts,
tok/s = batch / step. The last line is the ratio (LoRA tok/s over base tok/s) and the load average.

    python benchmarks/engine/lora_bench.py [--batch 32] [--adapters 8] [--rank 16] [--rounds 3] [--steps 8]
    python benchmarks/engine/lora_bench.py --model ~/.cache/pagedserve/ladder/smollm2-1.7b/smollm2-1.7b.Q4_K_M.gguf \\
        --tokenizer ~/.cache/pagedserve/ladder/smollm2-1.7b/hf --kv-cache-memory 2147483648 --prompt-len 8 \\
        --rounds 2 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
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

TARGETS_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapters(manager: Any, out: Path, count: int, rank: int) -> list[Path]:
    """`count` random rank-`rank` adapters (seeds 0..) of the model `manager` (the engine's
    `LoRAManager`) serves, written in PEFT's folder format from its projections' shapes (no
    transformers model of the base needed, which at a real size would take minutes and gigabytes)."""
    from safetensors.torch import save_file

    from engine.model.lora.manager import TARGETS

    paths = []
    for seed in range(count):
        generator = torch.Generator().manual_seed(seed)
        tensors = {}
        for (layer, linear), slots in sorted(manager.linears.items()):
            for module, (block, target, part) in TARGETS.items():
                if target != linear:
                    continue
                key = f"base_model.model.model.layers.{layer}.{block}.{module}"
                shape_b = (slots.slice_sizes[part], rank)
                tensors[f"{key}.lora_A.weight"] = torch.randn((rank, slots.in_features), generator=generator) * 0.02
                tensors[f"{key}.lora_B.weight"] = torch.randn(shape_b, generator=generator) * 0.02
        path = out / f"adapter{seed}"
        path.mkdir()
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
            "target_modules": TARGETS_NAMES, "bias": "none"}))
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
    parser.add_argument("--model", help="a GGUF file (default: the default SmolLM2-135M Q4_1 GGUF)")
    parser.add_argument("--tokenizer", help="the model's tokenizer folder (default: the GGUF's own folder)")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 28, help="KV cache bytes")
    args = parser.parse_args()

    from engine.llm import LLM
    from engine.model.fetch import default_gguf_path, default_model_dir
    from engine.model.lora import LoRARequest

    rng = random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    if args.model is None:
        default_model_dir(progress=False)  # fetched and converted where it is not yet
    model = Path(args.model).expanduser() if args.model else default_gguf_path()
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        engine = LLM(str(model), tokenizer=args.tokenizer and str(Path(args.tokenizer).expanduser()),
                     kv_cache_memory=args.kv_cache_memory, enable_lora=True, max_loras=args.adapters,
                     max_lora_rank=args.rank).engine
        paths = write_adapters(engine.lora, Path(tmp), args.adapters, args.rank)
        requests = [LoRARequest(f"a{i}", i + 1, str(path)) for i, path in enumerate(paths)]
        systems: dict[str, list[Any]] = {
            "base": [None] * args.batch,
            "lora": [requests[i % len(requests)] for i in range(args.batch)],
        }
        engine_round(engine, prompts, 1, systems["lora"])  # loads the adapters into their slots
        best = dict.fromkeys(systems, float("inf"))
        for _ in tqdm(range(args.rounds), desc="rounds", unit="round", file=sys.stderr):
            for name, loras in systems.items():
                best[name] = min(best[name], engine_round(engine, prompts, args.steps, loras)[0])
    tok_s = {name: args.batch / seconds for name, seconds in best.items()}
    common = {"model": model.name, "batch": args.batch, "adapters": args.adapters, "rank": args.rank,
              "threads": torch.get_num_threads()}
    for name, seconds in best.items():
        print(json.dumps({"system": name, **common, "tok_s": round(tok_s[name], 2),
                          "step_ms": round(seconds * 1e3, 2)}), flush=True)
    print(json.dumps({"ratio": round(tok_s["lora"] / tok_s["base"], 3), **common,
                      "loadavg": [round(v, 2) for v in os.getloadavg()]}), flush=True)


if __name__ == "__main__":
    main()
