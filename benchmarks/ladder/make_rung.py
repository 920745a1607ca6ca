"""Files of one ladder rung: random weights of a real shape, as an HF folder, an F16 GGUF and
llama.cpp's own quantizations of it, JSON lines.

    .venv/bin/python benchmarks/ladder/make_rung.py --rung smollm2-1.7b \\
        --peer-python ~/.cache/pagedserve/peer/llama-cpp-venv/bin/python [--formats Q4_K_M,Q4_0,Q8_0]

``--rung`` also takes a model's ``config.json`` (a Llama, Mistral or Qwen2 decoder: ``shapes.rung_from_config``),
for shapes beyond the ladder's four.

Every tensor is drawn from a generator seeded by its name, N(0, 0.02) (norms 1), in fp16, and the
same values go to both files: the HF folder (fp16 safetensors shards, what vLLM loads in bf16) and
the F16 GGUF (Q/K rows permuted as llama.cpp's converter permutes a Llama's). The GGUF's tokenizer
is the default model's (SmolLM2's, ``pagedserve fetch-model``), its token list padded with unused
tokens to the shape's vocabulary, so the embedding and lm_head keep their real sizes; the HF folder
gets SmolLM2's tokenizer files. The quantized files come from llama.cpp's quantizer
(``llama_cpp_files.quantize``, run by the llama-cpp venv's python), as its users make them.
Files go to ``${PAGEDSERVE_CACHE:-~/.cache/pagedserve}/ladder/<rung>/``; a file already there is kept.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.ladder.shapes import FORMATS, RUNGS, Rung, resolve_rung  # noqa: E402

SHARD_BYTES = 2 << 30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "chat_template.jinja", "generation_config.json")
UNUSED_TOKEN = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED


def ladder_root() -> Path:
    base = os.environ.get("PAGEDSERVE_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "pagedserve") / "ladder"


def hf_tensors(rung: Rung) -> Iterator[tuple[str, tuple[int, ...]]]:
    """The HF state dict's names and shapes, in the order the files are written."""
    c = rung.config
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head = hidden // c["num_attention_heads"]
    q_rows, kv_rows = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    yield "model.embed_tokens.weight", (vocab, hidden)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (hidden,)
        for proj, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows)):
            yield p + f"self_attn.{proj}_proj.weight", (rows, hidden)
            if rung.qkv_bias:
                yield p + f"self_attn.{proj}_proj.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (hidden, q_rows)
        yield p + "post_attention_layernorm.weight", (hidden,)
        yield p + "mlp.gate_proj.weight", (inter, hidden)
        yield p + "mlp.up_proj.weight", (inter, hidden)
        yield p + "mlp.down_proj.weight", (hidden, inter)
    yield "model.norm.weight", (hidden,)
    if not c["tie_word_embeddings"]:
        yield "lm_head.weight", (vocab, hidden)


def values(name: str, shape: tuple[int, ...], seed: int) -> np.ndarray:
    """fp16 values of one tensor: its own generator, so both files hold the same numbers."""
    if name.endswith("norm.weight"):
        return np.ones(shape, dtype=np.float16)
    rng = np.random.default_rng((zlib.crc32(name.encode()) << 8) ^ seed)
    return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)


def llama_cpp_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order for a Llama (RoPE halves interleaved within each head)."""
    shape = weight.shape
    return weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def write_hf(rung: Rung, folder: Path, seed: int) -> None:
    """config.json, fp16 safetensors shards with their index, and SmolLM2's tokenizer files."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    tmp = folder.with_name(folder.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    config = AutoConfig.for_model(rung.hf_arch, **rung.config, torch_dtype="float16")
    config.save_pretrained(str(tmp))
    shard: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    shards: list[dict[str, torch.Tensor]] = []
    size = 0
    for name, shape in hf_tensors(rung):
        if size > SHARD_BYTES:
            shards.append(shard)
            shard, size = {}, 0
        shard[name] = torch.from_numpy(values(name, shape, seed))
        size += shard[name].numel() * 2
    shards.append(shard)
    for i, tensors in enumerate(tqdm(shards, desc=f"{rung.name} safetensors", unit="shard")):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(tmp / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, file)
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    copy_tokenizer(tmp)
    tmp.rename(folder)


def copy_tokenizer(folder: Path) -> None:
    """SmolLM2's tokenizer files into `folder` (the tokenizer every rung's files are written with)."""
    from engine.model.fetch import default_model_dir

    folder.mkdir(parents=True, exist_ok=True)
    source = default_model_dir()
    for file in TOKENIZER_FILES:
        if (source / file).is_file():
            (folder / file).write_bytes((source / file).read_bytes())


def _tokenizer_fields(writer: object, vocab: int) -> None:
    """The default model's tokenizer keys, its token list padded to `vocab` with unused tokens."""
    import gguf

    from engine.model.fetch import default_gguf_path

    reader = gguf.GGUFReader(str(default_gguf_path()))
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        contents = field.contents()
        if name == "tokenizer.ggml.tokens":
            contents = [*contents, *(f"<|ladder_unused_{i}|>" for i in range(len(contents), vocab))]
        elif name == "tokenizer.ggml.token_type":
            contents = [*contents, *([UNUSED_TOKEN] * (vocab - len(contents)))]
        elif name == "tokenizer.ggml.scores":
            contents = [*contents, *([0.0] * (vocab - len(contents)))]
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(name, contents, vtype, sub)  # type: ignore[attr-defined]


def write_f16_gguf(rung: Rung, path: Path, seed: int) -> None:
    """The same weights as llama.cpp's converter lays them out, F16 (norms F32), tensor by tensor."""
    import gguf

    c = rung.config
    heads, kv_heads = c["num_attention_heads"], c["num_key_value_heads"]
    arch = gguf.MODEL_ARCH.LLAMA if rung.gguf_arch == "llama" else gguf.MODEL_ARCH.QWEN2
    names = gguf.get_tensor_name_map(arch, c["num_hidden_layers"])
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), rung.gguf_arch)
    writer.add_name(rung.name)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(float(c["rope_theta"]))
    writer.add_rope_dimension_count(c["hidden_size"] // heads)
    writer.add_vocab_size(c["vocab_size"])
    _tokenizer_fields(writer, c["vocab_size"])
    plan = []
    for hf_name, shape in hf_tensors(rung):
        base, _, suffix = hf_name.rpartition(".")
        name = names.get_name(base)
        if name is None:
            raise SystemExit(f"no GGUF name for {hf_name}")
        kind = gguf.GGMLQuantizationType.F32 if len(shape) == 1 else gguf.GGMLQuantizationType.F16
        dtype = np.float32 if len(shape) == 1 else np.float16
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        writer.add_tensor_info(f"{name}.{suffix}", shape, np.dtype(dtype), nbytes, raw_dtype=kind)
        plan.append((hf_name, shape, name, dtype))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for hf_name, shape, name, dtype in tqdm(plan, desc=path.name, unit="tensor"):
        data = values(hf_name, shape, seed)
        if rung.gguf_arch == "llama" and name.endswith(("attn_q", "attn_k")) and len(shape) == 2:
            data = llama_cpp_rows(data, heads if name.endswith("attn_q") else kv_heads)
        writer.write_tensor_data(np.ascontiguousarray(data.astype(dtype)))
    writer.close()
    os.replace(tmp, path)


def quantize(peer_python: str, source: Path, target: str, dest: Path, threads: int) -> None:
    """llama.cpp's quantizer in the llama-cpp venv (``llama_cpp_files.quantize``)."""
    code = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]);"
            "from benchmarks.peer.llama_cpp_files import quantize;"
            "quantize(Path(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), int(sys.argv[5]))")
    subprocess.run([peer_python, "-c", code, str(ROOT), str(source), target, str(dest), str(threads)], check=True)


def make_rung(rung: Rung, peer_python: str | None, formats: list[str], seed: int, threads: int,
              root: Path | None = None, hf: bool = True) -> dict[str, str]:
    """Every file of `rung` (those already there are kept); their paths by kind (hf, tokenizer, F16,
    formats). `hf` False: no HF folder (only vLLM reads it; at 8B it is 16 GB), the tokenizer files alone."""
    folder = (root or ladder_root()) / rung.name
    folder.mkdir(parents=True, exist_ok=True)
    paths = {"hf": folder / "hf", "F16": folder / f"{rung.name}.F16.gguf"}
    steps: list[tuple[str, Callable[[], None]]] = [("F16", lambda: write_f16_gguf(rung, paths["F16"], seed))]
    if hf:
        steps.insert(0, ("hf", lambda: write_hf(rung, paths["hf"], seed)))
        paths["tokenizer"] = paths["hf"]
    else:
        del paths["hf"]
        paths["tokenizer"] = folder / "tokenizer"
        steps.insert(0, ("tokenizer", lambda: copy_tokenizer(paths["tokenizer"])))
    for fmt in formats:
        paths[fmt] = folder / f"{rung.name}.{fmt}.gguf"
        if peer_python is None:
            raise SystemExit("quantized formats need --peer-python (llama.cpp's quantizer)")
        steps.append((fmt, functools.partial(quantize, peer_python, paths["F16"], fmt, paths[fmt], threads)))
    for kind, step in steps:
        if paths[kind].exists():
            continue
        start = time.perf_counter()
        step()
        path = paths[kind]
        size = sum(f.stat().st_size for f in path.rglob("*")) if path.is_dir() else path.stat().st_size
        print(json.dumps({"part": "file", "rung": rung.name, "kind": kind, "path": str(paths[kind]),
                          "bytes": size, "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    return {kind: str(path) for kind, path in paths.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rung", required=True, help=f"one of {', '.join(RUNGS)}, or a config.json path")
    parser.add_argument("--peer-python", help="python of the llama-cpp venv (setup_llama_cpp.sh), for the quantizer")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-hf", action="store_true", help="skip the HF folder (only vLLM's trace reads it)")
    parser.add_argument("--out-root", type=Path, help="default: ${PAGEDSERVE_CACHE:-~/.cache/pagedserve}/ladder")
    args = parser.parse_args()
    formats = [f for f in args.formats.split(",") if f]
    try:
        rung = resolve_rung(args.rung)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    paths = make_rung(rung, args.peer_python, formats, args.seed, args.threads, args.out_root, hf=not args.no_hf)
    print(json.dumps({"part": "rung", "rung": rung.name, "params": rung.params, "files": paths}))


if __name__ == "__main__":
    main()
