"""Decode speed and weight memory of a random Qwen3-MoE GGUF: experts packed (`PackedExperts`) against
the former load, every tensor dequantized to fp32 (`quantization="dequantize"`), in the same run.

The model (default: hidden 1024, 32 experts top-4, 512 per expert, 4 layers, vocab 32000) is drawn
at random, written once as a GGUF in `--format` (llama.cpp's layout: stacked `ffn_*_exps`), and
loaded by two engines in this process, one each way. Per load, one JSON line: the weights' bytes in
memory, ``single_stream_ms`` (median decode step of one request) and ``batch_step_ms`` (median decode
step of ``--batch`` requests), the loads alternating ``--rounds`` times, each figure's best round kept.

    OMP_NUM_THREADS=2 python benchmarks/engine/moe_gguf_bench.py --format Q4_0

`--save FILE` writes the model there with a real tokenizer instead (every `tokenizer.*` key of
`--tokenizer-gguf`, default the default model's file; the vocabulary is its size) and exits: a file
llama.cpp loads, for its quantizer (`peer/llama_cpp_files.py --source FILE`) and the same-run
comparison (`peer/llama_cpp_engine.py`; docs/cpu-fast-path.md, "Mixture-of-experts GGUF files"):

    python benchmarks/engine/moe_gguf_bench.py --format F32 --layers 12 --save /tmp/moe/qwen3moe.F32.gguf
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's root: engine/, tests/ importable

LOADS = {"packed": "auto", "dequantized": "dequantize"}


def _model(args: argparse.Namespace, vocab: int, special: dict[str, int]) -> Any:
    """The seeded random Qwen3-MoE of the given proportions."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64, num_key_value_heads=4, head_dim=64, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=args.intermediate, intermediate_size=4 * args.hidden,
        max_position_embeddings=4096, tie_word_embeddings=False, **special)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def write_model(directory: Path, args: argparse.Namespace) -> Path:
    """A seeded random Qwen3-MoE of the given proportions as `model.gguf` (beside a byte tokenizer)."""
    from tests.engine.model.test_gguf_moe_packed import write_moe_gguf
    from tests.fixtures.models import _byte_tokenizer

    model = _model(args, args.vocab, {"bos_token_id": 256, "eos_token_id": 259, "pad_token_id": 257})
    _byte_tokenizer().save_pretrained(str(directory))
    file = directory / "model.gguf"
    write_moe_gguf(model, file, "qwen3moe", args.format)
    return file


_WRITTEN_IDS = ("bos_token_id", "eos_token_id", "padding_token_id")  # write_moe_gguf adds these itself


def save_with_tokenizer(file: Path, tokenizer_gguf: Path, args: argparse.Namespace) -> None:
    """The model at `file` with every `tokenizer.*` key of `tokenizer_gguf` (a file llama.cpp loads)."""
    import gguf

    from tests.engine.model.test_gguf_moe_packed import write_moe_gguf

    fields = {name: field for name, field in gguf.GGUFReader(str(tokenizer_gguf)).fields.items()
              if name.startswith("tokenizer.")}
    ids = {key: int(fields[f"tokenizer.ggml.{key}"].contents()) for key in _WRITTEN_IDS
           if f"tokenizer.ggml.{key}" in fields}
    vocab = len(fields["tokenizer.ggml.tokens"].contents())

    def copy(writer: Any) -> None:
        for name, field in fields.items():
            if name.removeprefix("tokenizer.ggml.") in _WRITTEN_IDS:
                continue
            sub = field.types[1] if len(field.types) > 1 else None
            writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub)

    special = {"bos_token_id": ids.get("bos_token_id", 1), "eos_token_id": ids.get("eos_token_id", 2),
               "pad_token_id": ids.get("padding_token_id", ids.get("eos_token_id", 2))}
    file.parent.mkdir(parents=True, exist_ok=True)
    write_moe_gguf(_model(args, vocab, special), file, "qwen3moe", args.format, extra_keys=copy)
    print(json.dumps({"saved": str(file), "format": args.format, "vocab": vocab, "layers": args.layers,
                      "mib": round(file.stat().st_size / 2**20, 1)}))


def _decode_ms(engine: Any, num: int, steps: int, vocab: int) -> float:
    from common.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    gen = torch.Generator().manual_seed(num)
    for i in range(num):
        engine.add_request(f"r{num}-{i}", torch.randint(300, vocab, (32,), generator=gen).tolist(), params)
    while engine.scheduler.waiting:  # prefill everything first
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    return 1e3 * statistics.median(times[2:])


def load(file: Path, quantization: str) -> Any:
    from engine.llm import LLM

    return LLM(str(file), dtype="float32", quantization=quantization, kv_cache_memory=1 << 28,
               max_num_batched_tokens=4096).engine


def measure(engine: Any, args: argparse.Namespace) -> dict[str, float]:
    """One round on `engine`, with the kernels' thread split its own engine set at load (process-wide:
    set again here, as both engines live in this process)."""
    from engine.model.quant_linear import all_linears_quantized
    from ops.parallel import openmp_rows_for, set_openmp_rows

    set_openmp_rows(openmp_rows_for(all_linears_quantized(engine.model), engine.policy.ops.fixed_order))
    return {"single_stream_ms": _decode_ms(engine, 1, args.steps, args.vocab),
            "batch_step_ms": _decode_ms(engine, args.batch, args.steps, args.vocab)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", default="Q4_0", choices=["F32", "Q8_0", "Q4_0", "Q4_1"])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--intermediate", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--save", type=Path, help="write the model here with a real tokenizer, then exit")
    parser.add_argument("--tokenizer-gguf", type=Path, help="--save: the GGUF whose tokenizer keys are copied "
                        "(default: the default model's file)")
    args = parser.parse_args()
    if args.save:
        from engine.model.fetch import default_gguf_path

        save_with_tokenizer(args.save, args.tokenizer_gguf or default_gguf_path(), args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        file = write_model(Path(tmp), args)
        engines = {name: load(file, quantization) for name, quantization in LOADS.items()}
        best: dict[str, dict[str, float]] = {name: {} for name in LOADS}
        for _ in range(args.rounds):  # the loads alternate round by round; each figure's best round kept
            for name, engine in engines.items():
                for key, value in measure(engine, args).items():
                    best[name][key] = min(value, best[name].get(key, value))
        for name, engine in engines.items():
            model = engine.model
            weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
            run = best[name]
            print(json.dumps({"load": name, "format": args.format, "file_mib": round(file.stat().st_size / 2**20, 1),
                              "weights_mib": round(weights / 2**20, 1), "threads": torch.get_num_threads(),
                              "batch": args.batch, **{k: round(v, 2) for k, v in run.items()},
                              "single_stream_tok_s": round(1e3 / run["single_stream_ms"], 1),
                              "batch_tok_s": round(1e3 * args.batch / run["batch_step_ms"], 1)}))
            engine.close()

if __name__ == "__main__":
    main()
