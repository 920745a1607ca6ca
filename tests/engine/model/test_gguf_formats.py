"""GGUF files in each packed format (the 5-bit legacy ones, IQ4, the K-quants Q2_K-Q6_K), in a format
without a kernel (Q2_K with its kernels set aside: no format of the table is dequantized at load today,
the path stays), and in mixes of them with packed ones, written here from a tiny random Llama (hidden
256: K-quant rows are 256-weight blocks) with gguf's quantizers and ours (ops/reference/quantizers.py):
the loaded weights are exactly transformers' dequantized load of the same file (gguf.quants.dequantize), modules mixing
formats run in fp32, the log names each format's path, and greedy decoding equals transformers'."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import ops
from engine.model import load_model
from engine.model.quant_linear import QuantEmbedding, QuantLinear
from engine.model.quant_screen import QuantLogitScreen
from ops.reference import formats, quantizers
from tests.engine.helpers import argmax_greedy
from tests.engine.model.gguf_writing import add_decoder_shape
from tests.fixtures.models import make_tiny_model_dir

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType
HEADS, KV_HEADS, LAYERS = 4, 2, 2
_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
       "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
       "ffn_down": "mlp.down_proj"}
NO_KERNEL = "Q2_K"  # set aside by `without_kernel` where a test needs a format that is dequantized at load
# A mix: layer 0 mixes formats inside q/k/v (one without a kernel, so that module runs in fp32), keeps
# gate/up packed (Q8_0, eight-row layout); layer 1 is all Q4_1 (packed, eight-row layout); a Q2_K embedding,
# a Q8_0 lm_head.
MIX = {"attn_q": "Q2_K", "attn_k": "Q5_0", "attn_v": "Q8_0", "attn_output": "Q2_K", "ffn_gate": "Q8_0",
       "ffn_up": "Q8_0", "ffn_down": "Q2_K"}
PROMPTS = [[256, 72, 101, 108, 108, 111], [256, 3, 99, 200, 17, 45, 88, 120, 7], [256, 50]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-256"), hidden_size=256, intermediate_size=512,
                               num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, num_hidden_layers=LAYERS)


def without_kernel(monkeypatch: pytest.MonkeyPatch, name: str = NO_KERNEL) -> None:
    """Make the format table say ``name`` has no kernel (``DEQUANTIZED``) for one test: the loader's
    path for such a format (dequantize at load, or requantize to Q8_0) has no format of its own now."""
    import dataclasses

    fmt = dataclasses.replace(formats.BY_NAME[name], runs=formats.DEQUANTIZED)
    monkeypatch.setitem(formats.BY_NAME, name, fmt)
    monkeypatch.setitem(formats.BY_ID, fmt.type_id, fmt)


@pytest.fixture
def no_kernel(monkeypatch: pytest.MonkeyPatch) -> str:
    without_kernel(monkeypatch)
    return NO_KERNEL


def _encode(weight: torch.Tensor, name: str) -> tuple[np.ndarray, object]:
    if name == "F32":
        return weight.numpy(), T.F32
    if name in quantizers.QUANTIZERS:
        return quantizers.quantize(weight, name).numpy(), T[name]
    return gguf.quants.quantize(weight.numpy(), T[name]), T[name]  # gguf quantizes Q4_0/Q4_1/Q5_0/Q5_1/Q8_0


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's HF -> GGUF row order for Q and K."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: Path, name: str, fmt_of: Callable[[str, int], str], tied: bool = False,
               out_dir: Path | None = None) -> Path:
    """`model_dir`'s Llama checkpoint as `name`.gguf in `out_dir` (default: beside it, by its
    tokenizer), each tensor in `fmt_of(gguf kind, layer)` (layer -1: token_embd / output), norms in
    F32, Q/K rows in llama.cpp's order. `tied` (or a checkpoint without lm_head.weight): no
    output.weight, so the file's config ties the lm_head to the embedding."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    hf = load_file(str(model_dir / "model.safetensors"))
    tied = tied or "lm_head.weight" not in hf
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    path = (out_dir or model_dir) / f"{name}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    add_decoder_shape(writer, config)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(config.hidden_size // heads)
    writer.add_vocab_size(config.vocab_size)
    if isinstance(config.bos_token_id, int):
        writer.add_bos_token_id(config.bos_token_id)
    if isinstance(config.eos_token_id, int):
        writer.add_eos_token_id(config.eos_token_id)

    def add(tensor: str, weight: torch.Tensor, fmt: str) -> None:
        data, qtype = _encode(weight.float().contiguous(), fmt)
        writer.add_tensor(tensor, data, raw_dtype=qtype)

    add("token_embd.weight", hf["model.embed_tokens.weight"], fmt_of("token_embd", -1))
    add("output_norm.weight", hf["model.norm.weight"], "F32")
    if not tied:
        add("output.weight", hf["lm_head.weight"], fmt_of("output", -1))
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        add(f"blk.{i}.attn_norm.weight", hf[prefix + "input_layernorm.weight"], "F32")
        add(f"blk.{i}.ffn_norm.weight", hf[prefix + "post_attention_layernorm.weight"], "F32")
        for kind, hf_name in _HF.items():
            weight = hf[prefix + hf_name + ".weight"]
            if kind in ("attn_q", "attn_k"):
                weight = _llama_cpp_permute(weight, heads if kind == "attn_q" else kv_heads)
            add(f"blk.{i}.{kind}.weight", weight, fmt_of(kind, i))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _mix(kind: str, layer: int) -> str:
    return {"token_embd": "Q2_K", "output": "Q8_0"}[kind] if layer < 0 else MIX[kind] if layer == 0 else "Q4_1"


def _weight(module: nn.Module) -> torch.Tensor:
    if isinstance(module, QuantLinear):
        return module.dequantized_weight()
    if isinstance(module, QuantEmbedding):
        return ops.dequantize(module.qweight, module.fmt, module.embedding_dim)
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    return weight.detach()


def _transformers_model(model_dir: Path, file: Path) -> nn.Module:
    """transformers' load of the GGUF: every tensor dequantized by gguf.quants, Q/K rows un-permuted."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), gguf_file=file.name, dtype=torch.float32).eval()


def _assert_weights_equal(ours: nn.Module, hf: nn.Module) -> None:
    state = hf.state_dict()
    assert torch.equal(_weight(ours.model.embed_tokens), state["model.embed_tokens.weight"])
    assert torch.equal(_weight(ours.lm_head), state["lm_head.weight"])
    assert torch.equal(ours.model.norm.weight, state["model.norm.weight"])
    for i, layer in enumerate(ours.model.layers):
        prefix = f"model.layers.{i}."
        stacked = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}
        for path, parts in stacked.items():
            group = path.split(".")[0]
            expected = torch.cat([state[f"{prefix}{group}.{p}_proj.weight"] for p in parts])
            assert torch.equal(_weight(layer.get_submodule(path)), expected), (i, path)
        for path in ("self_attn.o_proj", "mlp.down_proj"):
            assert torch.equal(_weight(layer.get_submodule(path)), state[f"{prefix}{path}.weight"]), (i, path)
        assert torch.equal(layer.input_layernorm.weight, state[prefix + "input_layernorm.weight"])


def test_a_format_without_a_kernel_loads_the_reference_dequantization(model_dir: Path, no_kernel: str) -> None:
    """Every tensor (embedding and lm_head included) in one format without a kernel: fp32 modules
    holding exactly gguf's dequantization; the quantized paths (fused decoder, int8 screen) stand aside."""
    fmt = no_kernel
    file = write_gguf(model_dir, f"all-{fmt}", lambda kind, layer: fmt)
    ours = load_model(file)
    _assert_weights_equal(ours, _transformers_model(model_dir, file))
    assert not any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in ours.modules())
    assert isinstance(ours.model.embed_tokens, nn.Embedding)
    assert ours.fused_decoder() is None and not isinstance(ours.logit_screen(), QuantLogitScreen)


def test_mix_keeps_packed_modules_and_logs_each_path(model_dir: Path, no_kernel: str) -> None:
    from structlog.testing import capture_logs

    file = write_gguf(model_dir, "mix", _mix)
    with capture_logs() as logs:
        ours = load_model(file)
    _assert_weights_equal(ours, _transformers_model(model_dir, file))
    layer0, layer1 = ours.model.layers
    for module in (layer0.self_attn.qkv_proj, layer0.self_attn.o_proj, layer0.mlp.down_proj):
        assert type(module).__name__ == "Linear"  # mixed or unpacked: the model's fp32 layer
    assert isinstance(layer0.mlp.gate_up_proj, QuantLinear) and layer0.mlp.gate_up_proj.formats == [ops.quant.Q8_0R8]
    assert all(isinstance(m, QuantLinear) for m in (layer1.self_attn.qkv_proj, layer1.mlp.down_proj))
    assert layer1.self_attn.qkv_proj.formats == [ops.quant.Q4_1R8]
    assert isinstance(ours.model.embed_tokens, nn.Embedding)  # Q2_K: dequantized
    assert isinstance(ours.logit_screen(), QuantLogitScreen)  # the Q8_0 lm_head keeps its int8 screen
    assert ours.fused_decoder() is None  # layer 0 is not all packed
    [line] = [e for e in logs if e["event"] == "GGUF tensor formats"]
    assert line["formats"] == ("F32: 5 tensors, float32; "
                               "Q2_K: 4 tensors, dequantized at load to float32; "
                               "Q4_1: 7 tensors, packed (quantized kernels); "
                               "Q5_0: 1 tensors, dequantized at load to float32; "
                               "Q8_0: 1 tensors, dequantized at load to float32; "
                               "Q8_0: 3 tensors, packed (quantized kernels)")


@pytest.mark.parametrize("embedding", ["Q2_K", "Q6_K"])
def test_tied_embedding_dequantized_or_packed(model_dir: Path, embedding: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No output.weight: the lm_head is the embedding, one without a kernel dequantized (an fp32 `Linear`
    sharing the embedding's storage, the bf16 screen's kind) or a Q6_K one packed (`QuantLinear`
    on the same bytes and its int8 screen); weights equal transformers' tied load, and so do greedy tokens."""
    from benchmarks.quality.quant_quality import greedy

    if embedding == NO_KERNEL:
        without_kernel(monkeypatch)
    file = write_gguf(model_dir, f"tied-{embedding}", lambda kind, layer: embedding if layer < 0 else "Q5_K",
                      tied=True)
    ours = load_model(file)
    assert ours.spec.tie_word_embeddings
    _assert_weights_equal(ours, _transformers_model(model_dir, file))
    if embedding == "Q2_K":
        assert type(ours.lm_head).__name__ == "Linear" and isinstance(ours.model.embed_tokens, nn.Embedding)
        assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
        assert not isinstance(ours.logit_screen(), QuantLogitScreen)
    else:
        assert isinstance(ours.lm_head, QuantLinear) and isinstance(ours.model.embed_tokens, QuantEmbedding)
        assert isinstance(ours.logit_screen(), QuantLogitScreen)
    hf = _transformers_model(model_dir, file)
    with torch.inference_mode():
        assert greedy(ours, PROMPTS[0], 8) == argmax_greedy(hf, PROMPTS[0], 8)


def test_unsupported_format_is_refused_by_name(model_dir: Path) -> None:
    from engine.model.loader import ModelLoadError

    bad = write_gguf(model_dir, "bad", lambda kind, layer: "TQ2_0" if (kind, layer) == ("ffn_up", 1) else "Q8_0")
    with pytest.raises(ModelLoadError, match=r"'blk\.1\.ffn_up\.weight' is TQ2_0, which pagedserve does not read"):
        load_model(bad)



def _engine_greedy(file: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    from common.sampling_params import SamplingParams
    from engine.llm import LLM

    engine = LLM(str(file), kv_cache_memory=1 << 24, dtype="float32").engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    engine.close()
    return [tokens[str(i)] for i in range(len(prompts))]


def test_engine_greedy_equals_transformers_on_dequantized_formats(model_dir: Path, no_kernel: str) -> None:
    """All weights dequantized at load (fp32 everywhere): the engine's greedy tokens (a batch of
    three) are transformers' on the same file."""
    fmt = no_kernel
    file = write_gguf(model_dir, f"greedy-{fmt}", lambda kind, layer: fmt)
    hf = _transformers_model(model_dir, file)
    assert _engine_greedy(file, PROMPTS, 10) == [argmax_greedy(hf, p, 10) for p in PROMPTS]


@pytest.mark.parametrize("fmt", ["Q5_0", "Q5_1", "IQ4_NL", "MXFP4", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_packed_formats_run_packed(model_dir: Path, fmt: str) -> None:
    """Every tensor in one of the formats packed since issue 38 (the 5-bit legacy ones, IQ4_NL, MXFP4, the
    K-quants Q2_K / Q3_K / Q4_K / Q5_K / Q6_K, IQ4_XS): every linear one packed `QuantLinear` in that format
    (Q5: eight-row layouts), the embedding packed, the lm_head on its int8 screen, the fused decoder on, the
    weights exactly transformers' dequantized load. With fp32 activations greedy equals
    transformers'; with int8 activations (the default) the engine's first token of each prompt
    (prompt rows keep fp32 activations) is transformers', and a batch of three decodes token for
    token as each prompt alone."""
    from structlog.testing import capture_logs

    from benchmarks.quality.quant_quality import greedy, set_int8_activations

    file = write_gguf(model_dir, f"packed-{fmt}", lambda kind, layer: fmt)
    with capture_logs() as logs:
        ours = load_model(file)
    hf = _transformers_model(model_dir, file)
    _assert_weights_equal(ours, hf)
    linears = [m for m in ours.modules() if isinstance(m, (nn.Linear, QuantLinear))]
    stored = ops.quant.FORMATS[fmt]  # decoder linears in the eight-row layout where it has one, the lm_head not
    assert all(isinstance(m, QuantLinear) and m.formats == [stored if m is ours.lm_head else
                                                            ops.quant.INTERLEAVED.get(stored, stored)] for m in linears)
    assert isinstance(ours.model.embed_tokens, QuantEmbedding)
    assert isinstance(ours.logit_screen(), QuantLogitScreen)
    # the fused decoder, except where AMX runs and the format has no AMX panels (its bf16 steps)
    assert (ours.fused_decoder() is not None) == (fmt in ops.quant.BF16_FORMATS or not ops.quant.amx_bf16())
    [line] = [e for e in logs if e["event"] == "GGUF tensor formats"]
    assert f"{fmt}: 16 tensors, packed (quantized kernels)" in line["formats"]
    expected = [argmax_greedy(hf, p, 10) for p in PROMPTS]
    set_int8_activations(ours, False)
    with torch.inference_mode():
        assert [greedy(ours, p, 10) for p in PROMPTS] == expected
    together = _engine_greedy(file, PROMPTS, 10)
    assert [t[0] for t in together] == [e[0] for e in expected]
    assert together == [_engine_greedy(file, [p], 10)[0] for p in PROMPTS]


@pytest.mark.skipif(ops.quant.bf16_kernel() is None, reason="no bf16 kernel (AMX-BF16 or AVX512-BF16) here")
@pytest.mark.parametrize("fmt", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_k_quant_bf16_linears_run_on_the_panels(model_dir: Path, fmt: str) -> None:
    """With bf16 linears (`dtype bfloat16`) a 40-token prompt runs the 256-weight formats' layers on the
    bf16 kernel's panels: the same bits with the fused decoder on (which takes these formats on AMX
    now) and off, the reference backend's logits (torch: the same bf16 roundings, other summation
    order, so a few activations round to the neighbouring bf16 in later layers) within 2% of the largest
    logit (measured 0.2-0.8%), and not the fp32-activation logits (bf16 did run)."""
    from benchmarks.quality.quant_quality import Paged, set_int8_activations
    from engine.model.execution_policy import ExecutionPolicy

    file = write_gguf(model_dir, f"bf16-{fmt}", lambda kind, layer: fmt)
    prompt = list(range(3, 43))
    fused = load_model(file, policy=ExecutionPolicy(bf16_linears=True))
    modules = load_model(file, policy=ExecutionPolicy(bf16_linears=True, fused_decoder=False))
    fp32 = load_model(file)
    set_int8_activations(fp32, False)
    assert (fused.fused_decoder() is not None) and modules.fused_decoder() is None
    with torch.inference_mode():
        got, alone, exact = (Paged(m, len(prompt)).run(prompt) for m in (fused, modules, fp32))
        oracle = load_model(file, policy=ExecutionPolicy(bf16_linears=True, fused_decoder=False, ops=ops.REFERENCE))
        reference = Paged(oracle, len(prompt)).run(prompt)
    assert torch.equal(got, alone)
    assert not torch.equal(got, exact)
    torch.testing.assert_close(got, reference, rtol=0, atol=2e-2 * reference.abs().max().item())


def test_mix_greedy_equals_transformers_with_fp32_activations(model_dir: Path) -> None:
    """The mix with its packed layers on fp32 activations (int8 activations round a decode row's
    inputs: not transformers' arithmetic): the paged model's greedy tokens are transformers'."""
    from benchmarks.quality.quant_quality import greedy, set_int8_activations

    file = write_gguf(model_dir, "mix-greedy", _mix)
    ours = load_model(file)
    set_int8_activations(ours, False)
    hf = _transformers_model(model_dir, file)
    with torch.inference_mode():
        for prompt in PROMPTS:
            assert greedy(ours, prompt, 10) == argmax_greedy(hf, prompt, 10)


def test_read_tensor_copies_out_of_the_memory_map(model_dir: Path, no_kernel: str) -> None:
    """Packed, dequantized and float tensors own their memory (the reader's arrays are read-only
    views of the mapped file)."""
    from engine.model.gguf_weights import read_tensor

    file = write_gguf(model_dir, "copies", _mix)
    tensors = {t.name: t for t in gguf.GGUFReader(str(file)).tensors}
    for name in ("blk.1.attn_q.weight", "blk.0.attn_q.weight", "output_norm.weight"):  # Q4_1, Q2_K, F32
        assert read_tensor(tensors[name]).data.numpy().flags.writeable, name


def test_requantize_serves_every_format_packed(model_dir: Path, no_kernel: str) -> None:
    """`quantization="requantize"` (`--quantization requantize`): the mix's tensors without a
    kernel become Q8_0 blocks of their dequantized weights (exactly `ref.quantize` of transformers'
    load), every linear is packed, the log says so; with fp32 activations greedy equals
    transformers holding the requantized weights. A packed format
    (Q5_0) stays as stored, so a module mixes it with requantized shards, which the fused decoder
    runs shard by shard."""
    from structlog.testing import capture_logs

    from benchmarks.quality.quant_quality import greedy, set_int8_activations
    from ops.reference import quant as ref

    file = write_gguf(model_dir, "mix-requantized", _mix)
    with capture_logs() as logs:
        ours = load_model(file, quantization="requantize")
    hf = _transformers_model(model_dir, file)
    state = hf.state_dict()
    requantized = [f"model.layers.0.{_HF[kind]}.weight" for kind, fmt in MIX.items()
                   if formats.by_name(fmt).runs == formats.DEQUANTIZED]
    for name in [*requantized, "model.embed_tokens.weight"]:
        state[name] = ref.dequantize(ref.quantize(state[name], ref.Q8_0), ref.Q8_0)
    hf.load_state_dict(state)
    _assert_weights_equal(ours, hf)
    linears = [m for m in ours.modules() if isinstance(m, (nn.Linear, QuantLinear))]
    assert all(isinstance(m, QuantLinear) and None not in m.formats for m in linears)
    assert isinstance(ours.model.embed_tokens, QuantEmbedding)
    # layer 0's qkv holds Q5_0 (packed as stored) beside requantized Q8_0 shards: fused, shard by shard
    assert ours.model.layers[0].self_attn.qkv_proj.formats == [ops.quant.Q8_0R8, ops.quant.Q5_0R8, ops.quant.Q8_0R8]
    assert ours.fused_decoder() is not None
    [line] = [e for e in logs if e["event"] == "GGUF tensor formats"]
    assert "Q5_0: 1 tensors, packed (quantized kernels)" in line["formats"]
    assert "Q2_K: 4 tensors, requantized at load to Q8_0 (quantized kernels)" in line["formats"]
    set_int8_activations(ours, False)
    with torch.inference_mode():
        for prompt in PROMPTS:
            assert greedy(ours, prompt, 10) == argmax_greedy(hf, prompt, 10)


def _smollm2_q4_k_m(kind: str, layer: int) -> str:
    """llama.cpp's Q4_K_M choice per tensor of SmolLM2 (30 layers, hidden 576: not a multiple of
    256, so its K = 576 rows fall back to Q5_0 for Q4_K and Q8_0 for Q6_K); ffn_down (K = 1536)
    takes Q6_K in the layers llama.cpp gives more bits (first and last eighth, every third)."""
    more_bits = layer < 30 // 8 or layer >= 7 * 30 // 8 or (layer - 30 // 8) % 3 == 2
    if kind == "token_embd":
        return "Q8_0"
    if kind == "ffn_down":
        return "Q6_K" if more_bits else "Q4_K"
    return "Q8_0" if kind == "attn_v" and more_bits else "Q5_0"


def test_smollm2_q4_k_m_mix(tmp_path: Path) -> None:
    """The default model (when fetched) written as llama.cpp's Q4_K_M mix (the formats and counts of llama.cpp's
    own file: Q5_0 166, Q4_K 16, Q8_0 15, Q6_K 14) from its fp32 checkpoint: every format is packed
    (every linear a `QuantLinear`), its passage NLL is within 5% of the fp32 model's (our
    round-to-nearest K-quantizers), and within 0.5% of the same file dequantized to fp32 at load
    (what int8 activations cost)."""
    from structlog.testing import capture_logs
    from transformers import AutoTokenizer

    from benchmarks.quality.quant_quality import PASSAGE, mean_nll
    from engine.model.fetch import default_gguf_path

    if not default_gguf_path().is_file():
        pytest.skip("the default model is not fetched (run `pagedserve fetch-model`)")
    source = default_gguf_path().parent
    file = write_gguf(source, "q4_k_m", _smollm2_q4_k_m, out_dir=tmp_path)
    counts: dict[str, int] = {}
    for tensor in gguf.GGUFReader(str(file)).tensors:
        counts[tensor.tensor_type.name] = counts.get(tensor.tensor_type.name, 0) + 1
    assert counts == {"F32": 61, "Q5_0": 166, "Q4_K": 16, "Q8_0": 15, "Q6_K": 14}
    passage = AutoTokenizer.from_pretrained(str(source))(PASSAGE)["input_ids"]
    with capture_logs() as logs:
        mix = load_model(file)
    [line] = [e["formats"] for e in logs if e["event"] == "GGUF tensor formats"]
    for fmt, count in (("Q5_0", 166), ("Q4_K", 16), ("Q6_K", 14), ("Q8_0", 15)):  # Q8_0: the tied embedding, attn_v
        assert f"{fmt}: {count} tensors, packed (quantized kernels)" in line
    linears = [m for m in mix.modules() if isinstance(m, (nn.Linear, QuantLinear))]
    assert all(isinstance(m, QuantLinear) and None not in m.formats for m in linears)
    with torch.inference_mode():
        reference = mean_nll(load_model(source), passage)
        packed = mean_nll(mix, passage)
        dequantized = mean_nll(load_model(file, quantization="dequantize"), passage)
    assert abs(packed - reference) <= 0.05 * reference, (packed, reference)
    assert abs(packed - dequantized) <= 0.005 * dequantized, (packed, dequantized)


def test_read_tensor_float_types(tmp_path: Path) -> None:
    """F16 and BF16 tensors widen to their fp32 values through the table, F32 is copied."""
    from engine.model.gguf_weights import read_tensor

    weight = torch.randn(6, 64)
    writer = gguf.GGUFWriter(str(tmp_path / "floats.gguf"), "llama")
    writer.add_tensor("f32", weight.numpy(), raw_dtype=T.F32)
    writer.add_tensor("f16", weight.numpy().astype(np.float16), raw_dtype=T.F16)
    writer.add_tensor("bf16", gguf.quants.quantize(weight.numpy(), T.BF16), raw_dtype=T.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensors = {t.name: read_tensor(t) for t in gguf.GGUFReader(str(tmp_path / "floats.gguf")).tensors}
    assert all(t.fmt is None and t.data.shape == (6, 64) for t in tensors.values())
    assert torch.equal(tensors["f32"].data, weight)
    assert torch.equal(tensors["f16"].data, weight.half().float())
    assert torch.equal(tensors["bf16"].data, weight.bfloat16().float())
    assert [t.source for t in tensors.values()] == ["F32", "F16", "BF16"]
