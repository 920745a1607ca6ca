"""The decoder layers in one C++ call (`FusedDecoder`) against the module path: bit for bit the
same hidden states over prefill chunks, decode rows and mixed steps, for every quantized layout,
an int8 KV cache and LoRA adapter rows beside base rows; and it stays out of the way where it does
not apply."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import ops
from engine.model import allocate_kv_caches
from engine.model.execution_policy import ExecutionPolicy
from engine.model.fused_decoder import FusedDecoder
from engine.model.llama import LlamaForCausalLM
from engine.model.loader import load_model
from engine.model.lora.manager import LoRAManager
from engine.model.quant_linear import QuantLinear
from ops.quant import Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, QuantFormat, interleave
from ops.reference import quant as ref
from tests.fixtures.models import PagedHarness, Seq, mixed_schedule_logits

_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


def _quantized(model_dir: Path, formats: list[QuantFormat], repack: bool, bias: bool = False,
               policy: ExecutionPolicy | None = None, int8_activations: bool = True,
               v_format: QuantFormat | None = None) -> LlamaForCausalLM:
    """The tiny model under `policy` with every decoder linear a one-shard `QuantLinear` (formats
    cycled; Q4 ones in the eight-row layout with `repack`), with random fp32 biases when `bias`;
    with `v_format`, each qkv_proj's V rows are a second shard in that format (llama.cpp's Q4_K_M
    mix: a layer's V in another format than its Q and K)."""
    model = load_model(model_dir, policy=policy)
    gen = torch.Generator().manual_seed(1)
    i = 0
    for layer in model.model.layers:
        for path in _LINEARS:
            linear = layer.get_submodule(path)
            assert isinstance(linear, nn.Linear)
            fmt = formats[i % len(formats)]
            i += 1
            weight = linear.weight.detach()
            v_rows = layer.self_attn.num_kv_heads * layer.self_attn.head_dim
            cuts = [weight[:-v_rows], weight[-v_rows:]] if v_format and path.endswith("qkv_proj") else [weight]
            shards = []
            for part, part_fmt in zip(cuts, [fmt, v_format], strict=False):
                assert part_fmt is not None
                packed = ref.quantize(part, part_fmt.type_id)
                if repack:
                    packed, part_fmt = interleave(packed, part_fmt)
                shards.append((part_fmt, packed))
            b = torch.randn(linear.out_features, generator=gen) if bias else None
            parent, _, name = path.rpartition(".")
            setattr(layer.get_submodule(parent), name, QuantLinear(linear.in_features, shards, b, int8_activations))
    return model


def _policy(fused: bool, exact_prompt_rows: bool = True) -> ExecutionPolicy:
    return ExecutionPolicy(fused_decoder=fused, exact_prompt_rows=exact_prompt_rows)


_run = mixed_schedule_logits


@pytest.mark.parametrize("formats,repack,bias,v_format", [
    ([Q4_1], True, False, None), ([Q4_0, Q4_1, Q8_0], True, True, None), ([Q4_1, Q8_0], False, False, None),
    ([Q5_0, Q5_1], False, True, None), ([Q5_0], False, True, Q8_0), ([Q5_0, Q4_1], False, False, Q8_0),
], ids=["q4_1-r8", "mixed-r8-bias", "q4_1-q8_0", "q5-bias", "v-shard-bias", "v-shard"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
@pytest.mark.parametrize("exact_prompt_rows", [True, False])
def test_fused_layers_equal_the_modules_bit_for_bit(tiny_llama_dir: Path, formats: list[QuantFormat],
                                                    repack: bool, bias: bool, v_format: QuantFormat | None,
                                                    kv_dtype: torch.dtype, exact_prompt_rows: bool) -> None:
    model = _quantized(tiny_llama_dir, formats, repack, bias, _policy(True, exact_prompt_rows), v_format=v_format)
    assert model.fused_decoder() is not None
    fused = _run(model, kv_dtype)
    unfused = _quantized(tiny_llama_dir, formats, repack, bias, _policy(False, exact_prompt_rows), v_format=v_format)
    assert unfused.fused_decoder() is None
    modules = _run(unfused, kv_dtype)
    for step, (x, y) in enumerate(zip(fused, modules, strict=True)):
        assert torch.equal(x, y), f"step {step}: max difference {(x - y).abs().max().item()}"


def test_fused_path_runs_only_where_it_applies(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _quantized(tiny_llama_dir, [Q4_1], True)
    calls: list[int] = []
    original = FusedDecoder.__call__

    def counting(self: FusedDecoder, *args: object) -> object:
        calls.append(1)
        return original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(FusedDecoder, "__call__", counting)
    harness = PagedHarness(model, num_blocks=64, block_size=4)
    seq = Seq(list(range(25)))
    harness.step([(seq, 20)], [])
    assert len(calls) == 1
    harness.model = _quantized(tiny_llama_dir, [Q4_1], True, policy=ExecutionPolicy(ops=ops.REFERENCE))  # same weights
    harness.step([], [seq])
    assert len(calls) == 1  # the reference backend runs the modules (the oracle of every op)
    off = PagedHarness(_quantized(tiny_llama_dir, [Q4_1], True, policy=_policy(False)), num_blocks=64, block_size=4)
    other = Seq(list(range(25)))
    off.step([(other, 20)], [])
    off.step([], [other])
    assert len(calls) == 1  # the policy turns the fused decoder off


def test_fused_decoder_needs_packed_shards(tiny_llama_dir: Path) -> None:
    assert FusedDecoder.for_layers(list(load_model(tiny_llama_dir).model.layers), 1) is None  # fp32 linears
    model = _quantized(tiny_llama_dir, [Q4_1], True)
    assert FusedDecoder.for_layers(list(model.model.layers), 1) is not None
    assert FusedDecoder.for_layers(list(model.model.layers), 2) is None  # tensor parallel: the modules
    qkv = model.model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear)
    weight = qkv.dequantized_weight()
    half = weight.shape[0] // 2
    model.model.layers[1].self_attn.qkv_proj = QuantLinear(
        weight.shape[1], [(Q4_1, ref.quantize(weight[:half], Q4_1.type_id)), (None, weight[half:])])
    assert FusedDecoder.for_layers(list(model.model.layers), 1) is None  # an fp32 shard: the module path


def test_prompt_rows_compute_what_fp32_activations_give(tiny_llama_dir: Path) -> None:
    """A step's prefill rows keep fp32 activations (`LinearRows.exact_rows`): a prompt's logits are bit
    for bit those of the same model with int8 activations off, on both paths; decode rows are not."""
    results = {}
    for int8 in (True, False):
        for fused in (True, False):
            model = _quantized(tiny_llama_dir, [Q4_1, Q8_0], True, policy=_policy(fused), int8_activations=int8)
            results[int8, fused] = _run(model, torch.float32)
    for fused in (True, False):
        prompt_steps = results[True, fused][:2]  # prefill chunks only
        assert all(torch.equal(a, b) for a, b in zip(prompt_steps, results[False, fused][:2], strict=True))
        assert not torch.equal(results[True, fused][-1], results[False, fused][-1])  # decode rows: int8


def test_int8_prompt_rows_round_the_prompt_like_decode_rows(tiny_llama_dir: Path) -> None:
    """`exact_prompt_rows = False` (`--int8-prompt-activations`): prompt rows take int8 activations
    too, on both paths (which agree bit for bit: the test above), so a prompt's logits differ from
    the fp32-activation ones; decode steps over the same cache differ only through it."""
    for fused in (True, False):
        exact = _run(_quantized(tiny_llama_dir, [Q4_1, Q8_0], True, policy=_policy(fused)), torch.float32)
        rounded = _run(_quantized(tiny_llama_dir, [Q4_1, Q8_0], True, policy=_policy(fused, False)), torch.float32)
        assert not torch.equal(exact[0], rounded[0])  # the first prefill chunk: rows rounded to int8
        assert (exact[0] - rounded[0]).abs().max() < 0.05 * exact[0].abs().max()  # ...by the int8 error only


def _with_adapters(model: LlamaForCausalLM, rank: int = 4) -> None:
    """Two random adapters of `rank` in the slots the engine's `LoRAManager` attaches to every
    target linear (slice by slice; the same values for every model built from one directory)."""
    manager = LoRAManager(model, max_loras=2, max_cpu_loras=2, max_rank=rank)
    gen = torch.Generator().manual_seed(7)
    for slots in manager.linears.values():
        for slot in range(2):
            for part, size in enumerate(slots.slice_sizes):
                slots.set(slot, part, torch.randn(rank, slots.in_features, generator=gen) * 0.1,
                          torch.randn(size, rank, generator=gen) * 0.1)


def _lora_schedule(model: LlamaForCausalLM, kv_dtype: torch.dtype) -> list[torch.Tensor]:
    """Logits of a fixed schedule with a sequence on each adapter slot and one on the base: prefill
    chunks beside decode rows, then decode steps of all three."""
    harness = PagedHarness(model, num_blocks=96, block_size=4, seed=3)
    if kv_dtype != torch.float32:
        harness.kv_caches = allocate_kv_caches(model, 96, 4, kv_dtype)
    gen = torch.Generator().manual_seed(5)
    a, b, base = (Seq(torch.randint(0, 320, (30,), generator=gen).tolist(), lora_slot=slot) for slot in (1, 0, -1))
    out = [harness.step([(a, 11), (base, 6)], []), harness.step([(b, 9)], [a]), harness.step([(base, 7)], [a, b])]
    out += [harness.step([], [a, b, base]) for _ in range(4)]
    out.append(harness.step([], [base]))  # base rows only: no LoRA lists
    return out


@pytest.mark.parametrize("formats,repack,bias,v_format", [
    ([Q4_1], True, False, None), ([Q5_0], False, True, Q8_0),
], ids=["q4_1-r8", "v-shard-bias"])
@pytest.mark.parametrize("kv_dtype,rank", [(torch.float32, 4), (torch.int8, 4), (torch.float32, 9)])
def test_fused_lora_rows_equal_the_modules_bit_for_bit(tiny_llama_dir: Path, formats: list[QuantFormat],
                                                       repack: bool, bias: bool, v_format: QuantFormat | None,
                                                       kv_dtype: torch.dtype, rank: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps with adapter rows take the C++ decoder, which adds each row's product where the modules
    do (after the linear's bias, slice by slice; one call over a linear's slices, whose stacked A
    rows it sums in blocks of eight across the slices' borders at ranks 4 and 9): the same bits for
    adapter and base rows."""
    calls: list[bool] = []
    original = FusedDecoder.__call__

    def recording(self: FusedDecoder, *args: object) -> object:
        calls.append(args[-1] is not None)  # the LoRA lists
        return original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(FusedDecoder, "__call__", recording)
    fused_model = _quantized(tiny_llama_dir, formats, repack, bias, _policy(True), v_format=v_format)
    _with_adapters(fused_model, rank)
    fused = _lora_schedule(fused_model, kv_dtype)
    assert calls == [True] * 7 + [False]
    module_model = _quantized(tiny_llama_dir, formats, repack, bias, _policy(False), v_format=v_format)
    _with_adapters(module_model, rank)
    modules = _lora_schedule(module_model, kv_dtype)
    plain = _quantized(tiny_llama_dir, formats, repack, bias, _policy(False), v_format=v_format)
    assert not torch.equal(_lora_schedule(plain, kv_dtype)[0], modules[0])  # the adapters change the logits
    for step, (x, y) in enumerate(zip(fused, modules, strict=True)):
        assert torch.equal(x, y), f"step {step}: max difference {(x - y).abs().max().item()}"
