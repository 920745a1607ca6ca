"""The size ladder's files: the HF folder and the F16 GGUF of a rung hold the same model (the Q/K
rows permuted as llama.cpp's converter does, the tokenizer padded to the shape's vocabulary), so
vLLM on the folder and pagedserve / llama.cpp on the GGUF run the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.ladder.make_rung import make_rung
from benchmarks.ladder.shapes import RUNGS, Rung, _llama
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
