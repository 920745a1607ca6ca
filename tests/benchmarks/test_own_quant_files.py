"""`benchmarks/peer/own_quant_files.py`: a GGUF file requantized by our reference quantizers keeps
the template's metadata and tensor order, writes each tensor in the asked format where its rows
allow it (else its own), holds our quantizer's blocks of the template's values, and loads."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from benchmarks.peer.own_quant_files import write_file
from ops.reference import formats, quantizers
from tests.engine.model.gguf_writing import write_llama_gguf


def _template(path: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=320, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    write_llama_gguf(AutoModelForCausalLM.from_config(config).eval(), path, "Q8_0",
                     metadata=lambda w: w.add_string("tokenizer.ggml.model", "gpt2"))
    return path


@pytest.mark.parametrize("fmt", ["Q5_K", "Q6_K", "Q3_K", "IQ4_NL", "Q5_1"])
def test_requantized_file_holds_our_blocks_of_the_templates_values(tmp_path: Path, fmt: str) -> None:
    template = _template(tmp_path / "template.gguf")
    out = tmp_path / f"own-{fmt}.gguf"
    counts = write_file(template, out, fmt)
    source, written = gguf.GGUFReader(str(template)), gguf.GGUFReader(str(out))
    assert [t.name for t in written.tensors] == [t.name for t in source.tensors]
    assert written.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert written.fields["llama.block_count"].contents() == 2
    assert counts == {"F32": sum(t.tensor_type.name == "F32" for t in source.tensors),
                      fmt: sum(t.tensor_type.name != "F32" for t in source.tensors)}
    for before, after in zip(source.tensors, written.tensors, strict=True):
        if before.tensor_type.name == "F32":
            assert np.array_equal(np.asarray(after.data), np.asarray(before.data))
            continue
        assert after.tensor_type.name == fmt and list(after.shape) == list(before.shape)
        values = formats.by_name("Q8_0").dequantize(torch.from_numpy(np.asarray(before.data).copy()))
        if fmt in quantizers.QUANTIZERS:
            want = quantizers.quantize(values, fmt)
        else:
            from ops.reference.quant import quantize

            want = quantize(values, formats.by_name(fmt).type_id)
        assert torch.equal(torch.from_numpy(np.asarray(after.data).copy()), want)


def test_rows_the_format_cannot_hold_keep_their_own(tmp_path: Path) -> None:
    """A 256-weight format on rows of 32 n: those tensors stay in the template's format."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=320, hidden_size=96, intermediate_size=256,
                                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=128, tie_word_embeddings=False)
    write_llama_gguf(AutoModelForCausalLM.from_config(config).eval(), tmp_path / "t.gguf", "Q8_0")
    counts = write_file(tmp_path / "t.gguf", tmp_path / "o.gguf", "Q4_K")
    assert counts["Q4_K"] == 1 and counts["Q8_0"] >= 5  # only ffn_down's rows (K = 256) are whole 256-blocks
