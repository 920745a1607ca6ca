"""The paged model gives the same logits as HF transformers, however the tokens reach the cache."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ops
from engine.model import AttentionMetadata, LlamaForCausalLM, allocate_kv_caches, load_model
from engine.model.execution_policy import ExecutionPolicy
from tests.fixtures.models import PagedHarness, Seq, make_tiny_model_dir

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "gqa": ("llama", {}),
    "mha": ("llama", {"num_key_value_heads": 4}),
    "mqa": ("llama", {"num_key_value_heads": 1}),
    "tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2-bias": ("qwen2", {}),
    "llama3-rope": ("llama", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "linear-rope": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}),
}


def _assert_close(got: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def _hf_logits(directory: Path, tokens: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> LlamaForCausalLM:
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> dict[int, torch.Tensor]:
    """HF logits for a few seeded token sequences (seed -> [len, vocab])."""
    return {seed: _hf_logits(tiny_llama_dir, _tokens(40, seed)) for seed in range(4)}


def test_full_prefill_matches_hf(tiny: LlamaForCausalLM, reference: dict[int, torch.Tensor]) -> None:
    logits = PagedHarness(tiny).step([(Seq(_tokens(40, 0)), 40)], [])
    _assert_close(logits, reference[0])


def test_chunked_prefill_matches_hf(tiny: LlamaForCausalLM, reference: dict[int, torch.Tensor]) -> None:
    harness, seq = PagedHarness(tiny, seed=1), Seq(_tokens(40, 0))
    logits = torch.cat([harness.step([(seq, n)], []) for n in (5, 11, 1, 16, 7)])
    _assert_close(logits, reference[0])


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_prefill_then_decode_matches_hf(
    backend: str, tiny: LlamaForCausalLM, reference: dict[int, torch.Tensor], tiny_llama_dir: Path
) -> None:
    model = tiny if backend == "auto" else load_model(tiny_llama_dir,
                                                       policy=ExecutionPolicy(ops=ops.OpsPolicy.of(backend)))
    harness, seq = PagedHarness(model, seed=2, block_size=8), Seq(_tokens(40, 1))
    steps = [harness.step([(seq, 13)], [])] + [harness.step([], [seq]) for _ in range(27)]
    _assert_close(torch.cat(steps), reference[1])


def _step(harness: PagedHarness, seqs: list[Seq], got: list[list[torch.Tensor]],
          prefills: list[tuple[int, int]], decodes: list[int]) -> None:
    """One flattened step; each sequence's logits rows are appended to `got[index]`."""
    out = harness.step([(seqs[i], n) for i, n in prefills], [seqs[i] for i in decodes])
    rows = out.split([n for _, n in prefills] + [1] * len(decodes))
    for i, row in zip([i for i, _ in prefills] + decodes, rows, strict=True):
        got[i].append(row)


def test_mixed_batch_with_shuffled_blocks(tiny: LlamaForCausalLM, reference: dict[int, torch.Tensor]) -> None:
    """Two sequences prefill in chunks while two others decode, all in the same steps."""
    harness = PagedHarness(tiny, num_blocks=80, block_size=4, seed=5)
    seqs = [Seq(_tokens(40, s)) for s in range(4)]
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    _step(harness, seqs, got, [(2, 9), (3, 20)], [])
    for chunk in (6, 14, 20):
        _step(harness, seqs, got, [(0, chunk), (1, chunk)], [2, 3])
    while seqs[2].num_computed < 40:
        _step(harness, seqs, got, [], [i for i in (2, 3) if seqs[i].num_computed < 40])
    for i in range(4):
        _assert_close(torch.cat(got[i]), reference[i])


def test_prefix_already_in_cache(tiny: LlamaForCausalLM, reference: dict[int, torch.Tensor]) -> None:
    """A second sequence reuses the first one's full prefix blocks and prefills only its suffix."""
    harness = PagedHarness(tiny, seed=3, block_size=4)
    tokens = _tokens(40, 2)
    first = Seq(tokens[:24])
    harness.step([(first, 24)], [])
    second = Seq(tokens, blocks=list(first.blocks[:5]), num_computed=20)  # 5 full blocks = 20 tokens
    logits = harness.step([(second, 20)], [])
    _assert_close(logits, reference[2][20:])


def test_prefill_writes_only_its_own_blocks(tiny: LlamaForCausalLM) -> None:
    harness = PagedHarness(tiny)
    harness.step([(Seq(_tokens(8, 0)), 8)], [])
    written = [int(k.ne(0).any(dim=(1, 2, 3)).sum()) for k, _ in harness.kv_caches]
    assert written == [2] * len(written)  # 8 tokens in blocks of 4: two blocks per layer, nothing else


def test_skipped_slots_and_empty_cache(tiny: LlamaForCausalLM, reference: dict[int, torch.Tensor]) -> None:
    """A whole-prompt prefill with slot -1 everywhere needs no cache (the runner's profiling pass)."""
    caches = allocate_kv_caches(tiny, 0, 16, torch.float32, "cpu")
    meta = AttentionMetadata(
        slot_mapping=torch.full((40,), -1, dtype=torch.int64), num_prefills=1, num_prefill_tokens=40,
        prefill_query_start=[0, 40], prefill_context_lens=[40],
        prefill_block_tables=torch.zeros((1, 1), dtype=torch.int32),
        decode_block_tables=torch.zeros((0, 1), dtype=torch.int32),
        decode_context_lens=torch.zeros(0, dtype=torch.int32),
    )
    hidden = tiny(torch.tensor(_tokens(40, 0)), torch.arange(40), caches, meta)
    _assert_close(tiny.compute_logits(hidden), reference[0])


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_architecture_variants_match_hf(variant: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    model_type, overrides = VARIANTS[variant]
    directory = make_tiny_model_dir(tmp_path_factory.mktemp(variant), model_type, seed=7, **overrides)
    tokens = _tokens(24, 9)
    reference = _hf_logits(directory, tokens)
    model = load_model(directory)
    harness, seq = PagedHarness(model, seed=4), Seq(tokens)
    logits = [harness.step([(seq, 10)], []), harness.step([(seq, 6)], [])]
    logits += [harness.step([], [seq]) for _ in range(8)]
    _assert_close(torch.cat(logits), reference)


@pytest.mark.parametrize("screen", [True, False])
@pytest.mark.parametrize("group_rows", [1, 7, 64])
def test_picked_tokens_equal_those_of_the_full_logits(tiny: LlamaForCausalLM, tiny_llama_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      group_rows: int, screen: bool) -> None:
    """The lm_head in row groups, each turned into tokens as it comes (argmax, and seeded draws
    for some rows), and greedy rows through the bf16 logit screen where this CPU has one, pick
    what the full logits pick."""
    import engine.model.logit_screen as logit_screen
    import engine.sample.head as head
    from engine.model.execution_policy import ExecutionPolicy
    from engine.sample.head import choose_tokens
    from engine.sample.sampler import Draws, TokenPlan

    monkeypatch.setattr(head, "LOGITS_GROUP_BYTES", group_rows * 4 * tiny.spec.vocab_size)
    monkeypatch.setattr(logit_screen, "SCREEN_GROUP_BYTES", group_rows * 2 * tiny.spec.vocab_size)
    if not screen:  # the policy turns the screen off
        tiny = load_model(tiny_llama_dir, policy=ExecutionPolicy(logit_screen=False))
    assert (tiny.logit_screen() is not None) == (screen and ops.native_bf16())
    hidden = torch.randn(50, tiny.spec.hidden_size, generator=torch.Generator().manual_seed(3))
    logits = tiny.compute_logits(hidden)
    got = choose_tokens(tiny.head, hidden, TokenPlan(Draws()))
    assert got.dtype == torch.int64 and torch.equal(got, logits.max(dim=-1).indices)
    random_rows = [0, 3, 7, 8, 30, 49]
    plan = TokenPlan(Draws.unfiltered(random_rows, [0.7 + 0.1 * i for i in range(6)],
                                      [0.05 + 0.15 * i for i in range(6)]))
    expected = plan(logits, 0)
    assert torch.equal(choose_tokens(tiny.head, hidden, plan), expected)
    drawn = ops.sample_from_logits(logits[random_rows], plan.tensors.inv_temperature, plan.tensors.uniforms)
    assert torch.equal(expected[random_rows], drawn)
    everyone = TokenPlan(Draws.unfiltered(list(range(50)), [0.9] * 50, [0.5] * 50))
    assert torch.equal(choose_tokens(tiny.head, hidden, everyone), everyone(logits, 0))
