"""NLL of a fixed passage on one GGUF file, by llama.cpp and by pagedserve, same token ids, JSON lines.

    .venv/bin/python benchmarks/peer/llama_cpp_nll.py --gguf FILE[,FILE...] \\
        --peer-python ~/.cache/pagedserve/peer/llama-cpp-venv/bin/python

The passage is ``quality/quant_quality.py``'s, tokenized once by the default model's tokenizer; the
same ids go to both sides (no BOS added by either). pagedserve: the engine as ``up`` builds it
(``--dtype``, ``--kv-cache-dtype``; ``auto`` by default) with ``prompt_logprobs``, i.e. one prefill.
llama.cpp: llama-cpp-python in its own venv (this file run with ``--peer-ids``), one ``llama_decode``
of the whole passage with logits for every position, log-softmax in float64. Per file: both mean NLLs
per predicted token and ``rel_diff_pct`` = 100 (pagedserve - llama.cpp) / llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

from common.openmp_env import peer_environ

ROOT = Path(__file__).resolve().parents[2]


def llama_cpp_nll(gguf: str, ids: list[int], threads: int) -> float:
    """Mean NLL per predicted token of `ids` by llama.cpp (run inside the llama-cpp-python venv)."""
    import llama_cpp
    import numpy as np

    llama_cpp.llama_backend_init()
    # default params, as its users run it (repacked layouts on); on AMX CPUs llama.cpp is built
    # without AMX (setup_llama_cpp.sh), whose matmul dies with SIGILL on the VMs that report AMX
    model = llama_cpp.llama_model_load_from_file(gguf.encode(), llama_cpp.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {gguf}")
    n = len(ids)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = cparams.n_batch = cparams.n_ubatch = max(512, n)
    cparams.n_threads = cparams.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    batch = llama_cpp.llama_batch_init(n, 0, 1)
    for i, tok in enumerate(ids):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, i, 1, True
        batch.seq_id[i][0] = 0
    batch.n_tokens = n
    if llama_cpp.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(n, vocab)).astype(np.float64)
    rows = logits[:-1]
    top = rows.max(axis=1, keepdims=True)
    logz = np.log(np.exp(rows - top).sum(axis=1)) + top[:, 0]
    nll = logz - rows[np.arange(n - 1), ids[1:]]
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    return float(nll.mean())


def pagedserve_nll(gguf: str, ids: list[int], dtype: str, kv_cache_dtype: str) -> float:
    """Mean NLL per predicted token of `ids` by the engine on `gguf` (prompt logprobs, one prefill)."""
    from common.sampling_params import SamplingParams
    from engine.llm import LLM

    with LLM(gguf, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=1 << 27) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
        out = llm.generate([ids], params)[0]
    logprobs = [entry["logprob"] for entry in out.prompt_logprobs or [] if entry is not None]
    if len(logprobs) != len(ids) - 1:
        raise RuntimeError(f"{len(logprobs)} prompt logprobs for {len(ids)} tokens")
    return -math.fsum(logprobs) / len(logprobs)


def passage_ids() -> list[int]:
    """quant_quality's passage in the default model's tokenizer."""
    from transformers import AutoTokenizer

    from benchmarks.quality.quant_quality import PASSAGE
    from engine.model.fetch import default_model_dir

    return list(AutoTokenizer.from_pretrained(str(default_model_dir(progress=False)))(PASSAGE)["input_ids"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True, help="comma-separated GGUF files")
    parser.add_argument("--peer-python", help="python of the llama-cpp-python venv (required unless --peer-ids)")
    parser.add_argument("--peer-ids", help="(peer side) JSON file of token ids: print llama.cpp's NLL and exit")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    if args.peer_ids:
        ids = json.loads(Path(args.peer_ids).read_text())
        print(json.dumps({"nll": llama_cpp_nll(args.gguf, ids, args.threads)}), flush=True)
        return
    if not args.peer_python:
        parser.error("--peer-python is required")
    sys.path.insert(0, str(ROOT))
    ids = passage_ids()
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(ids, f)
    for gguf in args.gguf.split(","):
        gguf = str(Path(gguf).expanduser())
        out = subprocess.run([args.peer_python, __file__, "--gguf", gguf, "--peer-ids", f.name,
                              "--threads", str(args.threads)], check=True, capture_output=True, text=True,
                             env=peer_environ()).stdout
        peer = float(json.loads(out.strip().splitlines()[-1])["nll"])
        ours = pagedserve_nll(gguf, ids, args.dtype, args.kv_cache_dtype)
        print(json.dumps({"part": "nll", "gguf": Path(gguf).name, "tokens": len(ids), "dtype": args.dtype,
                          "kv_cache_dtype": args.kv_cache_dtype, "pagedserve": round(ours, 5),
                          "llama_cpp": round(peer, 5), "rel_diff_pct": round(100 * (ours - peer) / peer, 3)}),
              flush=True)
    Path(f.name).unlink()


if __name__ == "__main__":
    main()
