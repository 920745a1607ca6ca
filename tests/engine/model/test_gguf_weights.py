"""The quantized GGUF path: tensors stay packed, Q/K rows are put back in HF order, unsupported
types are refused by name, and the real SmolLM2 Q4_1 file (when fetched) decodes like the same
weights dequantized to fp32 (its lm_head's int8 screen picking the exact greedy tokens)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ops
from engine.model import load_model
from engine.model.gguf_weights import GGUFWeightError, read_tensor, unpermute_rope_rows
from engine.model.loader import ModelLoadError
from engine.model.quant_linear import QuantEmbedding, QuantLinear
from engine.model.quant_screen import QuantLogitScreen
from ops.quant import Q4_1, Q8_0, QUANT_GEMV_MAX_ROWS
from ops.reference import quant as ref

gguf = pytest.importorskip("gguf")


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's HF -> GGUF row order for Q and K (pairs (i, i + D/2) become rows 2i, 2i + 1)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize(("heads", "head_dim"), [(9, 64), (3, 64), (2, 8)])
def test_unpermute_inverts_llama_cpp_on_packed_rows(heads: int, head_dim: int) -> None:
    weight = torch.randn(heads * head_dim, 64)
    packed = ref.quantize(weight, Q4_1.type_id)
    back = unpermute_rope_rows(ref.quantize(_llama_cpp_permute(weight, heads), Q4_1.type_id), heads)
    assert torch.equal(back, packed)  # whole packed rows moved: bytes identical


def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Any]]) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        raw = gguf.quants.quantize(data, qtype) if qtype not in (gguf.GGMLQuantizationType.F32,) else data
        writer.add_tensor(name, raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_read_tensor_keeps_blocks_and_refuses_other_types(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 64)).astype(np.float32)
    types = gguf.GGMLQuantizationType
    file = _write_gguf(tmp_path / "t.gguf", {"a.weight": (w, types.Q4_1), "b.weight": (w, types.F32),
                                             "c.weight": (np.tile(w, 4), types.TQ2_0)})  # 256-weight blocks
    tensors = {t.name: t for t in gguf.GGUFReader(str(file)).tensors}
    packed = read_tensor(tensors["a.weight"])
    assert packed.fmt == Q4_1 and packed.data.dtype == torch.uint8 and packed.data.shape == (8, 40)
    np.testing.assert_array_equal(ref.dequantize(packed.data, Q4_1.type_id).numpy(),
                                  gguf.quants.dequantize(gguf.quants.quantize(w, types.Q4_1), types.Q4_1))
    plain = read_tensor(tensors["b.weight"])
    assert plain.fmt is None and torch.equal(plain.data, torch.from_numpy(w))
    with pytest.raises(GGUFWeightError, match=r"'c.weight' is TQ2_0.*quantization='dequantize'"):
        read_tensor(tensors["c.weight"])


def test_quant_linear_module_shards() -> None:
    w = [torch.randn(64, 96), torch.randn(32, 96), torch.randn(16, 96)]
    shards = [(Q4_1, ref.quantize(w[0], Q4_1.type_id)), (Q8_0, ref.quantize(w[1], Q8_0.type_id)), (None, w[2])]
    bias = torch.randn(112)
    layer = QuantLinear(96, shards, bias, int8_activations=False)
    x = torch.randn(3, 96)
    expected = x @ layer.dequantized_weight().T + bias
    torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-4)
    assert layer.out_features == 112
    with pytest.raises(ValueError, match=r"bias must be fp32 \[112\]"):
        QuantLinear(96, shards, torch.zeros(111))
    embed = QuantEmbedding(Q8_0, shards[1][1], 96)
    ids = torch.tensor([[3, 0], [31, 3]])
    torch.testing.assert_close(embed(ids), ref.dequantize(shards[1][1], Q8_0.type_id)[ids])


def test_quantized_gguf_needs_fp32_cpu(tmp_path: Path) -> None:
    gguf_file = _smollm2_gguf()
    with pytest.raises(ModelLoadError, match="fp32 on the CPU"):
        load_model(gguf_file, dtype="bfloat16")
    with pytest.raises(ModelLoadError, match="unknown quantization"):
        load_model(gguf_file, quantization="int3")


def _smollm2_gguf() -> Path:
    from engine.model.fetch import default_gguf_path

    path = default_gguf_path()
    if not path.is_file():
        pytest.skip("the default model's GGUF is not fetched (run `pagedserve fetch-model`)")
    return path


def test_smollm2_q4_1_matches_its_dequantized_weights() -> None:
    """Every quantized tensor, dequantized, equals transformers' dequantized load (the fetched fp32
    directory), Q/K rows included; greedy decoding agrees and the passage NLL is within 1%."""
    from safetensors.torch import load_file

    from benchmarks.quality.quant_quality import PASSAGE, greedy, mean_nll, mean_nll_decode

    gguf_file = _smollm2_gguf()
    quant = load_model(gguf_file)
    assert isinstance(quant.lm_head, QuantLinear) and quant.lm_head.formats == [Q8_0]
    assert not quant.lm_head.int8_activations and quant.model.layers[0].mlp.down_proj.int8_activations
    assert isinstance(quant.model.embed_tokens, QuantEmbedding)
    screen = quant.logit_screen()
    assert isinstance(screen, QuantLogitScreen) and screen.serves(quant.lm_head)
    hf = load_file(str(gguf_file.parent / "model.safetensors"))
    for i in (0, 29):
        layer = quant.model.layers[i]
        qkv = torch.cat([hf[f"model.layers.{i}.self_attn.{n}_proj.weight"] for n in "qkv"])
        assert torch.equal(layer.self_attn.qkv_proj.dequantized_weight(), qkv)
        assert torch.equal(layer.mlp.down_proj.dequantized_weight(), hf[f"model.layers.{i}.mlp.down_proj.weight"])
    assert torch.equal(quant.lm_head.dequantized_weight(), hf["model.embed_tokens.weight"])
    from transformers import AutoTokenizer

    fp32 = load_model(gguf_file.parent)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent))
    passage = tokenizer(PASSAGE)["input_ids"]
    with torch.inference_mode():
        reference = mean_nll(fp32, passage)
        heads: list[torch.Tensor] = []
        hook = quant.lm_head.register_forward_pre_hook(lambda _, args: heads.append(args[0]))
        assert abs(mean_nll(quant, passage) - reference) <= 0.01 * reference
        hook.remove()
        hidden = heads[0][:QUANT_GEMV_MAX_ROWS]  # the passage's final hidden states: the screen's tokens are exact
        assert torch.equal(screen.argmax(hidden), quant.lm_head(hidden).max(dim=-1).indices)
        assert abs(mean_nll_decode(quant, passage[:48]) - mean_nll(fp32, passage[:48])) <= 0.01 * reference
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False)
        ours, theirs = greedy(quant, list(prompt), 12), greedy(fp32, list(prompt), 12)
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), len(ours))
    assert first >= 4, f"greedy tokens diverge at {first}: {ours} vs {theirs}"


def test_load_model_reads_the_config_once(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine reads a model's config once and hands its `ModelSpec` to `load_model` (for a .gguf
    each read parses the whole metadata): a given spec is used as is, the file's config is not read again."""
    from engine.model import loader
    from engine.model.spec import ModelSpec

    config = loader.load_hf_config(tiny_llama_dir)
    config.num_hidden_layers = 1  # the checkpoint has more layers: only the given config says 1

    def no_second_read(path: object) -> None:
        raise AssertionError(f"config of {path} read again")

    monkeypatch.setattr(loader, "load_hf_config", no_second_read)
    with pytest.raises(KeyError, match=r"layers\.1\..* has no place in the model"):  # the checkpoint has layer 1
        load_model(tiny_llama_dir, spec=ModelSpec.from_hf_config(config))


def test_all_linears_quantized() -> None:
    from torch import nn

    from engine.model.quant_linear import all_linears_quantized

    packed = QuantLinear(32, [(Q8_0, ref.quantize(torch.randn(8, 32), Q8_0.type_id))])
    with_f32 = QuantLinear(32, [(None, torch.randn(8, 32))])
    assert all_linears_quantized(nn.Sequential(packed, nn.ReLU()))
    assert not all_linears_quantized(nn.Sequential(packed, with_f32))  # an fp32 shard runs ops.linear (oneDNN)
    assert not all_linears_quantized(nn.Sequential(packed, nn.Linear(8, 8)))
    assert not all_linears_quantized(nn.Sequential(nn.ReLU()))


def test_smollm2_q4_1_bf16_linears_stay_within_1_percent() -> None:
    """With bf16 linears (dtype bfloat16) a prefill of the passage computes in bf16 (AMX tiles or
    AVX512-BF16 dot products where the CPU has them): other hidden states, a mean NLL within 1% of
    the fp32 model's; where every row of a large step goes bf16 (AMX), steps under both thresholds
    keep the int8 / fp32 kernels bit for bit."""
    from transformers import AutoTokenizer

    from benchmarks.quality.quant_quality import PASSAGE, Paged, mean_nll

    gguf_file = _smollm2_gguf()
    passage = AutoTokenizer.from_pretrained(str(gguf_file.parent))(PASSAGE)["input_ids"]
    from engine.model.execution_policy import ExecutionPolicy

    quant, fp32 = load_model(gguf_file, policy=ExecutionPolicy(bf16_linears=True)), load_model(gguf_file.parent)
    plain = load_model(gguf_file)  # the same file with the default policy: int8 / fp32 linears

    def steps(bf16: bool, chunks: list[list[int]]) -> list[torch.Tensor]:
        paged = Paged(quant if bf16 else plain, len(passage))
        with torch.inference_mode():
            return [paged.run(chunk) for chunk in chunks]

    assert not torch.equal(steps(True, [passage])[0], steps(False, [passage])[0])
    with torch.inference_mode():
        reference = mean_nll(fp32, passage)
        assert abs(mean_nll(quant, passage) - reference) <= 0.01 * reference
    if not ops.quant.bf16_all_rows():  # prompt rows in bf16 at any count: test_batch_invariance's bf16 case
        return
    small = [passage[:3], passage[3:4], passage[4:5]]  # under BF16_MIN_PROMPT_ROWS and BF16_MIN_ROWS
    for ours, theirs in zip(steps(True, small), steps(False, small), strict=True):
        assert torch.equal(ours, theirs)


@pytest.mark.long
def test_smollm2_q4_1_engine_batch_decodes_like_single_streams() -> None:
    """The engine on the Q4_1 file (kernels on the chunk pool up to 128 rows, the lm_head screened) decodes
    a batch of greedy streams token for token as it decodes each stream alone: no kernel's rows
    depend on the batch up to 128 rows."""
    from common.sampling_params import SamplingParams
    from engine.llm import LLM

    engine = LLM(str(_smollm2_gguf()), kv_cache_memory=1 << 27, dtype="float32").engine  # bf16 steps batch rows
    from ops.parallel import openmp_rows
    from ops.quant import QUANT_GEMV_MAX_ROWS

    assert openmp_rows() == QUANT_GEMV_MAX_ROWS + 1  # every step of up to 128 rows on the chunk pool
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 40000, (5 + 3 * i,), generator=gen).tolist() for i in range(6)]

    def run(batch: list[list[int]], tag: str) -> list[list[int]]:
        for i, prompt in enumerate(batch):
            engine.add_request(f"{tag}{i}", prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        return [tokens[f"{tag}{i}"] for i in range(len(batch))]

    together = run(prompts, "b")
    alone = [run([p], f"s{i}-")[0] for i, p in enumerate(prompts)]
    assert together == alone and all(len(t) == 12 for t in together)
