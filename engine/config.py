"""Engine configuration: one validated dataclass; the parts get plain values from it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.log import get_logger
from engine.spec.config import SpeculativeConfig

log = get_logger("config")

PREEMPTION_MODES = ("auto", "swap", "recompute")
# Tokens per step when max_num_batched_tokens is not given. On the CPU a burst's first tokens come
# in waves one step apart, so a smaller budget shortens the wave; 1,024 keeps throughput
# (benchmarks/peer/peer_bench.py --only served, docs/performance.md). CUDA keeps vLLM's online default.
DEFAULT_TOKEN_BUDGET = {"cpu": 1024, "cuda": 2048}
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8")  # engine/model/spec.py sizes each
RUNNERS = ("auto", "generate", "pooling")  # vLLM's --runner: auto reads the model folder (engine.model.pooling_config)
QUANTIZATIONS = ("auto", "requantize", "dequantize")  # a .gguf's tensors: in their own formats (those
# without a kernel in fp32), those as Q8_0, or everything converted to dtype


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs to start. Sizes are bytes."""

    model: str
    tokenizer: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # auto: the model dtype; int8: quantized rows (nearly twice the tokens of bf16)
    quantization: str = "auto"  # a .gguf model: auto keeps its quantized tensors (fp32 activations, CPU)
    block_size: int = 16
    kv_cache_memory: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    swap_space: int = 1 << 30
    num_gpu_blocks: int | None = None
    num_cpu_blocks: int | None = None
    preemption_mode: str = "auto"
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: DEFAULT_TOKEN_BUDGET of the device
    max_model_len: int | None = None
    attention_backend: str = "auto"
    watermark: float = 0.01
    debug_blocks: bool = False
    logit_screen: bool = True  # greedy tokens through a bf16 screen of the lm_head where the CPU has one
    # Quantized weights: prompt rows on fp32 activations (exact prompt logits and first token); False:
    # int8 activations like decode rows, faster prefill on the eight-row Q4 layouts
    exact_prompt_rows: bool = True
    # Batch-invariant CPU arithmetic (OpsPolicy.fixed_order in the engine's policy): every fp32 linear row through one
    # reduction order and prefill attention with decode's per-row arithmetic, so a request's tokens
    # and logprobs do not depend on its step (batch, chunking, recompute). False: fastest kernel per size.
    deterministic: bool = True
    # vLLM's form, e.g. {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}; parsed here
    speculative_config: SpeculativeConfig | dict[str, Any] | None = None
    # Tensor parallelism (`engine.parallel`): N ranks on one machine, each with its share of the heads.
    # kv_cache_memory / gpu_memory_utilization are per rank; the group's KV capacity is the minimum over ranks.
    tensor_parallel_size: int = 1
    tensor_parallel_timeout: float = 30.0  # seconds a collective waits for a peer before the group fails
    tensor_parallel_threads: int | None = None  # torch threads per rank; None: this process's threads / N
    master_addr: str = "127.0.0.1"  # where ranks meet (rank 0's TCP store)
    master_port: int | None = None  # None: a free port
    # Seconds a request's grammar (structured output) may take to compile, off the engine thread,
    # before the request is refused with a 400; the compile itself runs on (it cannot be interrupted)
    grammar_compile_timeout: float = 10.0
    # LoRA adapters (vLLM's flags): `lora_modules` name -> PEFT folder, served from start-up; at most
    # `max_loras` distinct adapters in one step (the model's slots), `max_cpu_loras` kept read in host
    # memory (None: max_loras), ranks up to `max_lora_rank`
    enable_lora: bool = False
    lora_modules: dict[str, str] | None = None
    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    # "pooling": serve embeddings (/v1/embeddings) from the final hidden states instead of generating;
    # "auto": pooling for an embedding model's folder (engine.model.pooling_config), else generate
    runner: str = "auto"
    pooling_type: str | None = None  # LAST | MEAN | CLS; None: the folder's sentence-transformers config, else LAST

    @property
    def serves_quantized_weights(self) -> bool:
        """A .gguf file whose quantized tensors are read as they are (`quantization="auto"`)."""
        return self.model.endswith(".gguf") and self.quantization in ("auto", "requantize")

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32):
            raise ValueError(f"block_size must be 8, 16 or 32, got {self.block_size}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        if self.attention_backend not in ("auto", "reference"):
            raise ValueError("attention_backend must be 'auto' or 'reference'")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu_memory_utilization must be in (0, 1]")
        if self.max_num_seqs < 1 or (self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1):
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.kv_cache_memory < 1 or self.swap_space < 0:
            raise ValueError("kv_cache_memory must be > 0 and swap_space >= 0")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.block_size:
            raise ValueError("max_num_batched_tokens must be at least one block")
        if self.tensor_parallel_size < 1 or self.tensor_parallel_timeout <= 0:
            raise ValueError("tensor_parallel_size must be >= 1 and tensor_parallel_timeout > 0")
        if self.tensor_parallel_threads is not None and self.tensor_parallel_threads < 1:
            raise ValueError("tensor_parallel_threads must be >= 1")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {RUNNERS}, got {self.runner!r}")
        if self.pooling_type is not None and self.pooling_type not in ("LAST", "MEAN", "CLS"):
            raise ValueError(f"pooling_type must be LAST, MEAN or CLS, got {self.pooling_type!r}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError("grammar_compile_timeout must be > 0 seconds")
        self._check_lora()
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        elif self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            raise ValueError("speculative_config must be a dict or a SpeculativeConfig")

    def _check_lora(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    def speculative(self) -> SpeculativeConfig | None:
        """The parsed speculative-decoding settings, None when off."""
        return self.speculative_config if isinstance(self.speculative_config, SpeculativeConfig) else None

    def resolve_max_model_len(self, max_position_embeddings: int, exact: tuple[int, str] | None) -> int:
        """The served context: `max_model_len` if given, else the model's `max_position_embeddings`
        (never past it). `exact` is `ModelSpec.exact_context()`: the longest context the engine
        serves exactly and why (a sliding window: the paged kernels attend to every cached token,
        which equals windowed attention while each sequence fits in the window, as a query at
        position p attends positions > p - window). Without a `max_model_len` the context is
        clamped to it (logged); a longer `max_model_len` is refused with ValueError."""
        length = min(self.max_model_len or max_position_embeddings, max_position_embeddings)
        if exact is None or exact[0] >= length:
            return length
        limit, reason = exact
        if self.max_model_len is not None:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds {reason}, the longest context served "
                             f"exactly here: pass max_model_len <= {limit} (or leave it unset)")
        log.info(f"max_model_len clamped to {reason}: attention is exact while every sequence fits",
                 max_model_len=limit, max_position_embeddings=max_position_embeddings)
        return limit

    def token_budget(self, device_type: str) -> int:
        """Tokens one step may run: the configured budget, else the device's default."""
        return self.max_num_batched_tokens or DEFAULT_TOKEN_BUDGET.get(device_type, DEFAULT_TOKEN_BUDGET["cuda"])
