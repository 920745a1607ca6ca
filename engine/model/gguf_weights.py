"""Fill a paged Llama model from a GGUF file with its quantized weights kept packed where a kernel reads them.

Tensors are read with `gguf.GGUFReader` (memory-mapped); what each format becomes is the format
table's (`ops.reference.formats`: `runs`), and a format not in it is refused by name:

- weights in a packed format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) become
  `QuantLinear`
  modules; q/k/v and gate/up are stacked as packed row shards (one buffer when their formats
  agree); Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q6_K decoder weights are repacked eight rows
  at a time (`ops.quant.interleave`: the same values in the order the CPU kernel reads fastest);
- F32/F16/BF16 tensors (norms, biases, unquantized weights) are copied in as fp32, and tensors in a
  format without a kernel (none of the table's today) are dequantized to fp32 at load
  with the table's reference dequantization (the `gguf` package's bits);
- a linear layer whose shards are not all packed (e.g. Q4_K q beside Q8_0 v) stays the model's fp32
  `Linear` with every shard dequantized, so one module runs one path (the deterministic mode's
  `fixed_gemm`, the bf16 logit screen of an fp32 lm_head, the fused decoder's refusal of such layers);
  a dequantized token embedding is a plain `nn.Embedding`;
- a Qwen-MoE file's stacked experts (`ffn_{gate,up,down}_exps`) become `PackedExperts` when all three
  are packed, else the fp32 `Experts` with all three dequantized (logged); its router and shared-expert
  gate are fp32 parameters, its shared expert `QuantLinear`s like any MLP;
- the token embedding stays packed (`QuantEmbedding`), and a tied lm_head runs the quantized
  kernel on the same packed bytes (fewer bytes per decode step than the fp32 lm_head or its bf16
  logit screen), with fp32 activations (the greedy argmax of the stored weights); greedy rows
  go through its int8-activation screen (`engine.model.quant_screen`), which decides the same token;
- llama.cpp's converter permutes the rows of Q and K within each head (RoPE's interleaved pairs) for
  the Llama-derived architectures (`ROPE_PERMUTED_ARCHS`); whole rows are moved back here, which is
  possible in packed form because blocks run along K.

With `requantize` (off by default: it rounds the file's weights a second time) a 2-D tensor in a
format without a kernel is requantized to Q8_0 instead of kept in fp32, so the packed kernels and
the fused decoder serve it (the passage NLL barely moves; decode steps run on the packed kernels).

Any other tensor type raises `ModelLoadError` naming the tensor and its type. One log line lists
the formats found and the path each took ("Q2_K: 16 tensors, packed (quantized kernels)").

Under tensor parallelism (`model.shard`) each rank keeps its slices only (`_rank_slices`): packed
rows are whole blocks (32 or 256 weights) along the input dimension, so column-parallel cuts (q/k/v,
gate/up, embedding rows) take whole rows, and row-parallel cuts (o, down) cut every row at a block
boundary; a rank share that is not a whole number of blocks is refused.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import ops
from common.log import get_logger
from engine.model.layers import VocabParallelLookup
from engine.model.llama import LlamaForCausalLM
from engine.model.moe import SparseMoE
from engine.model.packed_experts import PackedExperts, interleave_experts
from engine.model.quant_linear import QuantEmbedding, QuantLinear
from ops.quant import FORMATS, QuantFormat, interleave
from ops.reference import formats
from ops.reference import quant as ref

log = get_logger("gguf")
PACKED_PATH = "packed (quantized kernels)"
DEQUANTIZED_PATH = "dequantized at load to float32"
REQUANTIZED_PATH = "requantized at load to Q8_0 (quantized kernels)"
FLOAT_PATH = "float32"
# GGUF per-layer tensor -> (module path under model.layers.N, shard index)
_LAYER_LINEARS = {
    "attn_q": ("self_attn.qkv_proj", 0), "attn_k": ("self_attn.qkv_proj", 1), "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", 0), "ffn_gate": ("mlp.gate_up_proj", 0), "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", 0),
}
_LAYER_NORMS = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm.weight", "attn_k_norm": "self_attn.k_norm.weight"}
# Gemma 3's sandwich norms: llama.cpp names the pre-MLP norm ffn_norm and the two output norms post_*
_SANDWICH_NORMS = {"attn_norm": "input_layernorm.weight", "post_attention_norm": "post_attention_layernorm.weight",
                   "ffn_norm": "pre_feedforward_layernorm.weight", "post_ffw_norm": "post_feedforward_layernorm.weight"}
# OLMo 2's norms after attention and MLP (no pre-norms)
_POST_NORMS = {"post_attention_norm": "post_attention_layernorm.weight",
               "post_ffw_norm": "post_feedforward_layernorm.weight"}
# the GGUF architectures whose Q/K rows llama.cpp's converter permutes (its LlamaModel and subclasses:
# Granite, SmolLM3); Qwen, Gemma, Phi-3 and OLMo 2 files keep transformers' row order
ROPE_PERMUTED_ARCHS = ("llama", "granite", "smollm3")


def layer_norms(spec: Any) -> dict[str, str]:
    """GGUF per-layer norm tensor kind -> the model's parameter under model.layers.N (for `spec`'s family);
    q/k norms over a head (Qwen3, Gemma 3) or the whole projection (OLMo 2) under the same names."""
    norms = dict(_SANDWICH_NORMS if spec.sandwich_norms else _POST_NORMS if spec.post_norms else _LAYER_NORMS)
    if spec.qk_norm is not None:
        norms.update(_QK_NORMS)
    return norms
# Qwen-MoE's sparse layers: the router and shared-expert gate (fp32 parameters), the shared expert's
# linears, and the stacked experts `[E, rows, K]` (gate, up, down: `_build_experts`)
_MOE_PARAMS = {"ffn_gate_inp": "mlp.gate.weight", "ffn_gate_inp_shexp": "mlp.shared_expert_gate.weight"}
_MOE_LINEARS = {"ffn_gate_shexp": ("mlp.shared_expert.gate_up_proj", 0),
                "ffn_up_shexp": ("mlp.shared_expert.gate_up_proj", 1),
                "ffn_down_shexp": ("mlp.shared_expert.down_proj", 0)}
_MOE_EXPERTS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
# Llama 3.x's per-frequency rope divisors: the config carries them (gguf_rope's `freq_factors`)
_SKIPPED = ("rope_freqs.weight",)
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# older Mixtral files: one tensor per expert (`blk.N.ffn_gate.E.weight`), stacked here as `ffn_gate_exps`
_EXPERT_NAME = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight$")


class GGUFWeightError(ValueError):
    """A GGUF tensor cannot be used as it is stored (the message names it)."""


@dataclass(frozen=True, slots=True)
class Stored:
    """One GGUF tensor: its packed format (None once it is fp32), data (packed uint8 or fp32) and
    the format the file stores it in (a table name: "Q4_K", "F16", ...)."""

    fmt: QuantFormat | None
    data: torch.Tensor
    source: str = "F32"


def read_tensor(tensor: Any, requantize: bool = False) -> Stored:
    """A reader tensor as `Stored`, copied out of the memory map: packed formats kept in their blocks,
    the others in fp32 (dequantized by the format table), or with `requantize` a 2-D one of those
    as Q8_0 blocks of its dequantized weights; GGUFWeightError for a format not in the table."""
    kind = tensor.tensor_type.name
    try:
        fmt = formats.by_name(kind)
    except formats.UnsupportedFormatError:
        raise GGUFWeightError(
            f"tensor {tensor.name!r} is {kind}, which pagedserve does not read (supported: "
            f"{', '.join(formats.BY_NAME)}); load with quantization='dequantize'") from None
    array = np.array(tensor.data)  # a copy: the reader's arrays are read-only views of the memory map
    if fmt.runs == formats.PACKED:
        if kind not in FORMATS:
            raise GGUFWeightError(f"tensor {tensor.name!r}: {kind} is packed in the format table but ops.quant has "
                                  f"no kernel format for it ({sorted(FORMATS)})")
        rows = array.shape[0] if array.ndim > 1 else 1
        return Stored(FORMATS[kind], torch.from_numpy(array).reshape(rows, -1), kind)
    shape = [int(s) for s in reversed(tensor.shape.tolist())]
    raw = torch.from_numpy(array.view(np.uint8).reshape(-1, fmt.row_bytes(shape[-1])))
    weight = fmt.dequantize(raw).reshape(shape)
    if requantize and fmt.runs == formats.DEQUANTIZED and len(shape) == 2:
        return Stored(FORMATS["Q8_0"], ref.quantize(weight, ref.Q8_0), kind)
    return Stored(None, weight, kind)


def unpermute_rope_rows(rows: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: within each head, GGUF row 2i + j is HF row j * D/2 + i."""
    head_dim = rows.shape[0] // num_heads
    return rows.reshape(num_heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(rows.shape)


def _shards(stored: list[Stored], in_features: int) -> list[tuple[QuantFormat | None, torch.Tensor]]:
    """Consecutive shards of one format merged into one buffer (same bytes per row)."""
    merged: list[tuple[QuantFormat | None, list[torch.Tensor]]] = []
    for s in stored:
        if merged and merged[-1][0] == s.fmt:
            merged[-1][1].append(s.data)
        else:
            merged.append((s.fmt, [s.data]))
    for fmt, _ in merged:
        if fmt is not None and in_features % fmt.block_size:
            raise GGUFWeightError(f"in_features {in_features} is not a multiple of {fmt.block_size} for {fmt.name}")
    return [(fmt, torch.cat(parts) if len(parts) > 1 else parts[0]) for fmt, parts in merged]


def _interleaved(fmt: QuantFormat | None, data: torch.Tensor) -> tuple[QuantFormat | None, torch.Tensor]:
    """A shard in the CPU kernel's eight-row layout where its format has one."""
    if fmt is None:
        return fmt, data
    packed, layout = interleave(data, fmt)
    return layout, packed


def _set_module(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)


class _Collector:
    """Sorts GGUF tensors into linear shards, biases and plain parameters of the model."""

    def __init__(self, model: LlamaForCausalLM, permute: bool) -> None:
        self.model, self.spec, self.permute = model, model.spec, permute
        self.linears: dict[str, dict[int, Stored]] = {}
        self.biases: dict[str, dict[int, Stored]] = {}
        self.params: dict[str, Stored] = {}
        self.experts: dict[str, dict[int, Stored]] = {}  # "model.layers.N.mlp" -> gate, up, down
        self.split_experts: dict[tuple[int, str], dict[int, Stored]] = {}  # (layer, gate|up|down) -> expert
        self.paths: Counter[tuple[str, str]] = Counter()  # (file format, path taken) -> tensors
        self.tied_lm_head = False  # the lm_head is the token embedding (counted there)
        self.norms = layer_norms(self.spec)

    def count(self, stored: Stored, packed: bool) -> None:
        """Tally one tensor under its file format and the path it takes."""
        runs = formats.by_name(stored.source).runs
        if packed:
            path = PACKED_PATH if runs == formats.PACKED else REQUANTIZED_PATH
        else:
            path = FLOAT_PATH if runs == formats.FLOAT else DEQUANTIZED_PATH
        self.paths[stored.source, path] += 1

    def summary(self) -> str:
        """One line: "Q4_K: 16 tensors, dequantized at load to float32; Q8_0: 15 tensors, packed ..."."""
        return "; ".join(f"{source}: {n} tensors, {path}" for (source, path), n in sorted(self.paths.items()))

    def add(self, name: str, stored: Stored) -> None:
        if name == "token_embd.weight":
            self.params["model.embed_tokens.weight"] = stored
        elif name == "output_norm.weight":
            self.params["model.norm.weight"] = stored
        elif name == "output.weight":
            self.linears.setdefault("lm_head", {})[0] = stored
        elif (match := _BLOCK_NAME.match(name)) is not None:
            self._add_layer(name, int(match[1]), match[2], match[3], stored)
        elif (match := _EXPERT_NAME.match(name)) is not None and self.spec.moe is not None:
            self.split_experts.setdefault((int(match[1]), match[2]), {})[int(match[3])] = stored
        elif name not in _SKIPPED:
            raise GGUFWeightError(f"GGUF tensor {name!r} has no place in the model")

    def _add_layer(self, name: str, layer: int, kind: str, what: str, stored: Stored) -> None:
        prefix = f"model.layers.{layer}."
        if kind in self.norms and what == "weight":
            self.params[prefix + self.norms[kind]] = stored
            return
        if kind == "attn_qkv" or (kind == "ffn_up" and self.spec.fused_checkpoint):
            self._add_fused(prefix, kind, what, stored)
            return
        if self.spec.moe is not None and what == "weight" and (kind in _MOE_PARAMS or kind in _MOE_EXPERTS):
            self._add_moe(prefix, kind, stored)
            return
        if self.spec.moe is not None and kind in _MOE_LINEARS:
            module, shard = _MOE_LINEARS[kind]
            (self.linears if what == "weight" else self.biases).setdefault(prefix + module, {})[shard] = stored
            return
        if kind not in _LAYER_LINEARS:
            raise GGUFWeightError(f"GGUF tensor {name!r} has no place in the model")
        module, shard = _LAYER_LINEARS[kind]
        if self.permute and kind in ("attn_q", "attn_k"):
            heads = self.spec.num_heads if kind == "attn_q" else self.spec.num_kv_heads
            data = stored.data if what == "weight" else stored.data.reshape(-1, 1)
            data = unpermute_rope_rows(data, heads)
            stored = Stored(stored.fmt, data if what == "weight" else data.reshape(-1), stored.source)
        target = self.linears if what == "weight" else self.biases
        target.setdefault(prefix + module, {})[shard] = stored


    def stack_split_experts(self) -> None:
        """Per-expert tensors (older Mixtral files) stacked as the `ffn_*_exps` tensor of their layer:
        every expert present, all in one format (GGUFWeightError otherwise)."""
        assert self.spec.moe is not None or not self.split_experts
        for (layer, part), parts in sorted(self.split_experts.items()):
            name = f"blk.{layer}.ffn_{part}.E.weight"
            count = self.spec.moe.num_experts if self.spec.moe is not None else 0
            if sorted(parts) != list(range(count)):
                raise GGUFWeightError(f"GGUF tensors {name} hold experts {sorted(parts)}; the model has {count}")
            stored = [parts[e] for e in range(count)]
            if len({(s.fmt, s.source, tuple(s.data.shape)) for s in stored}) != 1:
                raise GGUFWeightError(f"GGUF tensors {name} differ in format or shape between experts")
            datas = [s.data for s in stored]  # packed: rows of blocks, concatenated; fp32: [E, rows, K]
            data = torch.cat(datas) if stored[0].fmt is not None else torch.stack(datas)
            self._add_moe(f"model.layers.{layer}.", f"ffn_{part}_exps", Stored(stored[0].fmt, data, stored[0].source))
        self.split_experts.clear()

    def _add_moe(self, prefix: str, kind: str, stored: Stored) -> None:
        """A sparse layer's router / shared-expert gate (fp32 parameters: the router stays fp32) or one of
        its stacked expert tensors, kept as stored (`_build_experts` decides packed or dequantized)."""
        if kind in _MOE_EXPERTS:
            self.experts.setdefault(prefix + "mlp", {})[_MOE_EXPERTS[kind]] = stored
            return
        name = prefix + _MOE_PARAMS[kind]
        rows = 1 if kind == "ffn_gate_inp_shexp" else -1  # llama.cpp stores the shared gate as one vector
        self.params[name] = Stored(None, _fp32(stored).reshape(rows, self.spec.hidden_size), stored.source)

    def _add_fused(self, prefix: str, kind: str, what: str, stored: Stored) -> None:
        """Phi-3's fused `attn_qkv` (q, k, v rows) and `ffn_up` (gate rows, then up rows) as the
        shards of qkv_proj / gate_up_proj: whole rows, so packed blocks are cut as they are."""
        spec = self.spec
        if kind == "attn_qkv":
            module = "self_attn.qkv_proj"
            sizes = [spec.num_heads * spec.head_dim] + [spec.num_kv_heads * spec.head_dim] * 2
        else:
            module, sizes = "mlp.gate_up_proj", [spec.intermediate_size] * 2
        data = stored.data if what == "weight" else stored.data.reshape(-1, 1)
        if data.shape[0] != sum(sizes):
            raise GGUFWeightError(f"GGUF tensor {prefix}{kind}.{what} has {data.shape[0]} rows; the model "
                                  f"expects {sum(sizes)}")
        target = (self.linears if what == "weight" else self.biases).setdefault(prefix + module, {})
        for index, part in enumerate(data.split(sizes)):
            part = part.contiguous() if what == "weight" else part.reshape(-1).contiguous()
            target[index] = Stored(stored.fmt, part, stored.source)


def load_gguf_quantized(model: LlamaForCausalLM, path: Path, int8_activations: bool = True,
                        requantize: bool = False) -> LlamaForCausalLM:
    """Fill `model` (built for the file's config, parameters allocated) from the GGUF at `path`,
    swapping its packed linear layers for `QuantLinear` (`requantize`: module docstring);
    GGUFWeightError when a tensor does not fit."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else ""
    collector = _Collector(model, permute=arch in ROPE_PERMUTED_ARCHS)
    for tensor in reader.tensors:
        collector.add(tensor.name, read_tensor(tensor, requantize))
    collector.stack_split_experts()
    if model.shard.size > 1:
        _rank_slices(model, collector)
    _fill_params(model, collector)
    _build_linears(model, collector, int8_activations)
    _build_experts(model, collector, int8_activations)
    log.info("GGUF tensor formats", file=str(path), formats=collector.summary())
    return model


def iter_dequantized_weights(model: LlamaForCausalLM, path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the GGUF at `path` in fp32 under its HF checkpoint name (`model.load_weights`
    takes them), Q/K rows un-permuted: the `quantization="dequantize"` load of the families whose
    files transformers' GGUF loader does not read (`engine.model.gguf_config`), and of the Qwen-MoE
    files (transformers' loader keeps its default expert sizes): experts stacked as transformers holds them."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch_field = reader.fields.get("general.architecture")
    collector = _Collector(model, permute=arch_field is not None and arch_field.contents() in ROPE_PERMUTED_ARCHS)
    for tensor in reader.tensors:
        stored = read_tensor(tensor)
        collector.add(tensor.name, stored)
        collector.count(stored, packed=False)
    collector.stack_split_experts()
    log.info("GGUF tensor formats", file=str(path), formats=collector.summary())
    for name, stored in collector.params.items():
        yield name, _fp32(stored)
    for table, what in ((collector.linears, "weight"), (collector.biases, "bias")):
        for module, shards in table.items():
            for index, stored in shards.items():
                yield _hf_name(module, index, what), _fp32(stored)
    for block_path, parts in collector.experts.items():
        block = model.get_submodule(block_path)
        assert isinstance(block, SparseMoE)
        e, i, h = block.full_spec.num_experts, block.full_spec.intermediate_size, model.spec.hidden_size
        gate, up = (_expert_values(parts[p], (e, i, h), block_path) for p in (0, 1))
        yield f"{block_path}.experts.gate_up_proj", torch.cat([gate, up], dim=1)
        yield f"{block_path}.experts.down_proj", _expert_values(parts[2], (e, h, i), block_path)


def _fp32(stored: Stored) -> torch.Tensor:
    """The fp32 values of a collected tensor (packed blocks dequantized)."""
    return stored.data if stored.fmt is None else ops.quant.dequantize(stored.data, stored.fmt)


_HF_SHARDS = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj"),
              "self_attn.o_proj": ("o_proj",), "mlp.down_proj": ("down_proj",),
              "shared_expert.gate_up_proj": ("gate_proj", "up_proj"), "shared_expert.down_proj": ("down_proj",)}


def _hf_name(path: str, index: int, what: str) -> str:
    """The HF checkpoint name of shard `index` of module `path` (`...qkv_proj`, 1 -> `...k_proj.weight`)."""
    for fused, names in _HF_SHARDS.items():
        if path.endswith(fused):
            return f"{path.removesuffix(fused)}{fused.split('.')[0]}.{names[index]}.{what}".lstrip(".")
    return f"{path}.{what}"


def cut_stored(model: LlamaForCausalLM, name: str, stored: Stored) -> Stored | None:
    """This rank's part of `stored` (HF name `name`), None when the rank does not hold it."""
    data, fmt = stored.data, stored.fmt
    features = data.shape[1] // fmt.block_bytes * fmt.block_size if fmt is not None and data.dim() == 2 else None
    shape = tuple(data.shape) if features is None else (data.shape[0], features)
    cut = model.shard.weight_slice(name, shape, model.spec)
    if cut is None:
        return None
    dim, start, length = cut
    if length == shape[dim]:
        return stored
    if dim == 1 and fmt is not None:
        if start % fmt.block_size or length % fmt.block_size:
            raise GGUFWeightError(f"{name}: rank {model.shard.rank}'s input features [{start}, {start + length}) "
                                  f"do not fall on {fmt.block_size}-weight block boundaries, so tensor_parallel_size "
                                  f"{model.shard.size} cannot split this {fmt.name} matrix (pass "
                                  "quantization='dequantize')")
        start, length = start // fmt.block_size * fmt.block_bytes, length // fmt.block_size * fmt.block_bytes
    return Stored(fmt, data.narrow(dim, start, length).contiguous(), stored.source)


def _rank_slices(model: LlamaForCausalLM, collector: _Collector) -> None:
    """Cut every collected tensor to this rank's slice (`TPShard.weight_slice`); drop what it skips."""
    for table, what in ((collector.linears, "weight"), (collector.biases, "bias")):
        for path, shards in list(table.items()):
            for index, stored in list(shards.items()):
                part = cut_stored(model, _hf_name(path, index, what), stored)
                if part is None:
                    del shards[index]
                else:
                    shards[index] = part
            if not shards:
                del table[path]
    for path, parts in collector.experts.items():
        for index, stored in list(parts.items()):
            parts[index] = _cut_experts(model, path, index, stored)
    embed = collector.params.get("model.embed_tokens.weight")
    if embed is not None:
        if model.spec.tie_word_embeddings and model.shard.owns_lm_head and "lm_head" not in collector.linears:
            collector.linears["lm_head"] = {0: embed}  # rank 0's full tied lm_head, before the cut
            collector.tied_lm_head = True
        part = cut_stored(model, "model.embed_tokens.weight", embed)
        assert part is not None  # every rank holds embedding rows
        collector.params["model.embed_tokens.weight"] = part


def _cut_experts(model: LlamaForCausalLM, path: str, index: int, stored: Stored) -> Stored:
    """This rank's share of a stacked expert tensor (`_MOE_EXPERTS` index: gate or up `[E, I, H]`, its
    rows; down `[E, H, I]`, its input features, in whole blocks of a packed format)."""
    moe, shard, hidden = model.spec.moe, model.shard, model.spec.hidden_size
    assert moe is not None
    experts, full = moe.num_experts, moe.intermediate_size
    per = full // shard.size
    start, fmt = shard.rank * per, stored.fmt
    rows, k = (full, hidden) if index < 2 else (hidden, full)
    size = experts * rows * (k if fmt is None else fmt.row_bytes(k))
    if stored.data.numel() != size or (fmt is not None and k % fmt.block_size):
        raise GGUFWeightError(f"{path}: expert tensor {index} of {stored.data.numel()} values is not "
                              f"[{experts}, {rows}, {k}] in {stored.source}")
    data = stored.data.reshape(experts, rows, -1)
    if index < 2:
        return Stored(fmt, data.narrow(1, start, per).contiguous(), stored.source)
    if fmt is not None:
        if start % fmt.block_size or per % fmt.block_size:
            raise GGUFWeightError(f"{path}: tensor_parallel_size {shard.size} gives each rank {per} of the experts' "
                                  f"{full} intermediate features, not whole {fmt.block_size}-weight {fmt.name} blocks "
                                  "of ffn_down_exps (pass quantization='dequantize', or a size that keeps "
                                  f"{full} / size a multiple of {fmt.block_size})")
        start, per = start // fmt.block_size * fmt.block_bytes, per // fmt.block_size * fmt.block_bytes
    return Stored(fmt, data.narrow(2, start, per).contiguous(), stored.source)


def _fill_params(model: LlamaForCausalLM, collector: _Collector) -> None:
    spec = model.spec
    embed = collector.params.pop("model.embed_tokens.weight", None)
    if embed is None:
        raise GGUFWeightError("GGUF file has no token_embd.weight")
    if "lm_head" not in collector.linears and model.shard.owns_lm_head:
        if not spec.tie_word_embeddings:
            raise GGUFWeightError("GGUF file has no output.weight and the config does not tie embeddings")
        collector.linears["lm_head"] = {0: embed}
        collector.tied_lm_head = True
    collector.count(embed, packed=embed.fmt is not None)
    lookup: nn.Module = (nn.Embedding.from_pretrained(embed.data, freeze=True) if embed.fmt is None
                         else QuantEmbedding(embed.fmt, embed.data, spec.hidden_size))
    if model.shard.size > 1:  # this rank's vocabulary rows: ids outside look up zeros, summed over the ranks
        lookup = VocabParallelLookup(lookup, model.shard.vocab_range(spec), model.shard)
    model.model.embed_tokens = lookup  # type: ignore[assignment]
    params = dict(model.named_parameters())
    for name, stored in collector.params.items():
        dest = params.get(name)
        if dest is None or dest.shape != stored.data.shape:
            raise GGUFWeightError(f"GGUF tensor for {name!r} has shape {tuple(stored.data.shape)}; the model "
                                  f"expects {None if dest is None else tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(stored.data)
            if spec.norm_offset and name.endswith("norm.weight"):
                # llama.cpp's converter stored offset + w; transformers reads (g - offset) and its
                # norms scale by offset + that, the fp32 value taken here
                dest.sub_(spec.norm_offset).add_(spec.norm_offset)
        collector.count(stored, packed=False)
    expected = {f"model.layers.{i}.{p}" for i in range(spec.num_layers) for p in collector.norms.values()}
    missing = sorted((expected | {"model.norm.weight"}) - collector.params.keys())
    if missing:
        raise GGUFWeightError(f"GGUF file lacks {len(missing)} norm weights, e.g. {missing[:3]}")


def _build_linears(model: LlamaForCausalLM, collector: _Collector, int8_activations: bool) -> None:
    for path, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or module.out_features == 0:  # 0: a rank other than 0's lm_head
            continue
        if f"{path}.weight" in collector.params:  # a MoE router or shared-expert gate: fp32 parameters
            continue
        shards = collector.linears.pop(path, {})
        count = 3 if path.endswith("qkv_proj") else 2 if path.endswith("gate_up_proj") else 1
        if sorted(shards) != list(range(count)):
            raise GGUFWeightError(f"GGUF file lacks weights of {path!r} (has shards {sorted(shards)} of {count})")
        stored = [shards[i] for i in range(count)]
        rows = sum(s.data.shape[0] for s in stored)
        if rows != module.out_features:
            raise GGUFWeightError(f"GGUF weights of {path!r} have {rows} rows; the model expects {module.out_features}")
        bias = None
        if module.bias is not None:
            parts = collector.biases.pop(path, {})
            if sorted(parts) != list(range(count)):
                raise GGUFWeightError(f"GGUF file lacks the bias of {path!r}")
            bias = torch.cat([parts[i].data.reshape(-1) for i in range(count)])
            for part in parts.values():
                collector.count(part, packed=False)
        packed_module = all(s.fmt is not None for s in stored)
        if path != "lm_head" or not collector.tied_lm_head:
            for s in stored:
                collector.count(s, packed=packed_module)
        if not packed_module:  # one path per module: every shard in fp32, the model's own Linear
            _fill_linear(module, [s.data if s.fmt is None else ops.quant.dequantize(s.data, s.fmt, module.in_features)
                                  for s in stored], bias)
            continue
        # The lm_head keeps fp32 activations: its argmax is the greedy token, and int8 activations
        # flip near-ties (the int8 error can exceed the gap between the two largest logits).
        int8 = int8_activations and path != "lm_head"
        packed = _shards(stored, module.in_features)
        if path != "lm_head":  # the lm_head's logit screen reads GGUF-order rows
            packed = [_interleaved(fmt, t) for fmt, t in packed]
        _set_module(model, path, QuantLinear(module.in_features, packed, bias, int8))
    leftover = sorted([*collector.linears, *collector.biases])
    if leftover:
        raise GGUFWeightError(f"GGUF tensors with no place in the model: {leftover[:3]}")


def _build_experts(model: LlamaForCausalLM, collector: _Collector, int8_activations: bool) -> None:
    """Each sparse layer's experts: `PackedExperts` where gate, up and down are all in packed formats,
    else the fp32 `Experts` filled with every one dequantized (one path per block, logged)."""
    dequantized: Counter[str] = Counter()
    for path, module in model.named_modules():
        if not isinstance(module, SparseMoE):
            continue
        parts = collector.experts.pop(path, {})
        if sorted(parts) != [0, 1, 2]:
            raise GGUFWeightError(f"GGUF file lacks expert tensors of {path!r} (has {sorted(parts)} of "
                                  "ffn_gate_exps, ffn_up_exps, ffn_down_exps)")
        spec, hidden = module.spec, model.spec.hidden_size
        shapes = [(spec.num_experts, spec.intermediate_size, hidden)] * 2 + [
            (spec.num_experts, hidden, spec.intermediate_size)]
        stored = [parts[i] for i in range(3)]
        packed = all(s.fmt is not None for s in stored)
        for s in stored:
            collector.count(s, packed=packed)
        if packed:
            gate, up, down = (_expert_rows(s, shape, path) for s, shape in zip(stored, shapes, strict=True))
            gate_up = [(gate[0], torch.cat([gate[1], up[1]], dim=1))] if gate[0] == up[0] else [gate, up]
            module.experts = PackedExperts(spec, hidden, [interleave_experts(*s) for s in gate_up],  # type: ignore[assignment]
                                           interleave_experts(*down), int8_activations)
            continue
        gate_w, up_w, down_w = (_expert_values(s, shape, path) for s, shape in zip(stored, shapes, strict=True))
        experts = module.experts
        with torch.no_grad():
            experts.gate_up_proj.copy_(torch.cat([gate_w, up_w], dim=1))
            experts.down_proj.copy_(down_w)
        dequantized.update(s.source for s in stored if formats.by_name(s.source).runs != formats.FLOAT)
    if dequantized:
        log.info("MoE experts in a format without a kernel: every expert tensor of their layers dequantized at load "
                 "to float32", formats=dict(sorted(dequantized.items())))
    if collector.experts:
        raise GGUFWeightError(f"GGUF expert tensors with no MoE block in the model: {sorted(collector.experts)[:3]}")


def _expert_rows(stored: Stored, shape: tuple[int, int, int], path: str) -> tuple[QuantFormat, torch.Tensor]:
    """A packed stacked expert tensor as `[experts, rows, row_bytes]` (GGUFWeightError if it is not `shape`)."""
    fmt = stored.fmt
    assert fmt is not None
    experts, rows, k = shape
    if k % fmt.block_size or stored.data.numel() != experts * rows * fmt.row_bytes(k):
        raise GGUFWeightError(f"{path}: a {fmt.name} expert tensor of {stored.data.numel()} bytes is not "
                              f"{list(shape)} (K a multiple of {fmt.block_size})")
    return fmt, stored.data.reshape(experts, rows, fmt.row_bytes(k))


def _expert_values(stored: Stored, shape: tuple[int, int, int], path: str) -> torch.Tensor:
    """A stacked expert tensor in fp32 `shape` (packed ones dequantized)."""
    if stored.fmt is not None:
        fmt, rows = _expert_rows(stored, shape, path)
        return ops.quant.dequantize(rows.reshape(-1, rows.shape[-1]), fmt, shape[2]).reshape(shape)
    if tuple(stored.data.shape) != shape:
        raise GGUFWeightError(f"{path}: an expert tensor of shape {tuple(stored.data.shape)}; expected {list(shape)}")
    return stored.data


def _fill_linear(module: nn.Linear, shards: list[torch.Tensor], bias: torch.Tensor | None) -> None:
    """`module`'s weight set to the fp32 row shards stacked (the tensor itself when there is one: a
    tied lm_head shares the embedding's), its bias to `bias`."""
    weight = torch.cat(shards) if len(shards) > 1 else shards[0]
    if weight.shape != module.weight.shape:
        raise GGUFWeightError(f"GGUF weights have shape {tuple(weight.shape)}; the layer expects "
                              f"{tuple(module.weight.shape)}")
    module.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        assert module.bias is not None
        with torch.no_grad():
            module.bias.copy_(bias)
