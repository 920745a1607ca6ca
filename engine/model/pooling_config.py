"""Whether a model folder is served as an embedding (pooling) model, and how it pools: vLLM's
`--runner` and pooler config. `auto` picks pooling for a folder that says it is an embedding
model: architectures without a head (`Qwen3Model`, `LlamaModel`: names ending in `Model`), or a
sentence-transformers layout (`modules.json`, `1_Pooling/config.json`). The pooling type comes
from `--pooling-type`, else the sentence-transformers pooling config, else LAST (the decoder
embedding models' choice, e.g. Qwen3-Embedding); vectors are L2-normalized unless a
`modules.json` lists no Normalize module. Matryoshka truncation (`dimensions`) only where the
model's config.json says so (`is_matryoshka`, `matryoshka_dimensions`), as vLLM reads it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.pooling_params import POOLING_TYPES

# sentence-transformers pooling modes -> vLLM's pooling type
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_MODULES_SERVED = ("Transformer", "Pooling", "Normalize")


class PoolingConfigError(ValueError):
    """The folder's pooling setup is one the engine does not serve (the message names it)."""


@dataclass(frozen=True, slots=True)
class PoolerConfig:
    """How a pooling engine turns a prompt's final hidden states into one vector."""

    pooling_type: str
    normalize: bool
    hidden_size: int
    matryoshka: bool = False  # the model was trained for truncated vectors
    matryoshka_dimensions: tuple[int, ...] = ()  # the sizes it allows; empty with `matryoshka`: any

    def dimensions_error(self, dimensions: int | None) -> str | None:
        """Why `dimensions` cannot be served (None: it can)."""
        if dimensions is None or dimensions == self.hidden_size:
            return None
        if not self.matryoshka:
            return (f"this model does not support matryoshka representation (its config has no is_matryoshka "
                    f"or matryoshka_dimensions): dimensions must be left out or be {self.hidden_size}")
        if dimensions > self.hidden_size:
            return f"dimensions {dimensions} exceeds the model's embedding size {self.hidden_size}"
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            return f"dimensions must be one of {list(self.matryoshka_dimensions)}, got {dimensions}"
        return None


def _modules(folder: Path) -> list[dict[str, Any]] | None:
    path = folder / "modules.json"
    if not path.is_file():
        return None
    try:
        modules = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PoolingConfigError(f"{path}: not readable JSON ({exc})") from exc
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise PoolingConfigError(f"{path}: expected a list of modules")
    return modules


def _pooling_dir(folder: Path, modules: list[dict[str, Any]] | None) -> Path:
    for module in modules or []:
        if str(module.get("type", "")).endswith(".Pooling"):
            return folder / str(module.get("path", "1_Pooling"))
    return folder / "1_Pooling"


def is_headless(hf_config: Any) -> bool:
    """Architectures without an LM head (`Qwen3Model`, `LlamaModel`): an embedding checkpoint."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    return bool(archs) and all(str(a).endswith("Model") for a in archs)


def is_pooling_model(model: str, hf_config: Any) -> bool:
    """An embedding model's folder: a headless architecture or a sentence-transformers layout."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return False  # a GGUF file is served as the generative model it holds
    if (folder / "modules.json").is_file() or (folder / "1_Pooling" / "config.json").is_file():
        return True
    return is_headless(hf_config)


def resolve_runner(runner: str, model: str, hf_config: Any) -> str:
    """`generate` or `pooling` for `--runner` (auto: `is_pooling_model`)."""
    if runner == "generate" and is_headless(hf_config):
        raise PoolingConfigError(f"{model}: {', '.join(hf_config.architectures)} has no LM head to generate with; "
                                 "serve it with --runner pooling (or auto)")
    if runner != "auto":
        return runner
    return "pooling" if is_pooling_model(model, hf_config) else "generate"


def _st_pooling_type(folder: Path, modules: list[dict[str, Any]] | None) -> str | None:
    path = _pooling_dir(folder, modules) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PoolingConfigError(f"{path}: not readable JSON ({exc})") from exc
    chosen = [kind for key, kind in _ST_MODES.items() if config.get(key)]
    other = [key for key in _ST_UNSUPPORTED if config.get(key)]
    if other or len(chosen) > 1:
        raise PoolingConfigError(f"{path}: pooling {', '.join(other + chosen)} is not served; "
                                 f"pass --pooling-type {' or '.join(POOLING_TYPES)}")
    return chosen[0] if chosen else None


def pooler_config(model: str, hf_config: Any, pooling_type: str | None) -> PoolerConfig:
    """The pooler of `model` (see the module docstring); PoolingConfigError for a layout with
    modules the engine does not run (a Dense projection, max pooling)."""
    folder = Path(model).expanduser()
    modules = _modules(folder) if folder.is_dir() else None
    for module in modules or []:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _ST_MODULES_SERVED:
            raise PoolingConfigError(f"{folder / 'modules.json'}: the sentence-transformers module {kind!r} is not "
                                     f"served (only {', '.join(_ST_MODULES_SERVED)})")
    st_type = _st_pooling_type(folder, modules) if folder.is_dir() else None
    normalize = True if modules is None else any(str(m.get("type", "")).endswith(".Normalize") for m in modules)
    dims = getattr(hf_config, "matryoshka_dimensions", None) or ()
    return PoolerConfig(
        pooling_type=pooling_type or st_type or "LAST", normalize=normalize,
        hidden_size=int(hf_config.hidden_size),
        matryoshka=bool(getattr(hf_config, "is_matryoshka", False)) or bool(dims),
        matryoshka_dimensions=tuple(sorted(int(d) for d in dims)),
    )
