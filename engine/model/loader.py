"""Build a paged model from a Hugging Face directory (safetensors / .bin) or a single GGUF file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from common.log import get_logger
from engine.model.execution_policy import ExecutionPolicy
from engine.model.gguf_config import (
    GGUF_CONFIG_ARCHS,
    GGUFMetadata,
    config_from_gguf,
    fix_transformers_config,
    gguf_architecture,
)
from engine.model.layers import Linear
from engine.model.llama import LlamaForCausalLM
from engine.model.sharding import SINGLE, TPShard
from engine.model.spec import ModelSpec

log = get_logger("loader")

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


class ModelLoadError(ValueError):
    """The model path or its contents cannot be used (message names the path and what is wrong)."""


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """`"fp32" | "bf16" | "fp16"` (or long names, or a torch dtype) → torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; choose one of float32, bfloat16, float16")
    return DTYPES[dtype]


def tokenizer_dir(model: str | Path, tokenizer: str | None = None) -> str:
    """The directory the tokenizer and chat template are read from (by the engine, and by gateways
    through the heartbeat): `tokenizer` when given; a model directory itself; for a `.gguf`, the
    directory beside it when that holds a Hugging Face tokenizer (as `fetch-model` lays it out),
    else the file's own tokenizer metadata exported once into the cache."""
    if tokenizer:
        return str(Path(tokenizer).expanduser())
    p = Path(model).expanduser()
    if not p.is_file():
        return str(p)
    if any((p.parent / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        return str(p.parent)
    return str(_export_gguf_tokenizer(p))


def _export_gguf_tokenizer(gguf: Path) -> Path:
    """The GGUF's tokenizer and chat template, saved once as a Hugging Face tokenizer directory."""
    import contextlib
    import hashlib
    import os
    import shutil
    import tempfile

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    stat = gguf.stat()
    key = hashlib.blake2b(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode(), digest_size=8).hexdigest()
    base = os.environ.get("PAGEDSERVE_CACHE")
    target = (Path(base).expanduser() if base else Path.home() / ".cache" / "pagedserve") / "tokenizers" / key
    if not (target / "tokenizer_config.json").is_file():
        # AutoTokenizer reads the file's config through transformers' GGUF loader, which refuses the
        # architectures engine.model.gguf_config maps; the tokenizer metadata itself is the same
        # (`tokenizer.ggml.*`), so their tokenizer is built from it without that config
        loader = PreTrainedTokenizerFast if gguf_architecture(gguf) in GGUF_CONFIG_ARCHS else AutoTokenizer
        try:
            tok = loader.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"{str(gguf)!r} has no usable tokenizer metadata ({exc}); "
                                 "pass --tokenizer DIR") from exc
        # Written beside the target, then renamed into place: engines (and test workers) starting
        # at once from one file never read a half-written directory.
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=target.parent))
        tok.save_pretrained(str(staging))
        try:
            os.rename(staging, target)
            log.info("exported the GGUF's tokenizer", gguf=str(gguf), dir=str(target))
        except OSError:  # another process got there first (its copy is the same), or a broken old one
            if not (target / "tokenizer_config.json").is_file():
                shutil.rmtree(target, ignore_errors=True)
                with contextlib.suppress(OSError):
                    os.rename(staging, target)
            shutil.rmtree(staging, ignore_errors=True)
    return target


def load_hf_config(path: str | Path) -> Any:
    """The transformers config of a model directory or GGUF file; ModelLoadError if there is none."""
    from transformers import AutoConfig

    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(
            f"model path {str(p)!r} does not exist (run `pagedserve fetch-model` for the default model)"
        )
    try:
        if p.is_file():
            if p.suffix != ".gguf":
                raise ModelLoadError(f"model file {str(p)!r} is not a .gguf; pass a directory or a .gguf")
            arch = gguf_architecture(p)
            if arch in GGUF_CONFIG_ARCHS:  # families transformers' GGUF loader does not map
                return config_from_gguf(p)
            config = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
            # what transformers' config drops: expert sizes, rope scaling and rope_freqs, Mixtral's experts
            return fix_transformers_config(config, GGUFMetadata(p))
        if not (p / "config.json").is_file():
            raise ModelLoadError(f"model directory {str(p)!r} has no config.json")
        return AutoConfig.from_pretrained(str(p))
    except (OSError, ValueError, KeyError) as exc:
        if isinstance(exc, ModelLoadError):
            raise
        raise ModelLoadError(f"cannot read the model config at {str(p)!r}: {exc}") from exc


def _iter_safetensors_slices(files: list[Path], spec: ModelSpec, shard: TPShard) -> Iterator[tuple[str, Tensor]]:
    """Each tensor's slice for this rank, read with `get_slice` (only those bytes leave the file)."""
    from safetensors.torch import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                part = f.get_slice(name)
                cut = shard.weight_slice(name, tuple(part.get_shape()), spec)
                if cut is None:
                    continue
                dim, start, length = cut
                yield name, part[(slice(None),) * dim + (slice(start, start + length),)]


def _iter_directory_weights(directory: Path) -> Iterator[tuple[str, Tensor]]:
    from safetensors.torch import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if files:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                    yield name, f.get_tensor(name)
        return
    bins = sorted(directory.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelLoadError(f"model directory {str(directory)!r} has no *.safetensors or pytorch_model*.bin")
    for file in bins:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


def load_gguf(path: Path, dtype: Any = None, progress: bool = True) -> Any:
    """Dequantize a GGUF file through transformers' loader; returns the HF model (`convert` and the
    dequantize path of the families transformers reads)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if progress:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype or torch.float32
    )


def _iter_gguf_weights(file: Path, model: LlamaForCausalLM, pack_experts: bool = False) -> Iterator[tuple[str, Tensor]]:
    """The GGUF's tensors dequantized to fp32 under their HF names: read here for the families whose
    config engine.model.gguf_config builds and for the Qwen-MoE files (transformers' loader builds
    them with its default expert sizes), through transformers' loader for the others. gpt-oss with
    `pack_experts`: its packed expert weights go straight onto `model` (engine.model.gguf_gpt_oss)."""
    if model.spec.model_type == "gpt_oss":
        from engine.model.gguf_gpt_oss import iter_gpt_oss_weights

        yield from iter_gpt_oss_weights(file, model, pack_experts)
        return
    if model.spec.model_type in (*_OWN_CONFIG_TYPES, *GGUF_MOE_TYPES, "mixtral"):
        from engine.model.gguf_weights import iter_dequantized_weights

        yield from iter_dequantized_weights(model, file)
        return
    yield from load_gguf(file, torch.float32, progress=False).state_dict().items()


QUANTIZATIONS = ("auto", "requantize", "dequantize")
# the families whose GGUF metadata and tensor names convert.py and gguf_weights.py map
GGUF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "mixtral",
                    *GGUF_CONFIG_ARCHS.values())
# the families whose GGUF rope (scaling keys, rope_freqs) the config carries (engine.model.gguf_rope);
# the others' files are checked by `_check_gguf`
_ROPE_MAPPED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral",
                      *GGUF_CONFIG_ARCHS.values())
# configs built by engine.model.gguf_config; their weights dequantized by gguf_weights too
_OWN_CONFIG_TYPES = tuple(GGUF_CONFIG_ARCHS.values())
# mixture-of-experts GGUF files whose config transformers' loader reads (expert sizes from the file's keys:
# `gguf_config.moe_sizes`); their tensors read by gguf_weights, packed (experts as `PackedExperts`) or dequantized
GGUF_MOE_TYPES = ("qwen3_moe", "qwen2_moe")


def _check_gguf(path: Path, spec: ModelSpec) -> None:
    """ModelLoadError for a file whose header cannot be read; and a GGUF of the families whose rotary
    neither transformers' GGUF config nor gguf_rope carries
    (Gemma 3, Phi-3) is refused, as it would be served with full default rope: `rope.scaling.type`
    other than none (Gemma 3 4B+'s linear factor), a `rope_freqs` tensor, and for Phi-3 partial
    rotary (Phi-4-mini) or longrope's `rope_factors_*` tensors."""
    from engine.model.gguf_header import GGUFHeader, GGUFHeaderError

    try:
        header = GGUFHeader(path)
    except (GGUFHeaderError, OSError) as exc:  # empty, truncated or not a GGUF at all
        raise ModelLoadError(f"{str(path)!r} is not a readable GGUF file: {exc}") from exc
    if spec.model_type in _ROPE_MAPPED_TYPES:
        return
    fields = header.fields
    arch = fields.get("general.architecture", spec.model_type)
    # llama.cpp reads an absent scaling type as linear, so a factor alone scales too
    factor = fields.get(f"{arch}.rope.scaling.factor", fields.get(f"{arch}.rope.scale_linear", 0.0)) or 1.0
    kind = fields.get(f"{arch}.rope.scaling.type", "linear" if factor != 1.0 else "none")
    if kind not in ("none", ""):
        raise ModelLoadError(f"{str(path)!r}: a {arch} GGUF with rope scaling {kind!r} is not supported "
                             "(transformers' GGUF config drops it); pass the Hugging Face safetensors directory")
    if "rope_freqs.weight" in header.tensors:
        raise ModelLoadError(f"{str(path)!r}: a {arch} GGUF with rope_freqs.weight is not supported (transformers' "
                             "GGUF config drops it); pass the Hugging Face safetensors directory")
    if spec.model_type != "phi3":
        return
    dims = int(fields.get("phi3.rope.dimension_count", spec.head_dim))
    factors = sorted(name for name in header.tensors if name.startswith("rope_factors"))
    if dims != spec.head_dim or factors:
        raise ModelLoadError(f"{str(path)!r}: a phi3 GGUF with {dims} of {spec.head_dim} head dims rotated"
                             f"{' and ' + ', '.join(factors) if factors else ''} is not supported (transformers' "
                             "GGUF config keeps full default rope); pass the Hugging Face safetensors directory")


def _load_quantized(model: LlamaForCausalLM, path: Path, requantize: bool) -> None:
    from engine.model.gguf_weights import GGUFWeightError, load_gguf_quantized

    try:
        load_gguf_quantized(model, path, requantize=requantize)
    except GGUFWeightError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


def load_model(
    path: str | Path, dtype: str | torch.dtype | None = None, device: torch.device | str = "cpu",
    quantization: str = "auto", shard: TPShard = SINGLE, spec: ModelSpec | None = None,
    policy: ExecutionPolicy | None = None, pooling: bool = False,
) -> LlamaForCausalLM:
    """Load a Llama-family model for paged inference; raises ModelLoadError or UnsupportedModelError.
    `spec` is the caller's `ModelSpec` of `load_hf_config(path)` if it has one (for a .gguf that read
    parses the file's whole metadata, tokenizer arrays included: once is enough).

    A `.gguf` keeps its quantized weights packed (`engine.model.gguf_weights`; fp32 activations on
    the CPU) unless `quantization="dequantize"`, which dequantizes everything to `dtype` first;
    `"requantize"` serves the tensors of formats without a kernel (K-quants, Q5) as Q8_0 instead of fp32.
    With a `shard` of size N, the rank's part of the model (`engine.model.sharding`): a safetensors
    directory is read slice by slice; other formats are read whole and cut. `spec`, when given,
    is the model's (read by rank 0), so a spawned rank need not import transformers to read it.
    `policy` fixes the model's execution modes (`ExecutionPolicy`; its `dtype` is the model's);
    without one, the default policy in `dtype` (float32 when that is None too). A `dtype` beside a
    policy must be the policy's. `pooling`: an embedding model (`engine.model.pooling`) needs no
    lm_head: none is kept (a checkpoint's is skipped), and a headless checkpoint's tensors
    (`Qwen3Model`'s `layers.0...`, without the `model.` prefix) are read too.
    """
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization {quantization!r}; choose one of {list(QUANTIZATIONS)}")
    p = Path(path).expanduser()
    policy = _policy(dtype, policy)
    torch_dtype = policy.dtype
    quantized = p.is_file() and quantization in ("auto", "requantize")
    spec = spec or ModelSpec.from_hf_config(load_hf_config(p))
    if p.is_file() and spec.model_type not in GGUF_MODEL_TYPES + GGUF_MOE_TYPES:
        raise ModelLoadError(f"{str(p)!r}: GGUF files of model type {spec.model_type!r} are not supported (their "
                             "metadata and tensor names are mapped for "
                             f"{', '.join(GGUF_MODEL_TYPES + GGUF_MOE_TYPES)}); "
                             "pass the Hugging Face safetensors directory instead")
    if p.is_file():
        _check_gguf(p, spec)
    pack_experts = quantized and spec.model_type == "gpt_oss"  # gguf_gpt_oss: experts packed where they can run
    if pack_experts:  # so, with its log line; every other tensor of the file is dequantized
        quantized = False
    if quantized and (torch_dtype != torch.float32 or torch.device(device).type != "cpu"):
        raise ModelLoadError(f"quantized GGUF weights run in fp32 on the CPU; got dtype {torch_dtype} on "
                             f"{device} (pass quantization='dequantize' to convert the weights instead)")
    if any(spec.layer_windows):
        log.info("sliding window attention", sliding_window=spec.sliding_window,
                 sliding_layers=sum(1 for w in spec.layer_windows if w), layers=spec.num_layers)
    model_cls = LlamaForCausalLM
    if spec.model_type == "gpt_oss":  # attention sinks; packed experts installed as they are read
        from engine.model.gpt_oss import GptOssForCausalLM

        model_cls = GptOssForCausalLM
    with torch.device("meta"):  # no random init: every parameter is overwritten by the checkpoint
        model = model_cls(spec, shard, policy).to(dtype=torch_dtype)
    model.to_empty(device=device)
    if spec.tie_word_embeddings and shard.owns_lm_head:  # to_empty unties parameters; tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    if pooling and not spec.tie_word_embeddings:  # no vocabulary rows: an embedding model has no lm_head
        with torch.device("meta"):
            model.lm_head = Linear(spec.hidden_size, 0, bias=False).to(dtype=torch_dtype)
        model.lm_head.to_empty(device=device)
    safetensors = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    if quantized:
        _load_quantized(model, p, requantize=quantization == "requantize")
    elif shard.size > 1 and safetensors:
        model.load_weights(_iter_safetensors_slices(safetensors, spec, shard), presliced=True)
    else:
        weights = _iter_gguf_weights(p, model, pack_experts) if p.is_file() else _iter_directory_weights(p)
        model.load_weights(_backbone_weights(weights) if pooling else weights)
    model.eval()
    log.info("model loaded", path=str(p), model_type=spec.model_type, layers=spec.num_layers,
             dtype=str(torch_dtype), quantized=quantized, rank=shard.rank, tensor_parallel_size=shard.size)
    return model


def _backbone_weights(weights: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """A pooling model's tensors: no lm_head, every backbone tensor under the `model.` prefix (a
    headless checkpoint, saved from `Qwen3Model` or `LlamaModel`, stores them without it)."""
    for name, tensor in weights:
        if name.startswith("lm_head."):
            continue
        yield (name if name.startswith("model.") else f"model.{name}"), tensor


def _policy(dtype: str | torch.dtype | None, policy: ExecutionPolicy | None) -> ExecutionPolicy:
    """The policy `load_model` builds with: `policy`, or the default one in `dtype`."""
    if policy is None:
        return ExecutionPolicy(dtype=resolve_dtype("float32" if dtype is None else dtype))
    if dtype is not None and resolve_dtype(dtype) != policy.dtype:
        raise ModelLoadError(f"dtype {dtype} disagrees with the execution policy's {policy.dtype}")
    return policy
