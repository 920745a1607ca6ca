"""Incremental detokenization never emits half a UTF-8 character."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.text.detokenize import IncrementalDetokenizer
from gateway.text.tokenizer import ModelTokenizer

TEXTS = ["Hello world! 😀🚀🎉", "你好世界 日本語 한국어", "ü é ß 😀x你", "🧬🧪 unseen emoji 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"]


def _byte_tokens(text: str) -> tuple[list[int], object]:
    """A toy tokenizer: one token per UTF-8 byte; decode like byte-level BPE (U+FFFD for halves)."""
    def decode(ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")
    return list(text.encode()), decode


@pytest.mark.parametrize("text", TEXTS)
def test_byte_tokens_never_emit_replacement(text: str) -> None:
    ids, decode = _byte_tokens(text)
    detok = IncrementalDetokenizer(decode)  # type: ignore[arg-type]
    pieces = [detok.add([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_real_bpe_tokens(tiny_tokenizer_dir: Path, text: str, chunk: int) -> None:
    tok = ModelTokenizer(tiny_tokenizer_dir)
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok.decode)
    pieces = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_long_stream_keeps_buffer_small() -> None:
    text = "abc😀" * 500
    ids, decode = _byte_tokens(text)
    detok = IncrementalDetokenizer(decode)  # type: ignore[arg-type]
    out = "".join(detok.add([t]) for t in ids) + detok.flush()
    assert out == text
    assert len(detok.token_ids) < 40


def test_flush_emits_a_truly_broken_tail() -> None:
    ids, decode = _byte_tokens("a😀")
    detok = IncrementalDetokenizer(decode)  # type: ignore[arg-type]
    assert detok.add(ids[:1]) == "a"
    assert detok.add(ids[1:3]) == ""  # two bytes of a four-byte emoji: held back
    assert detok.flush() == "\ufffd"
