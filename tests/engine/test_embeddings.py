"""`LLM.embed` on the pooling runner: the vectors equal Hugging Face's pooled final hidden states
(last token, mean, first token), in input order; a vector does not depend on its batch, its
chunking or a prefix-cache hit (bit for bit); bad requests are refused and leave no block held."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model.spec import UnsupportedModelError
from tests.engine.helpers import assert_no_leaks
from tests.fixtures.models import make_tiny_model_dir

SMALL = {"dtype": "float32", "kv_cache_memory": 8 << 20, "swap_space": 1 << 20}
PROMPTS = [[5, 9, 200, 31, 77], list(range(40, 140)), [3], [250, 7, 7, 7, 19, 64, 100, 8, 2, 11, 90]]


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Two torch threads whatever OMP_NUM_THREADS says: work a kernel splits between threads only
    when a step is small shows up only then (as in test_batch_invariance)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def qwen3_embedder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A headless random Qwen3 (`Qwen3Model`): served as pooling by auto-detection."""
    return make_tiny_model_dir(tmp_path_factory.mktemp("qwen3-embed"), "qwen3", seed=4, headless=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama-pool"), seed=5)


@pytest.fixture(scope="module")
def embedder(qwen3_embedder_dir: Path) -> Iterator[LLM]:
    with LLM(str(qwen3_embedder_dir), **SMALL, max_num_batched_tokens=32) as llm:
        yield llm


def hf_pooled(model_dir: Path, prompts: list[list[int]], pooling: str) -> list[torch.Tensor]:
    """`AutoModel(...).last_hidden_state` of each prompt alone, pooled and L2-normalized."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            hidden = model(torch.tensor([prompt])).last_hidden_state[0]
            row = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling]
            out.append(F.normalize(row, dim=0))
    return out


def _assert_close_to_hf(results: list[Any], reference: list[torch.Tensor]) -> None:
    assert len(results) == len(reference)
    for result, want in zip(results, reference, strict=True):
        got = torch.tensor(result.outputs.embedding)
        assert got.shape == want.shape
        assert F.cosine_similarity(got, want, dim=0).item() >= 0.999
        assert abs(got.norm().item() - 1.0) < 1e-5


def test_last_token_of_headless_qwen3_matches_hf(embedder: LLM, qwen3_embedder_dir: Path) -> None:
    assert embedder.engine.runner_kind == "pooling"  # detected: Qwen3Model has no LM head
    results = embedder.embed(PROMPTS)
    assert [r.prompt_token_ids for r in results] == PROMPTS
    _assert_close_to_hf(results, hf_pooled(qwen3_embedder_dir, PROMPTS, "LAST"))
    assert_no_leaks(embedder)


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
@pytest.mark.usefixtures("two_threads")
def test_generative_model_pooled_with_runner_pooling(llama_dir: Path, pooling: str) -> None:
    with LLM(str(llama_dir), **SMALL, runner="pooling", pooling_type=pooling, max_num_batched_tokens=32) as llm:
        results = llm.embed(PROMPTS)
        _assert_close_to_hf(results, hf_pooled(llama_dir, PROMPTS, pooling))
        again = llm.embed(PROMPTS)  # full prompt blocks now come from the prefix cache: recomputed rows
        assert [r.outputs.embedding for r in again] == [r.outputs.embedding for r in results]
        assert_no_leaks(llm)
    with LLM(str(llama_dir), **SMALL, runner="pooling", pooling_type=pooling) as whole:  # no chunking, one batch
        assert [r.outputs.embedding for r in whole.embed(PROMPTS)] == [r.outputs.embedding for r in results]


@pytest.mark.usefixtures("two_threads")
def test_vector_does_not_depend_on_batch_chunking_or_cache(embedder: LLM) -> None:
    rng = random.Random(3)
    target = [rng.randrange(256) for _ in range(90)]
    others = [[rng.randrange(256) for _ in range(rng.randrange(1, 120))] for _ in range(7)]
    alone = embedder.embed([target])[0].outputs.embedding
    embedder.reset_prefix_cache()
    mixed = embedder.embed([*others[:4], target, *others[4:]])
    assert mixed[4].outputs.embedding == alone
    cached = embedder.embed([target])[0].outputs.embedding  # its full blocks are prefix-cache hits now
    assert cached == alone
    assert_no_leaks(embedder)


def test_string_inputs_and_normalize_off(embedder: LLM) -> None:
    text, raw = embedder.embed("hello"), embedder.embed("hello", PoolingParams(normalize=False))
    assert text[0].prompt_token_ids == list(embedder.tokenizer.encode("hello"))
    vector, unnormed = torch.tensor(text[0].outputs.embedding), torch.tensor(raw[0].outputs.embedding)
    assert torch.allclose(F.normalize(unnormed, dim=0), vector, atol=1e-6)
    assert abs(unnormed.norm().item() - 1.0) > 1e-3


def test_refusals_leave_the_engine_serving(embedder: LLM) -> None:
    llm = embedder
    with pytest.raises(ValueError, match="embeddings"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="matryoshka"):
        llm.embed([[1, 2, 3]], PoolingParams(dimensions=16))
    with pytest.raises(ValueError, match="empty"):
        llm.embed([[]])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed([[1] * 600])
    with pytest.raises(ValueError, match=r"vocabulary|token ids"):
        llm.embed([[1, 2, 99999]])
    assert_no_leaks(llm)
    assert len(llm.embed([[1, 2, 3]])[0].outputs.embedding) == 64
    assert len(llm.engine.pooler) == 0


def test_embeddings_on_a_generating_engine_are_refused(llama_dir: Path) -> None:
    with LLM(str(llama_dir), **SMALL) as llm:
        assert llm.engine.runner_kind == "generate"
        with pytest.raises(ValueError, match="generation, not embeddings"):
            llm.embed([[1, 2, 3]])
        assert_no_leaks(llm)


def test_sentence_transformers_folder_and_matryoshka(tmp_path: Path) -> None:
    """modules.json and 1_Pooling/config.json choose MEAN and no normalization; is_matryoshka in
    config.json allows `dimensions` (the first N values, then normalized if asked)."""
    folder = make_tiny_model_dir(tmp_path / "st", "qwen3", seed=6, headless=True)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False}))
    with LLM(str(folder), **SMALL) as llm:
        assert llm.engine.pooler_config is not None
        assert (llm.engine.pooler_config.pooling_type, llm.engine.pooler_config.normalize) == ("MEAN", False)
        full = torch.tensor(llm.embed([PROMPTS[1]])[0].outputs.embedding)
        want = hf_pooled(folder, [PROMPTS[1]], "MEAN")[0]
        assert F.cosine_similarity(full, want, dim=0).item() >= 0.999
        cut = llm.embed([PROMPTS[1]], PoolingParams(dimensions=16, normalize=True))[0].outputs.embedding
        assert torch.allclose(torch.tensor(cut), F.normalize(full[:16], dim=0), atol=1e-6)
        with pytest.raises(ValueError, match=r"one of \[16, 32\]"):
            llm.embed([PROMPTS[0]], PoolingParams(dimensions=20))
        assert_no_leaks(llm)


def test_unserved_architecture_is_refused_by_name(tmp_path: Path) -> None:
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=64)).save_pretrained(str(tmp_path))
    with pytest.raises(UnsupportedModelError, match="bert"):
        LLM(str(tmp_path), **SMALL, runner="pooling")


def test_headless_model_cannot_generate(qwen3_embedder_dir: Path) -> None:
    from engine.model.pooling_config import PoolingConfigError

    with pytest.raises(PoolingConfigError, match="no LM head"):
        LLM(str(qwen3_embedder_dir), **SMALL, runner="generate")
