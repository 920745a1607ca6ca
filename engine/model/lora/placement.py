"""Where an adapter's weights go in a model: the target linears' slots (`attach_slots`), the shapes
an adapter must have (`full_shape`), this rank's part of each weight (`shard_weights`) and the
copy into a slot (`place_weights`).

Under tensor parallelism an adapter is split like the layer it targets (`engine.model.sharding`):
a column-parallel target (q/k/v, gate/up: the rank holds some output rows) keeps A whole and B's
rows of the rank's output slice; a row-parallel one (o, down: the rank holds some input columns)
keeps A's columns of the rank's input slice and B whole, so each rank's `(x_r A_r^T) B^T` is a
partial sum the layer's existing all-reduce completes. The cut is the base weight's own
(`TPShard.weight_slice` on the checkpoint name), GQA's replicated KV heads included."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from engine.model.layers import SwiGLU
from engine.model.lora.slots import LoRASlots
from engine.model.sharding import TPShard
from engine.model.spec import ModelSpec

# PEFT module name -> (block, this model's linear, slice of its stacked output)
TARGETS = {
    "q_proj": ("self_attn", "qkv_proj", 0), "k_proj": ("self_attn", "qkv_proj", 1),
    "v_proj": ("self_attn", "qkv_proj", 2), "o_proj": ("self_attn", "o_proj", 0),
    "gate_proj": ("mlp", "gate_up_proj", 0), "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", 0),
}
ROW_PARALLEL = ("o_proj", "down_proj")  # split by input columns; the others by output rows

Weights = dict[tuple[int, str], tuple[Tensor, Tensor]]  # (layer, PEFT module) -> (A [r, in], B [out, r])


def attach_slots(model: Any, num_slots: int, max_rank: int) -> dict[tuple[int, str], LoRASlots]:
    """Give every target linear of `model` (this rank's part of it) `num_slots` empty adapter slots
    (`Linear.lora`), sized by its local shapes; returned by `(layer, linear name)`. A sparse MoE
    layer's MLP gets none."""
    weight = next(model.model.layers[0].self_attn.qkv_proj.buffers(), None)
    device = next(model.parameters()).device if weight is None else weight.device
    dtype = model.policy.dtype
    width = max(2, max_rank)  # never a single-element reduction (torch splits those across threads)
    linears: dict[tuple[int, str], LoRASlots] = {}
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        q, kv = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        shapes: dict[str, tuple[Any, list[int]]] = {"qkv_proj": (attn.qkv_proj, [q, kv, kv]),
                                                    "o_proj": (attn.o_proj, [attn.o_proj.out_features])}
        if isinstance(mlp, SwiGLU):
            size = mlp.intermediate_size
            shapes |= {"gate_up_proj": (mlp.gate_up_proj, [size, size]),
                       "down_proj": (mlp.down_proj, [mlp.down_proj.out_features])}
        for name, (linear, sizes) in shapes.items():
            slots = LoRASlots(linear.in_features, sizes, num_slots, width, dtype, device)
            linear.lora = slots
            linears[(i, name)] = slots
    return linears


def full_shape(spec: ModelSpec, module: str) -> tuple[int, int]:
    """`(out, in)` of PEFT module `module` in the whole (unsplit) model: what an adapter's B rows and
    A columns must be."""
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    hidden, inter = spec.hidden_size, spec.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}[module]


def shard_weights(weights: Weights, shard: TPShard, spec: ModelSpec) -> Weights:
    """This rank's part of each `(A, B)` (module docstring); `weights` itself for size 1."""
    if shard.size == 1:
        return weights
    out: Weights = {}
    for (layer, module), (a, b) in weights.items():
        name = f"model.layers.{layer}.{TARGETS[module][0]}.{module}.weight"
        if module in ROW_PARALLEL:
            a = _narrow(shard, name, a, spec)
        else:
            b = _narrow(shard, name, b, spec)
        out[(layer, module)] = (a, b)
    return out


def _narrow(shard: TPShard, name: str, tensor: Tensor, spec: ModelSpec) -> Tensor:
    part = shard.narrow(name, tensor, spec)
    assert part is not None  # a projection's weight is never skipped by a rank
    return part


def place_weights(linears: dict[tuple[int, str], LoRASlots], slot: int, weights: Weights) -> None:
    """Empty `slot` in every linear, then copy `weights` (already this rank's part) into it."""
    for slots in linears.values():
        slots.clear(slot)
    for (layer, module), (a, b) in weights.items():
        _, linear, part = TARGETS[module]
        linears[(layer, linear)].set(slot, part, a, b)
