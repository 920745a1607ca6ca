"""llama.cpp's own Q4_K_M and Q6_K files of the default model, made by its quantizer, JSON lines.

Run with the venv of ``setup_llama_cpp.sh`` (``llama_cpp.llama_model_quantize``):

    ~/.cache/pagedserve/peer/llama-cpp-venv/bin/python benchmarks/peer/llama_cpp_files.py

The source is the highest-precision GGUF in the default model's folder (F32 > BF16 > F16 > Q8_0 >
... > Q4_0, by the type in the file name); below F16 llama.cpp requantizes (``allow_requantize``),
and the line printed per file names the source. Files go to
``~/.cache/pagedserve/models/llamacpp/SmolLM2-135M-Instruct.<TYPE>.gguf``, written to a temporary
name and renamed, so a reader never sees half a file; a file already there is reused.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path

MODEL = "SmolLM2-135M-Instruct"
MODEL_DIR = Path.home() / ".cache" / "pagedserve" / "models" / MODEL
OUT_DIR = Path.home() / ".cache" / "pagedserve" / "models" / "llamacpp"
# Source formats, most precise first; F16 and above need no requantizing.
PRECISION = ("F32", "BF16", "F16", "Q8_0", "Q6_K", "Q5_K_M", "Q5_1", "Q5_0", "Q4_K_M", "Q4_1", "Q4_0")
EXACT = {"F32", "BF16", "F16"}
TARGETS = ("Q4_K_M", "Q6_K")


def file_type(path: Path) -> str | None:
    """The format a GGUF's name states (``name.Q4_1.gguf`` -> ``Q4_1``), None if it names none."""
    match = re.search(r"\.([A-Za-z0-9_]+)\.gguf$", path.name)
    tag = match.group(1).upper() if match else None
    return tag if tag in PRECISION else None


def best_source(folder: Path) -> Path:
    """The most precise GGUF in `folder` (its name says the format)."""
    found = [(PRECISION.index(t), p) for p in folder.glob("*.gguf") if (t := file_type(p)) is not None]
    if not found:
        raise SystemExit(f"no GGUF file with a known type in {folder} (run `pagedserve fetch-model`)")
    return min(found)[1]


def quantize(source: Path, target: str, dest: Path, threads: int) -> None:
    """llama.cpp's quantizer from `source` to `target`, into `dest` by a temporary file and a rename."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{target}")
    params.nthread = threads
    params.allow_requantize = file_type(source) not in EXACT
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        code = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), params)
        if code != 0:
            raise RuntimeError(f"llama_model_quantize returned {code} for {target}")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", type=Path,
                        help="GGUF to quantize from (default: the most precise in the model folder)")
    parser.add_argument("--types", default=",".join(TARGETS), help="llama.cpp ftypes (LLAMA_FTYPE_MOSTLY_<TYPE>)")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR, help="where the files go, named after the source "
                        "(`name.F32.gguf` -> `name.Q4_K_M.gguf`; default %(default)s)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    source = args.source or best_source(MODEL_DIR)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for target in args.types.split(","):
        stem = source.name.removesuffix(".gguf")
        stem = stem.rsplit(".", 1)[0] if file_type(source) else stem  # `name.F32` -> `name`
        dest = args.out_dir / f"{stem if args.source else MODEL}.{target}.gguf"
        line = {"part": "file", "type": target, "path": str(dest), "source": str(source),
                "source_type": file_type(source), "requantized": file_type(source) not in EXACT}
        if dest.exists():
            line["made"] = "reused"
        else:
            start = time.perf_counter()
            quantize(source, target, dest, args.threads)
            line["made"] = f"{time.perf_counter() - start:.1f}s"
        line["bytes"] = dest.stat().st_size
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
