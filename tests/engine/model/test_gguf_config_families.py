"""GGUF files of the families transformers' GGUF loader does not read (OLMo 2, Granite, SmolLM3),
written here from a seeded random transformers checkpoint of each as llama.cpp's converter lays
them out: its tensor names (OLMo 2's post-attention / post-FFN norms and projection-wide q/k norms),
its metadata keys (Granite's four `*_scale` keys; SmolLM3's NoPE layers fixed at every 4th), and
its Q/K row permutation for the Llama-derived Granite and SmolLM3, not OLMo 2. Loaded back through
the config built from that metadata (engine/model/gguf_config.py): the spec is the checkpoint's;
the F32 file's engine greedy equals HF generate on the original model; the packed files (Q8_0,
and a Q4_K / Q6_K mix) hold exactly the dequantized weights, and with fp32 activations give
transformers' logits on those weights. The tokenizer and chat template come from the file's
metadata; files with options the config cannot carry are refused by name."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from common.sampling_params import SamplingParams
from engine.llm import LLM
from engine.model import ModelSpec, load_model
from engine.model.loader import ModelLoadError, load_hf_config, tokenizer_dir
from engine.model.quant_linear import QuantLinear
from ops.reference import formats
from tests.engine.helpers import assert_no_leaks, generated, hf_greedy
from tests.engine.model.gguf_writing import add_decoder_shape, assert_fp32_activation_logits_match
from tests.engine.model.test_gguf_formats import _encode, _llama_cpp_permute, _weight
from tests.engine.model.test_sliding_window import make_family_dir, prompt_ids
from tests.fixtures.models import SPECIAL_TOKENS, _byte_tokenizer

gguf = pytest.importorskip("gguf")

# hidden 256 and intermediate 512: K-quant rows are 256-weight blocks
SIZES: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 512}
FAMILIES: dict[str, dict[str, Any]] = {
    "olmo2": {},
    # biases on q/k/v/o: the Q/K permutation moves the bias rows too
    "granite": {"embedding_multiplier": 4.0, "attention_multiplier": 0.11, "residual_multiplier": 0.35,
                "logits_scaling": 2.5, "attention_bias": True},
    # layer 3 is the NoPE layer (transformers' default no_rope_layer_interval 4, llama.cpp's fixed step)
    # tied (SmolLM3 ties its lm_head): no output.weight in the file
    "smollm3": {"num_hidden_layers": 4, "tie_word_embeddings": True},
}
PERMUTED = ("granite", "smollm3")  # llama.cpp's LlamaModel subclasses
MIXES: dict[str, Callable[[str], str]] = {
    "Q8_0": lambda kind: "Q8_0",
    # a Q4_K_M-like mix: Q6_K for the tensors llama.cpp gives more bits, Q4_K elsewhere
    "Q4_K+Q6_K": lambda kind: "Q6_K" if kind in ("attn_v", "ffn_down", "output") else "Q4_K",
}
NEW_TOKENS = 10


def write_llama_cpp_gguf(model_dir: Path, arch: str, fmt_of: Callable[[str], str], out_dir: Path | None = None,
                         name: str | None = None, tokenizer: bool = False,
                         extra: Callable[[Any], None] | None = None) -> Path:
    """`model_dir`'s checkpoint as llama.cpp's converter writes an `arch` GGUF: its tensor names, 2-D
    weights in `fmt_of(gguf kind)` (norms and biases F32), Q/K rows (and biases) permuted for the
    Llama-derived archs, Granite's scales; `tokenizer`: the byte tokenizer and chat template as metadata;
    `extra(writer)`: more keys or tensors."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    hf = load_file(str(model_dir / "model.safetensors"))
    arch_id = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    path = (out_dir or model_dir) / f"{name or arch}.gguf"
    writer = gguf.GGUFWriter(str(path), arch)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    add_decoder_shape(writer, config)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_rope_dimension_count(config.hidden_size // heads)
    writer.add_vocab_size(config.vocab_size)
    if arch == "granite":
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    if tokenizer:
        _add_tokenizer(writer)
    if extra is not None:
        extra(writer)
    for hf_name, weight in hf.items():
        base, _, suffix = hf_name.rpartition(".")
        gguf_base = names.get_name(base)
        assert gguf_base is not None, hf_name
        kind = gguf_base.rpartition(".")[2] if gguf_base.startswith("blk.") else gguf_base
        if arch in PERMUTED and kind in ("attn_q", "attn_k"):
            weight = _llama_cpp_permute(weight, heads if kind == "attn_q" else kv_heads)
        fmt = "F32" if weight.dim() == 1 or "norm" in kind else fmt_of(kind)
        data, qtype = _encode(weight.float().contiguous(), fmt)
        writer.add_tensor(f"{gguf_base}.{suffix}", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def merged_tokenizer() -> Any:
    """The byte-level test tokenizer (ids 0-259) with three merges after it ("he", "ll", " w": ids
    260-262): llama.cpp's `gpt2` vocabularies always carry merges, and a file without any is read
    as one whose merges must be derived from scores."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    byte = _byte_tokenizer()
    vocab = dict(byte.get_vocab()) | {"he": 260, "ll": 261, "Ġw": 262}
    inner = Tokenizer(models.BPE(vocab=vocab, merges=[("h", "e"), ("l", "l"), ("Ġ", "w")]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    inner.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=inner, bos_token=byte.bos_token, eos_token=byte.eos_token,
                                  pad_token=byte.pad_token, additional_special_tokens=SPECIAL_TOKENS[2:])
    tok.chat_template = byte.chat_template
    return tok


def _add_tokenizer(writer: Any) -> None:
    """`merged_tokenizer` as llama.cpp's `gpt2` tokenizer metadata."""
    tok = merged_tokenizer()
    vocab = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    special = set(tok.all_special_tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if token in special else gguf.TokenType.NORMAL
                            for token, _ in vocab])
    writer.add_token_merges(["h e", "l l", "Ġ w"])
    writer.add_chat_template(tok.chat_template)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    arch = request.param
    return arch, make_family_dir(tmp_path_factory.mktemp(arch), arch, seed=5, **SIZES, **FAMILIES[arch])


def _hf_model(directory: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()


def _dequantized_hf(directory: Path, fmt_of: Callable[[str], str], arch: str) -> nn.Module:
    """The checkpoint's HF model with every weight the file stores packed replaced by its dequantized
    blocks (quantized in HF row order: a row permutation moves whole rows, so the values agree)."""
    hf = _hf_model(directory)
    arch_id = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)
    names = gguf.get_tensor_name_map(arch_id, hf.config.num_hidden_layers)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if param.dim() != 2:
                continue
            gguf_base = names.get_name(name.rpartition(".")[0])
            assert gguf_base is not None, name
            fmt = formats.by_name(fmt_of(gguf_base.rpartition(".")[2] if gguf_base.startswith("blk.") else gguf_base))
            data, _ = _encode(param.float().contiguous(), fmt.name)
            packed = torch.from_numpy(data).reshape(param.shape[0], -1)
            param.copy_(fmt.dequantize(packed).reshape(param.shape))
    return hf


def _assert_holds(ours: nn.Module, state: dict[str, torch.Tensor], packed: bool) -> None:
    """`ours` holds exactly the HF `state`: every linear (stacked q/k/v, gate/up), the embedding and
    lm_head, norms and biases; each linear a `QuantLinear` when `packed`, else the model's fp32 Linear."""
    params = dict(ours.named_parameters())
    norms = [name for name in state if name.endswith("norm.weight")]
    assert norms and all(torch.equal(params[name], state[name]) for name in norms)
    for i, layer in enumerate(ours.model.layers):
        prefix = f"model.layers.{i}."
        for path, parts in (("self_attn.qkv_proj", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                            ("mlp.gate_up_proj", ("mlp.gate_proj", "mlp.up_proj")),
                            ("self_attn.o_proj", ("self_attn.o_proj",)), ("mlp.down_proj", ("mlp.down_proj",))):
            module = layer.get_submodule(path)
            assert isinstance(module, QuantLinear) == packed, (i, path)
            expected = torch.cat([state[f"{prefix}{part}.weight"] for part in parts])
            assert torch.equal(_weight(module), expected), (i, path)
            if module.bias is not None:
                bias = torch.cat([state[f"{prefix}{part}.bias"] for part in parts])
                assert torch.equal(module.bias, bias), (i, path)
    assert torch.equal(_weight(ours.model.embed_tokens), state["model.embed_tokens.weight"])
    assert torch.equal(_weight(ours.lm_head), state["lm_head.weight"])


def test_dequantized_load_holds_the_same_weights(family: tuple[str, Path]) -> None:
    """quantization="dequantize": the file's tensors in fp32 under their HF names, Q/K un-permuted."""
    arch, directory = family
    fmt_of = MIXES["Q4_K+Q6_K"]
    file = write_llama_cpp_gguf(directory, arch, fmt_of, name=f"{arch}-dequantize")
    _assert_holds(load_model(file, quantization="dequantize"), _dequantized_hf(directory, fmt_of, arch).state_dict(),
                  packed=False)


def test_config_from_metadata_gives_the_checkpoints_spec(family: tuple[str, Path]) -> None:
    from transformers import AutoConfig

    arch, directory = family
    file = write_llama_cpp_gguf(directory, arch, lambda kind: "F32")
    config = load_hf_config(file)
    assert type(config) is type(AutoConfig.from_pretrained(str(directory)))
    assert ModelSpec.from_hf_config(config) == ModelSpec.from_hf_config(AutoConfig.from_pretrained(str(directory)))


def test_f32_greedy_equals_transformers(family: tuple[str, Path]) -> None:
    arch, directory = family
    file = write_llama_cpp_gguf(directory, arch, lambda kind: "F32")
    prompts = [prompt_ids(n, seed) for seed, n in enumerate((7, 19, 12))]
    expected = hf_greedy(directory, prompts, NEW_TOKENS)
    llm = LLM(str(file), dtype="float32", kv_cache_memory=16 << 20, block_size=8, max_num_batched_tokens=16)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    assert generated(llm.generate(prompts, params)) == expected
    assert_no_leaks(llm)


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_packed_weights_give_transformers_logits_on_their_dequantized_values(family: tuple[str, Path],
                                                                             mix: str) -> None:
    """Every linear packed (`QuantLinear`), its weights exactly the dequantized blocks in HF row order;
    with fp32 activations the prefill and decode logits are transformers' on those weights."""
    arch, directory = family
    fmt_of = MIXES[mix]
    file = write_llama_cpp_gguf(directory, arch, fmt_of, name=f"{arch}-{mix}")
    ours = load_model(file)
    hf = _dequantized_hf(directory, fmt_of, arch)
    _assert_holds(ours, hf.state_dict(), packed=True)
    assert_fp32_activation_logits_match(ours, hf)


def _metadata_gguf(path: Path, arch: str, extra: Callable[[Any], None] = lambda writer: None,
                   tensors: tuple[str, ...] = ()) -> Path:
    """A GGUF of `arch` with the shape keys of a 2-layer model, `extra(writer)` on top, and 1-D F32
    placeholders named `tensors` (the config reads metadata and tensor names only)."""
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(320)
    extra(writer)
    for name in tensors or ("token_embd.weight",):
        writer.add_tensor(name, np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _granite_scales(writer: Any, skip: str = "") -> None:
    for key, add in (("embedding_scale", writer.add_embedding_scale), ("residual_scale", writer.add_residual_scale),
                     ("attention.scale", writer.add_attention_scale), ("logit_scale", writer.add_logit_scale)):
        if key != skip:
            add(1.0)


@pytest.mark.parametrize(("arch", "extra", "tensors", "message"), [
    # an architecture neither transformers' GGUF loader nor gguf_config maps: refused by name
    ("olmoe", lambda w: None, (), "GGUF model with architecture olmoe is not supported"),
    # gpt-oss (test_gguf_gpt_oss.py): its window is required, yarn factors pagedserve does not read refused
    ("gpt-oss", lambda w: (w.add_expert_count(4), w.add_expert_used_count(2)), (),
     "a gpt-oss GGUF needs the metadata key 'gpt-oss.attention.sliding_window'"),
    ("gpt-oss", lambda w: (w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
                           w.add_rope_scaling_yarn_attn_factor(2.0)),
     (), "a gpt-oss GGUF with rope.scaling.yarn_attn_factor is not supported"),
    ("granite", lambda w: _granite_scales(w, skip="logit_scale"), (),
     "a granite GGUF needs the metadata key 'granite.logit_scale'"),
    # rope: engine.model.gguf_rope maps none / linear / yarn and rope_freqs (test_gguf_rope_scaling.py)
    ("olmo2", lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE), (),
     "a olmo2 GGUF with rope scaling 'longrope' is not supported"),
    ("olmo2", lambda w: w.add_sliding_window(16), (), r"attention.sliding_window \(OLMo 3\) is not supported"),
    ("smollm3", lambda w: None, ("token_embd.weight", "rope_freqs.weight"),
     "a smollm3 GGUF whose rope_freqs.weight has 4 entries"),
    ("smollm3", lambda w: w.add_rope_dimension_count(12), (), "12 rotary dims is not supported"),
    ("smollm3", lambda w: (w.add_key_length(32), w.add_value_length(16)), (),
     "key length 32, value length 16 and 32 rotary dims"),
])
def test_files_the_config_cannot_carry_are_refused(tmp_path: Path, arch: str, extra: Callable[[Any], None],
                                                   tensors: tuple[str, ...], message: str) -> None:
    file = _metadata_gguf(tmp_path / f"{arch}.gguf", arch, extra, tensors)
    with pytest.raises(ModelLoadError, match=message):
        load_model(file)


def test_granite_with_every_scale_reads(tmp_path: Path) -> None:
    """The refusals above are the options' doing: the same file with the four scales is read."""
    config = load_hf_config(_metadata_gguf(tmp_path / "granite.gguf", "granite", _granite_scales))
    assert (config.model_type, config.num_hidden_layers, config.attention_multiplier) == ("granite", 2, 1.0)


def test_tokenizer_and_chat_template_come_from_the_metadata(family: tuple[str, Path], tmp_path: Path) -> None:
    """A file with no tokenizer beside it: its metadata, exported once, tokenizes like the tokenizer
    it was written from and carries its chat template and special tokens; the engine chats with it."""
    from transformers import AutoTokenizer

    arch, directory = family
    file = write_llama_cpp_gguf(directory, arch, lambda kind: "Q8_0", out_dir=tmp_path, tokenizer=True)
    exported = tokenizer_dir(file)  # PAGEDSERVE_CACHE's tokenizers/ (not redirected: kernels are built there)
    assert Path(exported).parent.name == "tokenizers"
    ours, theirs = AutoTokenizer.from_pretrained(exported), merged_tokenizer()
    text = "hello, wörld! Well 12 + 30 = 42\n"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert {260, 261, 262} <= set(theirs(text)["input_ids"])  # the merges apply
    assert (ours.eos_token, ours.bos_token, ours.chat_template) == (theirs.eos_token, theirs.bos_token,
                                                                   theirs.chat_template)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages, tokenize=False) == theirs.apply_chat_template(messages, tokenize=False)
    llm = LLM(str(file), dtype="float32", kv_cache_memory=16 << 20, block_size=8)
    assert llm.engine.tokenizer_dir == exported
    [out] = llm.chat([messages], SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6))
    prompt = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert out.prompt_token_ids == list(prompt)
    assert out.outputs[0].text == theirs.decode(out.outputs[0].token_ids, skip_special_tokens=True)


def test_architecture_is_read_from_the_header_or_the_whole_metadata(tmp_path: Path) -> None:
    """`general.architecture` first (as llama.cpp writes it): read from the header alone; elsewhere:
    found by the full reader; not a GGUF: None (transformers' load then names the problem)."""
    from engine.model.gguf_config import _first_key_architecture, gguf_architecture

    first = _metadata_gguf(tmp_path / "first.gguf", "smollm3")
    assert _first_key_architecture(first.read_bytes()[:4096]) == "smollm3" == gguf_architecture(first)

    def name_first(writer: Any) -> None:
        writer.add_name("tiny")
        kv = writer.kv_data[0]
        writer.kv_data[0] = {"general.name": kv.pop("general.name"), **kv}

    later = _metadata_gguf(tmp_path / "later.gguf", "olmo2", name_first)
    assert _first_key_architecture(later.read_bytes()[:4096]) is None
    assert gguf_architecture(later) == "olmo2"
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    assert gguf_architecture(tmp_path / "junk.gguf") is None
