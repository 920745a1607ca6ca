"""Read a PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`) into a
`LoRAAdapter`, refusing what it cannot serve exactly: a missing or malformed folder, a rank above
the engine's `max_lora_rank`, target modules other than the attention and MLP projections, and
options that change the arithmetic (biases, DoRA, modules_to_save, rank/alpha patterns, ...).
Nothing is approximated: an option this loader does not know to be harmless is refused."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.model.lora.request import LoRAError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# the decoder's projections an adapter may target (`engine.model.lora.manager.TARGETS` places them)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# options that must hold their inert value (anything else changes the product or adds weights)
_INERT: dict[str, Any] = {
    "bias": "none", "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
    "rank_pattern": {}, "alpha_pattern": {}, "trainable_token_indices": None, "layer_replication": None,
    "target_parameters": None, "lora_bias": False, "use_qalora": False, "alora_invocation_tokens": None,
    "use_bdlora": None, "arrow_config": None, "kasa_config": None, "monteclora_config": None,
}


@dataclass(slots=True)
class LoRAAdapter:
    """One adapter in host memory: per `(layer, module)` its `A [r, in]` and `B [out, r]` (fp32),
    B already multiplied by the scale (alpha / r, or alpha / sqrt(r) with rsLoRA)."""

    name: str
    path: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def read_config(folder: Path) -> dict[str, Any]:
    """The folder's `adapter_config.json` as a dict; LoRAError when it is missing or not JSON."""
    if not folder.is_dir():
        raise LoRAError(f"LoRA adapter folder {str(folder)!r} does not exist", "lora_not_found")
    try:
        config = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise LoRAError(f"{str(folder)!r} has no {CONFIG_FILE}", "lora_not_found") from None
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{CONFIG_FILE} in {str(folder)!r} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{CONFIG_FILE} in {str(folder)!r} is not a JSON object")
    return config


def check_config(config: dict[str, Any], max_rank: int) -> tuple[int, float]:
    """`(rank, scale)` of a PEFT LoRA config, or LoRAError saying what is not served."""
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"peft_type {config.get('peft_type')!r} is not LoRA", "lora_unsupported")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"lora_alpha must be a number, got {alpha!r}")
    if rank > max_rank:
        raise LoRAError(f"adapter rank {rank} exceeds --max-lora-rank {max_rank}", "lora_rank_too_large")
    for key, inert in _INERT.items():
        value = config.get(key, inert)
        if value != inert and not (inert is None and value in ([], {})):
            raise LoRAError(f"adapter option {key}={value!r} is not supported (only {key}={inert!r})",
                            "lora_unsupported")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(TARGET_MODULES))
        if unknown:
            raise LoRAError(f"target modules {unknown} are not served: LoRA applies to {list(TARGET_MODULES)} "
                            "(embeddings and lm_head are not supported)", "lora_unsupported")
    elif targets is not None and not isinstance(targets, str):
        raise LoRAError(f"target_modules must be a list or a string, got {targets!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank
    return rank, float(scale)


def load_adapter(name: str, path: str, max_rank: int) -> LoRAAdapter:
    """Read and check the adapter at `path` (tensors' names and shapes against its rank; the
    model's own shapes are checked when it is placed: `LoRAManager`)."""
    folder = Path(path)
    rank, scale = check_config(read_config(folder), max_rank)
    tensors = _read_tensors(folder)
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR.match(key)
        if match is None or match.group(2) not in TARGET_MODULES:
            raise LoRAError(f"adapter tensor {key!r} is not a LoRA weight of {list(TARGET_MODULES)} "
                            "(embeddings, lm_head, biases and DoRA magnitudes are not supported)", "lora_unsupported")
        pieces.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    if not pieces:
        raise LoRAError(f"{WEIGHTS_FILE} in {str(folder)!r} holds no LoRA weights")
    adapter = LoRAAdapter(name, str(folder), rank, scale)
    for (layer, module), pair in sorted(pieces.items()):
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None:
            raise LoRAError(f"layer {layer} {module}: lora_A and lora_B must both be present")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAError(f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                            f"do not have rank {rank}")
        adapter.weights[(layer, module)] = (a.float().contiguous(), (b.float() * scale).contiguous())
    return adapter


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = folder / WEIGHTS_FILE
    if not file.is_file():
        raise LoRAError(f"{str(folder)!r} has no {WEIGHTS_FILE} (only the safetensors format is read)",
                        "lora_not_found")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError) as exc:
        raise LoRAError(f"{WEIGHTS_FILE} in {str(folder)!r} cannot be read: {exc}") from None
