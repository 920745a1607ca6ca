"""Beam search step logic against Hugging Face `generate(num_beams=...)` on a tiny random Llama."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.sample.beam_search import BeamSearchState

VOCAB, WIDTH, PAD = 100, 4, 99  # HF pads with eos when pad_token_id is 0 (falsy)


@pytest.fixture(scope="module")
def tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         initializer_range=0.3, tie_word_embeddings=False)
    # fp64 so the cached (HF) and full-recompute (ours) forwards agree to the last fp32 bit.
    return LlamaForCausalLM(config).double().eval()


def _next_logprobs(model: Any, prompt: list[int], beams: list[list[int]]) -> torch.Tensor:
    ids = torch.tensor([prompt + beam for beam in beams])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, -1, :]
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


def _run_ours(model: Any, prompt: list[int], eos: int, max_tokens: int, **kwargs: Any) -> BeamSearchState:
    state = BeamSearchState(WIDTH, eos_token_ids=[eos], max_tokens=max_tokens, **kwargs)
    beams: list[list[int]] = [[]]
    while not state.is_done:
        chosen = state.step(_next_logprobs(model, prompt, beams))
        beams = [beams[parent] + [token] for parent, token in chosen]
        assert len(beams) in (0, WIDTH)
    return state


def _run_hf(model: Any, prompt: list[int], eos: int, max_tokens: int, **kwargs: Any) -> Any:
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), num_beams=WIDTH, num_return_sequences=WIDTH,
                              do_sample=False, max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=PAD,
                              return_dict_in_generate=True, output_scores=True, **kwargs)


def _frequent_token(model: Any, prompts: list[list[int]]) -> int:
    """The token most often among the top-3 next tokens, so beams hit it (as EOS) early."""
    counts = torch.zeros(VOCAB)
    for prompt in prompts:
        for cut in range(1, len(prompt) + 1):
            top = _next_logprobs(model, prompt[:cut], [[]]).topk(3).indices
            counts[top] += 1
    counts[PAD] = -1
    return int(counts.argmax())


PROMPTS = [[5, 17, 42], [88, 3, 61, 9, 27, 14], [33], [71, 71, 12, 50]]


@pytest.fixture(scope="module")
def eos(tiny_llama: Any) -> int:
    return _frequent_token(tiny_llama, PROMPTS)


@pytest.mark.parametrize("early_stopping", [False, True, "never"])
@pytest.mark.parametrize("length_penalty", [0.5, 1.0, 2.0])
def test_matches_hf_generate(
    tiny_llama: Any, eos: int, length_penalty: float, early_stopping: bool | str
) -> None:
    early_finishes = stopped_early = 0
    for prompt in PROMPTS:
        max_tokens = 8
        hf = _run_hf(tiny_llama, prompt, eos, max_tokens,
                     length_penalty=length_penalty, early_stopping=early_stopping)
        state = _run_ours(tiny_llama, prompt, eos, max_tokens,
                          length_penalty=length_penalty, early_stopping=early_stopping)
        stopped_early += state.num_generated < max_tokens
        ours = state.best(WIDTH)
        assert len(ours) == WIDTH
        for row, (tokens, _) in zip(hf.sequences.tolist(), ours, strict=True):
            generated = row[len(prompt):]
            assert generated[: len(tokens)] == tokens
            assert all(t == PAD for t in generated[len(tokens):])
            early_finishes += tokens[-1] == eos and len(tokens) < max_tokens
        assert [s for _, s in ours] == pytest.approx(hf.sequences_scores.tolist(), rel=1e-6)
    if early_stopping is True:
        assert stopped_early > 0, "no search stopped before max_tokens; the stopping rule went untested"
    if length_penalty <= 1.0:  # a strong length penalty rightly prefers the long beams
        assert early_finishes > 0, "the EOS token never ended a beam early; the test lost its teeth"


def test_min_tokens_blocks_eos_then_releases(tiny_llama: Any, eos: int) -> None:
    prompt = PROMPTS[2]
    hf = _run_hf(tiny_llama, prompt, eos, 8, min_new_tokens=5)
    ours = _run_ours(tiny_llama, prompt, eos, 8, min_tokens=5).best(WIDTH)
    for row, (tokens, _) in zip(hf.sequences.tolist(), ours, strict=True):
        assert len(tokens) >= 5
        assert row[len(prompt):len(prompt) + len(tokens)] == tokens


def test_step_contract() -> None:
    state = BeamSearchState(2, eos_token_ids=[0], max_tokens=2)
    first = torch.log_softmax(torch.tensor([[0.0, 3.0, 2.0, 1.0]]), dim=-1)
    assert state.step(first) == [(0, 1), (0, 2)]
    assert state.num_running == 2
    with pytest.raises(ValueError, match="one row per beam"):
        state.step(first)
    second = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0, 3.0], [5.0, 0.0, 0.0, 0.0]]), dim=-1)
    assert state.step(second) == []  # max_tokens reached: the search is over
    assert state.is_done and state.num_running == 0
    best = state.best(2)
    assert [tokens for tokens, _ in best] == [[1, 3], [2, 0]]
    with pytest.raises(RuntimeError):
        state.step(second)


def test_best_before_done_falls_back_to_running_beams() -> None:
    state = BeamSearchState(2, eos_token_ids=[0], max_tokens=10, length_penalty=1.0)
    state.step(torch.log_softmax(torch.tensor([[-9.0, 3.0, 2.0, 1.0]]), dim=-1))
    best = state.best(2)
    assert [tokens for tokens, _ in best] == [[1], [2]]
    assert best[0][1] == pytest.approx(float(torch.log_softmax(torch.tensor([-9.0, 3.0, 2.0, 1.0]), 0)[1]))
