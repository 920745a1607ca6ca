"""The transformers config of a GGUF file whose architecture transformers' GGUF loader does not map
(OLMo 2, Granite, SmolLM3) or maps without its layer pattern, yarn and clamp (gpt-oss), built from
llama.cpp's per-architecture metadata keys so that `ModelSpec.from_hf_config` reads it as it reads
the family's `config.json`.

What llama.cpp's converter writes and its runtime reads, key by key:

- every family: `{arch}.block_count`, `.embedding_length`, `.feed_forward_length`, `.context_length`,
  `.attention.head_count`, `.attention.head_count_kv`, `.attention.key_length` (when the head is
  not hidden / heads), `.attention.layer_norm_rms_epsilon`, `.rope.freq_base`; `output.weight`
  absent when the lm_head is the embedding; biases present as tensors;
- granite: `.embedding_scale`, `.residual_scale`, `.attention.scale`, `.logit_scale` (transformers'
  embedding_multiplier, residual_multiplier, attention_multiplier, logits_scaling), all four
  required, as llama.cpp's loader requires them;
- smollm3: no key for the NoPE layers; llama.cpp fixes them at every 4th layer
  (`n_no_rope_layer_step = 4`, rotary off where (layer + 1) % 4 == 0), which is transformers'
  default `no_rope_layer_interval` pattern, so that is the config built here;
- gpt-oss: `.expert_count`, `.expert_used_count`, `.expert_feed_forward_length`,
  `.attention.sliding_window` (the even layers, llama.cpp's swa pattern 2), yarn's
  `.rope.scaling.factor`, `.original_context_length`, `.yarn_beta_fast` / `_slow`; the SwiGLU clamp
  (limit 7, alpha 1.702) is fixed in llama.cpp's graph and in no key (`GPT_OSS_FIXED`).

The rotary embedding (rope base, linear / YaRN scaling, Llama 3.x's `rope_freqs` tensor) is
`engine.model.gguf_rope`'s mapping, for these families and for the Llama-shaped files whose config
transformers reads (`gguf_rope_parameters`); gpt-oss keeps its own YaRN reading.

A Mixtral file is llama.cpp's `llama` architecture with `llama.expert_count` and stacked
`ffn_{gate,up,down}_exps`: `mixtral_config` turns transformers' Llama config of it into a
`MixtralConfig` (the expert size is `feed_forward_length`, as the converter writes it).

Refused by name rather than approximated: what gguf_rope refuses; gpt-oss's yarn without its
attention / extrapolation factors; partial rotary, OLMo 3's sliding window (an `olmo2` file with
`sliding_window`), per-layer head counts, q/k/v clamping and experts outside gpt-oss.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

from engine.model.gguf_header import GGUFHeader, GGUFHeaderError
from engine.model.gguf_rope import GGUFRopeError, gguf_rope_parameters

# GGUF architecture -> transformers model_type, for the files this module builds the config of
GGUF_CONFIG_ARCHS = {"olmo2": "olmo2", "granite": "granite", "smollm3": "smollm3", "gpt-oss": "gpt_oss"}
SMOLLM3_NO_ROPE_STEP = 4  # llama.cpp's hparams.n_no_rope_layer_step for smollm3
# what llama.cpp's gpt-oss graph fixes and its converter writes in no key: the clamped SwiGLU's
# limit and alpha, and gpt-oss's yarn without truncation (transformers' GptOssConfig)
GPT_OSS_FIXED = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}
_YARN_BETAS = {"beta_fast": ("yarn_beta_fast", 32.0), "beta_slow": ("yarn_beta_slow", 1.0)}  # key, default
_UNREAD_YARN = ("attn_factor", "yarn_attn_factor", "yarn_ext_factor", "yarn_log_multiplier")
_GGUF_STRING = 8  # GGUF metadata value type of a string
_REQUIRED = object()


class GGUFConfigError(ValueError):
    """A GGUF file's metadata describes a model this module cannot build a config for (named)."""


def gguf_architecture(path: Path) -> str | None:
    """The file's `general.architecture`, read from the header alone when it is the first key (where
    llama.cpp's and the gguf package's writers put it), else with `gguf.GGUFReader`; None when the
    file is not a readable GGUF or names none."""
    try:
        with path.open("rb") as f:
            arch = _first_key_architecture(f.read(4096))
    except OSError:
        return None
    if arch is not None:
        return arch
    import gguf

    try:
        field = gguf.GGUFReader(str(path)).fields.get("general.architecture")
    except (ValueError, OSError):
        return None
    return str(field.contents()) if field is not None else None


def _first_key_architecture(head: bytes) -> str | None:
    """The architecture string when the first metadata key of the GGUF header `head` is
    `general.architecture` (magic, version u32, tensor count u64, key count u64, then key, type, value)."""
    try:
        if head[:4] != b"GGUF" or struct.unpack_from("<Q", head, 16)[0] == 0:
            return None
        key_end = 32 + struct.unpack_from("<Q", head, 24)[0]
        if head[32:key_end] != b"general.architecture" or struct.unpack_from("<I", head, key_end)[0] != _GGUF_STRING:
            return None
        length = struct.unpack_from("<Q", head, key_end + 4)[0]
        return head[key_end + 12 : key_end + 12 + length].decode()
    except (struct.error, UnicodeDecodeError):
        return None


# transformers' GGUF config of these keeps its defaults for the expert sizes (it maps no key for them)
_MOE_SIZE_KEYS = {"qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
                  "qwen2moe": {"expert_feed_forward_length": "moe_intermediate_size",
                               "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}}
# the architectures whose config transformers reads and whose rope gguf_rope maps (transformers'
# GGUF config keeps rope_theta only); the others (gemma3, phi3) are checked by the loader
ROPE_MAPPED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "qwen2moe", "qwen3moe")


def moe_sizes(meta: GGUFMetadata) -> dict[str, int]:
    """The expert sizes a `qwen3moe` / `qwen2moe` file states (`{arch}.expert_feed_forward_length`,
    `.expert_shared_feed_forward_length`) as transformers config fields; {} for other archs."""
    keys = _MOE_SIZE_KEYS.get(meta.arch, {})
    return {name: int(meta.get(f"{{arch}}.{key}")) for key, name in keys.items()
            if meta.get(f"{{arch}}.{key}", None) is not None}


def fix_transformers_config(config: Any, meta: GGUFMetadata) -> Any:
    """transformers' GGUF config of a file with what it drops: the expert sizes (`moe_sizes`), the
    rope scaling (`gguf_rope_parameters`, for ROPE_MAPPED_ARCHS), and a `llama` file with experts
    as the `MixtralConfig` it is; GGUFConfigError for what does not map."""
    for name, value in moe_sizes(meta).items():
        setattr(config, name, value)
    if meta.arch in ROPE_MAPPED_ARCHS:
        heads = int(meta.get("{arch}.attention.head_count"))
        head_dim = int(meta.get("{arch}.attention.key_length", int(meta.get("{arch}.embedding_length")) // heads))
        try:
            config.rope_parameters = gguf_rope_parameters(meta, int(meta.get("{arch}.rope.dimension_count", head_dim)))
        except GGUFRopeError as exc:
            raise GGUFConfigError(str(exc)) from None
    if meta.arch == "llama" and int(meta.get("{arch}.expert_count", 0) or 0) > 0:
        return mixtral_config(config, meta)
    return config


def mixtral_config(llama: Any, meta: GGUFMetadata) -> Any:
    """The `MixtralConfig` of a `llama` GGUF with experts (llama.cpp's Mixtral): transformers' Llama
    config of the file with `expert_count` experts, `expert_used_count` per token (softmax over all,
    top-k renormalised, as transformers' Mixtral routes), each expert `feed_forward_length` wide;
    no sliding window (llama.cpp's llama graph has none)."""
    from transformers import MixtralConfig

    if meta.get("{arch}.expert_feed_forward_length", None) not in (None, llama.intermediate_size):
        raise GGUFConfigError("a llama GGUF with experts whose expert_feed_forward_length differs from "
                              "feed_forward_length is not supported (Mixtral's experts are the MLP's size)")
    if any(name.endswith(".bias") for name in meta.tensors):
        raise GGUFConfigError("a llama GGUF with experts and bias tensors is not supported (Mixtral has no biases)")
    if meta.get("{arch}.expert_shared_count", 0) or meta.get("{arch}.expert_gating_func", None) not in (None, 1):
        raise GGUFConfigError("a llama GGUF with shared experts or a gating function other than softmax is not "
                              "supported (Mixtral routes by softmax, no shared expert)")
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_parameters",
              "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    values = {name: getattr(llama, name) for name in fields if getattr(llama, name, None) is not None}
    head_dim = getattr(llama, "head_dim", None)
    if head_dim and head_dim != llama.hidden_size // llama.num_attention_heads:
        values["head_dim"] = head_dim
    return MixtralConfig(**values, num_local_experts=int(meta.get("{arch}.expert_count")),
                         num_experts_per_tok=int(meta.get("{arch}.expert_used_count")), sliding_window=None)


def _decimal(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it: the config.json value the
    converter narrowed (1e-05, not 9.99999974e-06), so the config equals the checkpoint's."""
    import numpy as np

    return float(str(np.float32(value)))


class GGUFMetadata:
    """The file's metadata values and tensor names, read once from its header (`GGUFHeader`: the
    tokenizer's string arrays are stepped over, not read)."""

    def __init__(self, path: Path) -> None:
        self._header = GGUFHeader(path)
        self.fields = self._header.fields
        self.tensors = {name: info.shape for name, info in self._header.tensors.items()}
        self.arch = str(self.fields.get("general.architecture", ""))

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        """The value of `key` (`{arch}` replaced by the architecture); `default` when absent, or
        GGUFConfigError when there is none."""
        key = key.replace("{arch}", self.arch)
        if key not in self.fields:
            if default is _REQUIRED:
                raise GGUFConfigError(f"a {self.arch} GGUF needs the metadata key {key!r}, "
                                      "which this file lacks")
            return default
        return self.fields[key]

    def tensor_values(self, name: str) -> list[float] | None:
        """The values of a float (F32 / F16) tensor of the file, None when it has none of that name."""
        try:
            return self._header.float_tensor(name)
        except GGUFHeaderError as exc:
            raise GGUFConfigError(str(exc)) from None


def config_from_gguf(path: Path) -> Any:
    """The transformers config (`Olmo2Config`, `GraniteConfig`, `SmolLM3Config`) of the GGUF at `path`;
    GGUFConfigError for another architecture or a file whose options are not supported."""
    from transformers import AutoConfig

    meta = GGUFMetadata(path)
    if meta.arch not in GGUF_CONFIG_ARCHS:
        raise GGUFConfigError(f"no GGUF config mapping for architecture {meta.arch!r} (mapped here: "
                              f"{', '.join(GGUF_CONFIG_ARCHS)})")
    _refuse_unsupported(meta)
    values = _common(meta)
    if meta.arch == "granite":
        values |= _granite(meta)
    elif meta.arch == "smollm3":
        values |= _smollm3(values["num_hidden_layers"])
    elif meta.arch == "gpt-oss":
        values |= _gpt_oss(meta, values)
    return AutoConfig.for_model(GGUF_CONFIG_ARCHS[meta.arch], **values)


def _common(meta: GGUFMetadata) -> dict[str, Any]:
    """The Llama-shaped fields every mapped family shares."""
    heads = int(meta.get("{arch}.attention.head_count"))
    kv_heads = meta.get("{arch}.attention.head_count_kv", heads)
    if not isinstance(kv_heads, int):
        raise GGUFConfigError(f"a {meta.arch} GGUF with per-layer KV head counts ({kv_heads}) is not supported")
    hidden = int(meta.get("{arch}.embedding_length"))
    head_dim = int(meta.get("{arch}.attention.key_length", hidden // heads))
    value_dim = int(meta.get("{arch}.attention.value_length", head_dim))
    rotary = int(meta.get("{arch}.rope.dimension_count", head_dim))
    if value_dim != head_dim or rotary != head_dim:
        raise GGUFConfigError(f"a {meta.arch} GGUF with key length {head_dim}, value length {value_dim} and "
                              f"{rotary} rotary dims is not supported (one head_dim, fully rotated)")
    embed = meta.tensors.get("token_embd.weight")
    vocab = meta.get("{arch}.vocab_size", embed[0] if embed else None)
    if vocab is None:
        raise GGUFConfigError(f"a {meta.arch} GGUF without {meta.arch}.vocab_size or token_embd.weight")
    values: dict[str, Any] = {
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(meta.get("{arch}.feed_forward_length")),
        "num_hidden_layers": int(meta.get("{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "max_position_embeddings": int(meta.get("{arch}.context_length")),
        "rms_norm_eps": _decimal(meta.get("{arch}.attention.layer_norm_rms_epsilon")),
        "rope_parameters": _rope(meta, head_dim),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in meta.tensors,
        "attention_bias": "blk.0.attn_q.bias" in meta.tensors,
        # absent ids stay None: the config classes' defaults are one checkpoint's vocabulary
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id", None),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id", None),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id", None),
    }
    if head_dim != hidden // heads:
        values["head_dim"] = head_dim
    if meta.arch != "olmo2":
        values["mlp_bias"] = "blk.0.ffn_up.bias" in meta.tensors
    return values


def _rope(meta: GGUFMetadata, head_dim: int) -> dict[str, Any]:
    """gguf_rope's parameters of the file (gpt-oss: the base alone; `_gpt_oss` reads its YaRN)."""
    if meta.arch == "gpt-oss":
        return {"rope_type": "default", "rope_theta": _decimal(meta.get("{arch}.rope.freq_base", 10000.0))}
    try:
        return gguf_rope_parameters(meta, head_dim)
    except GGUFRopeError as exc:
        raise GGUFConfigError(str(exc)) from None


def _granite(meta: GGUFMetadata) -> dict[str, Any]:
    """Granite's four multipliers, under llama.cpp's `*_scale` names."""
    return {"embedding_multiplier": _decimal(meta.get("{arch}.embedding_scale")),
            "residual_multiplier": _decimal(meta.get("{arch}.residual_scale")),
            "attention_multiplier": _decimal(meta.get("{arch}.attention.scale")),
            "logits_scaling": _decimal(meta.get("{arch}.logit_scale"))}


def _smollm3(layers: int) -> dict[str, Any]:
    """SmolLM3's NoPE layers as llama.cpp runs them: rotary off in every 4th layer; no sliding window."""
    step = SMOLLM3_NO_ROPE_STEP
    return {"no_rope_layer_interval": step, "no_rope_layers": [int((i + 1) % step != 0) for i in range(layers)],
            "use_sliding_window": False, "sliding_window": None}


def _gpt_oss(meta: GGUFMetadata, values: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: experts, sinks and biases (tensors), alternating sliding and full layers (llama.cpp's
    swa pattern 2: the even layers slide, as transformers' default `layer_types`), yarn rotary."""
    layers, heads = values["num_hidden_layers"], values["num_attention_heads"]
    rope = dict(values["rope_parameters"])
    if meta.get("{arch}.rope.scaling.type", "none") == "yarn":
        rope |= {"rope_type": "yarn", "factor": _decimal(meta.get("{arch}.rope.scaling.factor")),
                 "original_max_position_embeddings": int(meta.get("{arch}.rope.scaling.original_context_length")),
                 "truncate": False}
        rope |= {name: _decimal(meta.get(f"{{arch}}.rope.scaling.{key}", default))
                 for name, (key, default) in _YARN_BETAS.items()}
    return {"num_local_experts": int(meta.get("{arch}.expert_count")),
            "num_experts_per_tok": int(meta.get("{arch}.expert_used_count")),
            "intermediate_size": int(meta.get("{arch}.expert_feed_forward_length", values["intermediate_size"])),
            "sliding_window": int(meta.get("{arch}.attention.sliding_window")),
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
            # set even where it is hidden / heads: GptOssConfig's default (64) is one checkpoint's
            "head_dim": values.get("head_dim", values["hidden_size"] // heads),
            "rope_parameters": rope, **GPT_OSS_FIXED}


def _refuse_unsupported(meta: GGUFMetadata) -> None:
    """GGUFConfigError naming the first option of the file the config built here would drop."""
    gpt_oss = meta.arch == "gpt-oss"
    if gpt_oss:  # the others' rope: gguf_rope
        scaling = meta.get("{arch}.rope.scaling.type", "none")
        if scaling not in ("none", "", "yarn"):
            raise GGUFConfigError(f"a {meta.arch} GGUF with rope scaling {scaling!r} is not supported")
        for key in _UNREAD_YARN:
            if meta.get(f"{{arch}}.rope.scaling.{key}", None) is not None:
                raise GGUFConfigError(f"a {meta.arch} GGUF with rope.scaling.{key} is not supported")
        if "rope_freqs.weight" in meta.tensors:
            raise GGUFConfigError(f"a {meta.arch} GGUF with rope_freqs.weight is not supported")
    if not gpt_oss and meta.get("{arch}.attention.sliding_window", None):
        raise GGUFConfigError(f"a {meta.arch} GGUF with attention.sliding_window (OLMo 3) is not supported")
    if meta.get("{arch}.attention.clamp_kqv", None) is not None:
        raise GGUFConfigError(f"a {meta.arch} GGUF with attention.clamp_kqv is not supported")
    if not gpt_oss and meta.get("{arch}.expert_count", 0):
        raise GGUFConfigError(f"a {meta.arch} GGUF with experts is not supported")
