"""The size ladder's files: the HF folder and the F16 GGUF of a rung hold the same model (the Q/K
rows permuted as llama.cpp's converter does, the tokenizer padded to the shape's vocabulary), so
vLLM on the folder and pagedserve / llama.cpp on the GGUF run the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks.ladder.make_rung import make_rung
from benchmarks.ladder.shapes import RUNGS, Rung, _llama, resolve_rung, rung_from_config
from engine.model import load_model
from tests.engine.model.gguf_writing import assert_fp32_activation_logits_match

TINY = {
    # a vocabulary larger than SmolLM2's 49,152 tokens: the GGUF's token list is padded
    "llama": Rung("tiny-llama", "llama", "llama", _llama(64, 128, 2, 4, 2, 49200, True, 500000.0)),
    "qwen2": Rung("tiny-qwen2", "qwen2", "qwen2", _llama(64, 128, 2, 4, 2, 49200, False, 1e6, 1e-6), qkv_bias=True),
}


@pytest.mark.parametrize("arch", sorted(TINY))
def test_hf_folder_and_gguf_hold_the_same_model(arch: str, tmp_path: Path) -> None:
    import gguf
    from transformers import AutoModelForCausalLM

    rung = TINY[arch]
    paths = make_rung(rung, None, [], seed=3, threads=1, root=tmp_path)
    reader = gguf.GGUFReader(paths["F16"])
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == rung.config["vocab_size"]
    hf = AutoModelForCausalLM.from_pretrained(paths["hf"], dtype=torch.float32)
    assert sum(p.numel() for p in hf.parameters()) == rung.params
    assert_fp32_activation_logits_match(load_model(Path(paths["F16"])), hf)


def test_real_rungs_have_their_published_sizes() -> None:
    """Parameter counts of the shapes, against the models' published sizes (within 3%)."""
    published = {"qwen2.5-0.5b": 0.494e9, "smollm2-1.7b": 1.71e9, "llama3.2-3b": 3.21e9, "llama3.1-8b": 8.03e9}
    for name, count in published.items():
        assert abs(RUNGS[name].params / count - 1) < 0.03, (name, RUNGS[name].params)


def test_rung_without_hf_folder_keeps_the_tokenizer(tmp_path: Path) -> None:
    """`hf=False` (the 8B rung, which vLLM does not run here): no weights folder, the tokenizer files
    alone, and the same F16 GGUF as with the folder."""
    rung = TINY["llama"]
    paths = make_rung(rung, None, [], seed=3, threads=1, root=tmp_path / "bare", hf=False)
    full = make_rung(rung, None, [], seed=3, threads=1, root=tmp_path / "full")
    assert "hf" not in paths and not (tmp_path / "bare" / rung.name / "hf").exists()
    assert (Path(paths["tokenizer"]) / "tokenizer.json").is_file()
    assert Path(paths["F16"]).read_bytes() == Path(full["F16"]).read_bytes()


@pytest.mark.parametrize("arch", sorted(TINY))
def test_rung_from_the_config_json_it_wrote_is_the_same_shape(arch: str, tmp_path: Path) -> None:
    """A rung read back from its own HF folder's config.json (transformers' layout, RoPE theta under
    ``rope_parameters``) has the same shape and architectures, so a held-out config runs the same way."""
    rung = TINY[arch]
    paths = make_rung(rung, None, [], seed=3, threads=1, root=tmp_path)
    again = rung_from_config(Path(paths["hf"]) / "config.json", name="again")
    assert (again.hf_arch, again.gguf_arch, again.qkv_bias) == (rung.hf_arch, rung.gguf_arch, rung.qkv_bias)
    assert again.config == rung.config and again.params == rung.params
    assert resolve_rung(str(Path(paths["hf"]) / "config.json")).name == "hf"


def test_mistral_config_is_a_llama_rung_and_unsupported_configs_are_refused(tmp_path: Path) -> None:
    from transformers import AutoConfig

    folder = tmp_path / "tiny-mistral"
    AutoConfig.for_model("mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=49200,
                         sliding_window=None).save_pretrained(str(folder))
    rung = resolve_rung(str(folder / "config.json"))
    assert (rung.name, rung.hf_arch, rung.gguf_arch, rung.qkv_bias) == ("tiny-mistral", "llama", "llama", False)
    assert rung.config["num_key_value_heads"] == 2 and rung.config["tie_word_embeddings"] is False
    paths = make_rung(rung, None, [], seed=1, threads=1, root=tmp_path / "files")
    assert_fp32_activation_logits_match(load_model(Path(paths["F16"])), _hf(paths["hf"]))
    refused = {
        "gemma": {"model_type": "gemma", "hidden_size": 64},
        "head_dim": {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 32},
        "bias": {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "attention_bias": True},
    }
    for name, config in refused.items():
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(config))
        with pytest.raises(ValueError):
            rung_from_config(path)
    with pytest.raises(ValueError):
        resolve_rung("no-such-rung")


def _hf(folder: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model
