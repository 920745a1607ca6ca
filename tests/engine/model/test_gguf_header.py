"""engine.model.gguf_header reads what gguf.GGUFReader reads of a file's metadata and tensor
directory (string arrays by length only), and refuses what is not a GGUF by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.model.gguf_header import GGUFHeader, GGUFHeaderError, StringArray

gguf = pytest.importorskip("gguf")


def _write(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(3)
    writer.add_head_count_kv([2, 4, 2])  # a per-layer array
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_scaling_finetuned(True)
    writer.add_token_list(["<s>", "a", "bc", "ünï"] * 50)
    writer.add_token_scores([0.5] * 200)
    writer.add_uint64("test.big", 1 << 40)
    writer.add_string("test.text", "héllo")
    writer.add_tensor("rope_freqs.weight", np.linspace(1, 8, 8, dtype=np.float32))
    writer.add_tensor("half.weight", np.arange(6, dtype=np.float16).reshape(2, 3))
    quant = gguf.quants.quantize(np.ones((2, 64), dtype=np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", quant, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_header_reads_what_gguf_reader_reads(tmp_path: Path) -> None:
    path = _write(tmp_path / "h.gguf")
    header, reader = GGUFHeader(path), gguf.GGUFReader(str(path))
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):  # the reader's own pseudo-fields (version, counts)
            continue
        value = header.fields[key]
        expected = field.contents()
        if isinstance(value, StringArray):
            assert value.length == len(expected) == 200
        elif isinstance(expected, float):
            assert value == pytest.approx(expected, rel=1e-7), key
        else:
            assert value == expected, key
    assert header.fields["llama.attention.head_count_kv"] == [2, 4, 2]
    assert header.fields["test.big"] == 1 << 40 and header.fields["test.text"] == "héllo"
    assert header.data_offset == reader.data_offset
    for tensor in reader.tensors:
        info = header.tensors[tensor.name]
        assert info.shape == tuple(int(s) for s in reversed(tensor.shape.tolist()))
        assert info.type_id == int(tensor.tensor_type)
    assert header.float_tensor("rope_freqs.weight") == np.linspace(1, 8, 8, dtype=np.float32).tolist()
    assert header.float_tensor("half.weight") == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert header.float_tensor("absent.weight") is None
    with pytest.raises(GGUFHeaderError, match=r"'blk\.0\.attn_q\.weight' has ggml type 8; F32 or F16 expected"):
        header.float_tensor("blk.0.attn_q.weight")


def test_what_is_not_a_gguf_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "h.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:300])
    with pytest.raises(GGUFHeaderError, match="is not a readable GGUF file"):
        GGUFHeader(truncated)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(GGUFHeaderError, match="does not start with the GGUF magic"):
        GGUFHeader(other)
