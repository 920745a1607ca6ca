"""GGUF files made by pagedserve's own reference quantizers, for llama.cpp to read.

Takes a GGUF file as the template (its metadata, tokenizer and tensor formats: llama.cpp's own
Q4_K_M or Q6_K of the default model, from ``llama_cpp_files.py``), dequantizes each tensor to the
fp32 values the file holds and quantizes them again with ``ops.reference.quantizers`` (the K-quants,
IQ4_NL) or ``ops.reference.quant.quantize`` (the 32-weight formats) into the same format, or into
``--format`` where a row allows it. The tensors keep their names, order and llama.cpp's row
layout; F32 / F16 tensors are copied. ``llama_cpp_nll.py`` on the written file then says whether
llama.cpp reads our blocks as pagedserve does (the same NLL on the same weights).

    python benchmarks/peer/own_quant_files.py --template DIR/SmolLM2-135M-Instruct.Q4_K_M.gguf \\
        --out DIR/SmolLM2-135M-Instruct.own-Q4_K_M.gguf
    python benchmarks/peer/own_quant_files.py --template FILE --format Q5_K --out FILE2
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ops.reference import formats, quantizers  # noqa: E402
from ops.reference import quant as ref  # noqa: E402

SKIPPED_KEYS = ("GGUF.", "general.architecture")  # the reader's own fields; the writer adds the architecture


def requantize(values: torch.Tensor, fmt: str) -> np.ndarray:
    """fp32 ``[rows, K]`` packed into ``fmt`` by our reference quantizers (uint8 ``[rows, bytes]``)."""
    if fmt in quantizers.QUANTIZERS:
        return quantizers.quantize(values, fmt).numpy()
    return ref.quantize(values, formats.by_name(fmt).type_id).numpy()


def target_format(source: str, k: int, wanted: str | None) -> str:
    """The format a tensor of ``source`` format and row length ``k`` is written in."""
    if wanted is not None and k % formats.by_name(wanted).block_size == 0:
        return wanted
    return source


def write_file(template: Path, out: Path, wanted: str | None) -> dict[str, int]:
    """Write ``out`` from ``template`` (module docstring); the count of tensors per written format."""
    import gguf

    reader = gguf.GGUFReader(str(template))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(out), arch)
    for name, field in reader.fields.items():
        if name.startswith(SKIPPED_KEYS):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        writer.add_key_value(name, field.contents(), vtype, sub)
    counts: dict[str, int] = {}
    for tensor in tqdm(reader.tensors, desc=out.name, unit="tensor"):
        source = tensor.tensor_type.name
        shape = [int(d) for d in reversed(tensor.shape)]  # gguf lists dims fastest first
        if source in ("F32", "F16"):
            writer.add_tensor(tensor.name, np.asarray(tensor.data).reshape(shape), raw_dtype=tensor.tensor_type)
            counts[source] = counts.get(source, 0) + 1
            continue
        packed = torch.from_numpy(np.asarray(tensor.data).reshape(shape[0], -1).copy())
        values = formats.by_name(source).dequantize(packed)  # the file's own fp32 values
        fmt = target_format(source, values.shape[1], wanted)
        writer.add_tensor(tensor.name, requantize(values, fmt), raw_dtype=gguf.GGMLQuantizationType[fmt])
        counts[fmt] = counts.get(fmt, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--template", type=Path, required=True, help="a GGUF file: metadata, tokenizer, formats")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--format", default=None, help="write every tensor whose rows allow it in this format")
    args = parser.parse_args()
    counts = write_file(args.template, args.out, args.format)
    print(json.dumps({"part": "own_quant_file", "template": args.template.name, "out": str(args.out),
                      "formats": counts}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
