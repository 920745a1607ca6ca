"""The synchronous engine: add_request / abort_request / step. No I/O; the worker and the
offline `LLM` drive it. One step = schedule → plan (`engine.sample.step_plan`) → move blocks + run the model →
sample and verify → update (the scheduler applies the samples to its sequences and builds the deltas)."""

from __future__ import annotations

import gc
import time
import weakref
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.log import get_logger
from common.openmp_env import openmp_spin_note
from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.kv.block_manager import BlockManager
from engine.kv.block_stats import block_tables, pool_snapshot
from engine.model.capacity import (
    engine_policy,
    kv_layers,
    log_capacity,
    log_kv_layers,
    num_device_blocks,
    num_host_blocks,
    profile_peak,
    release_window,
    resolve_compute,
    resolve_device,
)
from engine.model.kv_cache import allocate_kv_caches, kv_bytes_per_block, kv_dtype_name, resolve_kv_cache_dtype
from engine.model.loader import load_hf_config, load_model, tokenizer_dir
from engine.model.lora import LoRAError, LoRARequest
from engine.model.lora.manager import LoRAManager
from engine.model.pooling import Pooler
from engine.model.pooling_config import PoolerConfig, pooler_config, resolve_runner
from engine.model.quant_linear import all_linears_quantized
from engine.model.runner import ModelRunner
from engine.model.sharding import SINGLE, TPShard
from engine.model.spec import ModelSpec
from engine.outputs import RequestOutput
from engine.parallel import TensorParallelGroup, start_group
from engine.sample.grammar import GrammarCompiler
from engine.sample.sample_step import SampleStage
from engine.sample.step_plan import plan_step
from engine.sched.admission import RequestRejected, check_request
from engine.sched.output import StepSamples
from engine.sched.scheduler import Scheduler
from engine.sched.sequence import Request, Sequence
from engine.spec.speculator import Speculator
from ops.build import prepare as prepare_kernels
from ops.parallel import openmp_rows_for, set_openmp_rows

log = get_logger("engine")

class EngineClosedError(RuntimeError):
    """The engine was closed (`LLMEngine.close`); it takes no more requests or steps."""


COMPILE_POLL_S = 0.05  # a step with nothing to run but grammars compiling waits this long for one of them


@dataclass(slots=True, kw_only=True)
class Compiling:
    """A request whose grammar is being compiled: queued in the scheduler once it is ready."""

    request: Request
    seq: Sequence
    generated: list[int]
    future: Future[Any]
    deadline: float  # time.monotonic() after which it is refused (`EngineConfig.grammar_compile_timeout`)


GC_GEN0_THRESHOLD = 20_000  # allocations between young collections (Python's default: 700)


def quiet_gc() -> None:
    """Move everything alive after start-up (torch, transformers, the model's modules: ~10^6
    objects) out of the collector's sight, and collect the young generation less often. A step
    allocates thousands of short-lived objects; with the defaults the collector would scan the
    start-up heap again and again."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(max(GC_GEN0_THRESHOLD, gc.get_threshold()[0]), gen1, gen2)


class LLMEngine:
    """Continuous batching over a paged KV cache for one model on one device, or on a
    tensor-parallel group (`config.tensor_parallel_size` > 1): this process is rank 0 and keeps the
    scheduler, block manager and sampling; every rank holds the KV of its own heads under the
    same block ids (`engine.parallel`)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.closed = False
        self.device = resolve_device(config.device)
        if config.attention_backend == "auto":
            prepare_kernels(self.device)  # at start-up, not on the first request
        self.dtype, self.bf16_linears = resolve_compute(config, self.device)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)
        self.tokenizer_dir = tokenizer_dir(config.model, config.tokenizer)
        self.hf_config = load_hf_config(config.model)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.eos_token_ids = _eos_ids(config.model if Path(config.model).is_dir() else self.tokenizer_dir,
                                     self.hf_config)
        spec = ModelSpec.from_hf_config(self.hf_config)
        self.runner_kind = resolve_runner(config.runner, config.model, self.hf_config)  # generate | pooling
        self.pooler_config: PoolerConfig | None = None
        if self.runner_kind == "pooling":
            if not Path(config.model).expanduser().is_dir() or config.tensor_parallel_size > 1:
                raise ValueError("the pooling runner serves a Hugging Face model folder on one device "
                                 "(not a .gguf file, tensor_parallel_size 1)")
            self.pooler_config = pooler_config(config.model, self.hf_config, config.pooling_type)
        self.max_model_len = config.resolve_max_model_len(spec.max_position_embeddings, spec.exact_context())
        profile_tokens = min(config.token_budget(self.device.type), self.max_model_len)
        self.parallel: TensorParallelGroup | None = start_group(config, spec, self.device, self.dtype,
                                                                self.kv_dtype, profile_tokens)
        try:
            self._build(config, spec, self.parallel.shard if self.parallel is not None else SINGLE, profile_tokens)
        except BaseException:
            if self.parallel is not None:
                self.parallel.fail("rank 0 could not start")
                self.parallel.close()
            raise
        # the safety net for an engine dropped without close(): its group is stopped when the
        # engine is collected (or at exit). It holds the group, never the engine.
        self._finalizer = weakref.finalize(self, _close_group, self.parallel)

    def _build(self, config: EngineConfig, spec: ModelSpec, shard: TPShard, profile_tokens: int) -> None:
        """Load the model (this rank's part), size and allocate the KV cache, build the parts."""
        # the model's arithmetic, built once: every op of this engine (model, cache moves, sampling)
        # runs under `policy.ops`, whatever another engine in the process runs under
        self.policy = engine_policy(config, self.dtype, self.bf16_linears, self.device)
        self.model = load_model(config.model, device=self.device, quantization=config.quantization, shard=shard,
                                spec=spec, policy=self.policy, pooling=self.pooler_config is not None)
        self.lora = self._start_lora(config)  # before profiling: its slots are part of the device's memory
        if self.device.type == "cpu" and config.attention_backend == "auto":  # which threads kernels share
            set_openmp_rows(openmp_rows_for(all_linears_quantized(self.model), self.policy.ops.fixed_order))
            if (note := openmp_spin_note()) is not None:
                log.warning("openmp spin", note=note)
        kv_spec = shard.kv_spec(self.model.spec)
        block_bytes = kv_bytes_per_block(kv_spec, config.block_size, self.kv_dtype)
        peak = (profile_peak(self.model, profile_tokens, config.max_num_seqs, kv_spec, config.block_size,
                             self.kv_dtype, self.device, self.lora is not None) if self.device.type == "cuda" else 0)
        num_blocks = num_device_blocks(config, block_bytes, self.device, peak)
        num_cpu = num_host_blocks(config, block_bytes)
        if self.parallel is not None:  # one block manager for the group: the smallest rank's pool
            num_blocks, num_cpu = self.parallel.agree_min(num_blocks), self.parallel.agree_min(num_cpu)
        if num_blocks < 1:
            raise ValueError("no room for a single KV block: raise kv_cache_memory / gpu_memory_utilization")
        self.block_bytes = block_bytes * shard.size  # the group's bytes per block (every rank holds its heads')
        log_capacity(num_blocks, config.block_size, block_bytes, self.max_model_len, kv_dtype_name(self.kv_dtype),
                     shard.size)
        windows = self.model.spec.layer_windows
        self.kv_layers = kv_layers(windows, self.max_model_len, config.block_size)
        log_kv_layers(self.kv_layers)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, num_cpu, watermark=config.watermark,
            enable_prefix_caching=config.enable_prefix_caching, debug=config.debug_blocks,
            window=release_window(windows),
        )
        kv = allocate_kv_caches(kv_spec, num_blocks, config.block_size, self.kv_dtype, self.device)
        host = allocate_kv_caches(kv_spec, num_cpu, config.block_size, self.kv_dtype, "cpu")
        if self.device.type == "cuda":
            host = [(k.pin_memory(), v.pin_memory()) for k, v in host]
        self.runner = ModelRunner(self.model, kv, host, config.block_size, self.device,
                                  self.parallel.publish if self.parallel is not None else None)
        self.runner.lora = self.lora
        self.token_budget = config.token_budget(self.device.type)
        spec_config = config.speculative()
        self.speculator = Speculator(spec_config) if spec_config is not None else None
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, self.token_budget,
                                   config.preemption_mode, self.eos_token_ids, self.max_model_len,
                                   self.speculator, config.max_loras if self.lora is not None else 0)
        self.grammars = GrammarCompiler(self.tokenizer_dir, self.vocab_size, sorted(self.eos_token_ids))
        self.sampler = SampleStage(self.eos_token_ids, self.grammars, self.policy.ops)
        self.pooler = Pooler(self.pooler_config) if self.pooler_config is not None else None
        self.requests: dict[str, Request] = {}
        self.compiling: dict[str, Compiling] = {}  # request id -> its grammar's compile (not in the scheduler yet)
        self.refused: dict[str, tuple[str, str]] = {}  # request id -> (why, code): refused after add_request
        self.counters: Counter[str] = Counter()
        self.step_seconds = 0.0  # cumulative wall time in step(); stats' model_seconds is the model's share
        self.num_steps = 0
        self.last_step_decodes = 0  # sequences that decoded one token in the last step
        quiet_gc()

    def _start_lora(self, config: EngineConfig) -> LoRAManager | None:
        """The adapters' slots in the model and the `lora_modules` served from start-up (None
        without `enable_lora`); logs the memory the slots take (one rank's, under tensor
        parallelism: every rank holds its part of each slot)."""
        if not config.enable_lora:
            return None
        manager = LoRAManager(self.model, config.max_loras, config.max_cpu_loras or config.max_loras,
                              config.max_lora_rank, self.parallel.place_lora if self.parallel is not None else None)
        for name, path in (config.lora_modules or {}).items():
            manager.register(name, path)
        log.info("lora slots", max_loras=config.max_loras, max_lora_rank=config.max_lora_rank,
                 bytes_per_adapter=manager.slot_bytes, total_bytes=manager.slot_bytes * config.max_loras,
                 tensor_parallel_size=config.tensor_parallel_size, adapters=manager.names())
        return manager

    def lora_names(self) -> list[str]:
        """The LoRA adapters this engine serves by name (empty without `enable_lora`)."""
        self.check_open()
        return [] if self.lora is None else self.lora.names()

    def add_lora(self, lora: LoRARequest) -> bool:
        """Serve `lora` (read from its path now; vLLM's `add_lora`): True once served, a
        RequestRejected with the adapter's error code when it cannot be."""
        self.check_open()
        if not lora.lora_path:
            raise RequestRejected(f"LoRA adapter {lora.lora_name!r}: lora_path is required", "lora_invalid")
        return self._lora_name(lora) is not None

    def remove_lora(self, name: str) -> bool:
        """Stop serving adapter `name`; False when it is not served. Refused (RequestRejected,
        `lora_in_use`) while a request of it is queued or running: those finish first. The prefix
        cache's free blocks are dropped with it (its K/V is keyed by its name, which a later
        adapter may take)."""
        self.check_open()
        if self.lora is None or name not in self.lora.paths:
            return False
        users = sorted(r.request_id for r in self.requests.values() if r.lora_name == name)
        if users:
            raise RequestRejected(f"LoRA adapter {name!r} is in use by {len(users)} request(s), e.g. {users[0]}",
                                  "lora_in_use")
        self.block_manager.reset_prefix_cache()
        return self.lora.unregister(name)

    def _lora_name(self, lora: LoRARequest | None) -> str | None:
        """The adapter a request runs with, registered (from its path) or known by name; a
        RequestRejected with the adapter's error code otherwise."""
        if lora is None:
            return None
        if self.lora is None:
            raise RequestRejected(f"LoRA adapter {lora.lora_name!r} asked for, but this engine serves none "
                                  "(--enable-lora)", "lora_disabled")
        try:
            if lora.lora_path:
                self.lora.register(lora.lora_name, lora.lora_path)
            else:
                self.lora.adapter(lora.lora_name)
        except LoRAError as exc:
            raise RequestRejected(str(exc), exc.code) from None
        return lora.lora_name

    # ----- requests ------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, generated: list[int] | None = None,
                    lora_request: LoRARequest | None = None, pooling: PoolingParams | None = None) -> None:
        """Queue a request; raises RequestRejected (a ValueError; nothing is queued) when it can never run.

        A grammar (`structured_output`) not compiled yet is compiled off this thread
        (`GrammarCompiler.submit`): the request waits in `compiling`, holding no blocks, and
        `step` queues it in the scheduler once its matcher is ready, or refuses it (a bad
        grammar, or past `grammar_compile_timeout` seconds): `take_refused` says which and why.
        A cached grammar is applied here (and a bad one raises here when its error is known).

        `generated`: tokens a previous engine already sent to the client (resume after
        failover, one sequence only). The request continues after them, by recompute, with its
        grammar advanced over them; its deltas (and prompt logprobs) start after them.

        `lora_request`: run it with that LoRA adapter (read from its path the first time, or one
        already served under its name); its K/V is never shared with another adapter's.

        `pooling`: an embedding request (a pooling engine only, and only such requests there): the
        prompt is prefilled and the request finishes with its pooled vector (`RequestOutput.embedding`)."""
        self.check_open()
        if request_id in self.requests:
            raise RequestRejected(f"request id {request_id!r} is already in use", "duplicate_request_id")
        pooling = self._check_pooling(pooling)
        check_request(prompt_token_ids, params, self.vocab_size, self.max_model_len, self.block_manager,
                      self.config.max_num_seqs)
        generated = list(generated or [])
        if generated and not params.resumes_in_place:
            raise RequestRejected("only a single-sequence request resumes from generated tokens", "invalid_parameter")
        params = params.with_default_seed(request_id)
        request = Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), params=params,
                          lora_name=self._lora_name(lora_request), pooling=pooling)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        seq = Sequence(request=request, index=0, token_ids=list(prompt_token_ids) + generated,
                       num_prompt_tokens=len(prompt_token_ids))
        seq.num_emitted = len(generated)  # the client has them
        request.prompt_logprobs_sent = bool(generated)  # they came with the first delta
        request.seqs.append(seq)
        if params.structured_output is not None:
            future = self.grammars.submit(params.structured_output)
            if not future.done():
                deadline = time.monotonic() + self.config.grammar_compile_timeout
                self.compiling[request_id] = Compiling(request=request, seq=seq, generated=generated, future=future,
                                                       deadline=deadline)
                self.requests[request_id] = request
                return
            seq.grammar = self.grammars.follow(future.result(), generated)
        self._queue(request)

    def _check_pooling(self, pooling: PoolingParams | None) -> PoolingParams | None:
        """The request's pooling with this engine's pooling type; RequestRejected for a generation
        request on a pooling engine, an embedding request on a generating one, or `dimensions`
        the model cannot give."""
        if self.pooler_config is None:
            if pooling is not None:
                raise RequestRejected("this model is served for generation, not embeddings (start the engine with "
                                      "--runner pooling to serve its hidden states)", "invalid_request")
            return None
        if pooling is None:
            raise RequestRejected("this model is served for embeddings (runner pooling): use /v1/embeddings, "
                                  "not text generation", "invalid_request")
        try:
            pooling.validate()
        except ValueError as exc:
            raise RequestRejected(str(exc), "invalid_parameter") from exc
        why = self.pooler_config.dimensions_error(pooling.dimensions)
        if why is not None:
            raise RequestRejected(why, "invalid_parameter")
        return PoolingParams(pooling.dimensions, pooling.normalize, self.pooler_config.pooling_type)

    def _queue(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add(request)
        self.counters["prompt_tokens"] += len(request.prompt_token_ids)

    def _admit_compiled(self, wait_s: float) -> None:
        """Queue the requests whose grammar is ready; refuse those whose compile failed or ran
        past its deadline. With `wait_s`, first wait that long (or to the nearest deadline) for
        one compile to end when none has."""
        if not self.compiling:
            return
        pending = list(self.compiling.values())
        if wait_s > 0 and not any(c.future.done() for c in pending):
            nearest = min(c.deadline for c in pending) - time.monotonic()
            wait_futures([c.future for c in pending], timeout=max(0.0, min(wait_s, nearest)),
                         return_when=FIRST_COMPLETED)
        now = time.monotonic()
        for c in pending:
            request_id = c.request.request_id
            if c.future.done():
                del self.compiling[request_id]
                try:
                    c.seq.grammar = self.grammars.follow(c.future.result(), c.generated)
                except ValueError as exc:
                    self._refuse(request_id, str(exc), "invalid_parameter")
                    continue
                except Exception as exc:  # not the grammar's fault: say so, without a backtrace
                    self._refuse(request_id, f"structured_output: the grammar could not be compiled "
                                             f"({type(exc).__name__})", "engine_error")
                    continue
                self._queue(c.request)
            elif now >= c.deadline:
                del self.compiling[request_id]
                self.grammars.release(c.request.params.structured_output or {}, c.future)
                self.counters["grammar_timeouts"] += 1
                budget = self.config.grammar_compile_timeout
                self._refuse(request_id, f"structured_output: compiling the grammar took longer than this engine's "
                                         f"budget of {budget:g} s (--grammar-compile-timeout); use a smaller grammar "
                                         f"(fewer choices, a simpler schema or regex)", "grammar_compile_timeout")

    def _refuse(self, request_id: str, message: str, code: str) -> None:
        self.requests.pop(request_id, None)
        self.refused[request_id] = (message, code)
        if self.pooler is not None:
            self.pooler.drop(request_id)

    def wait_compiled(self, request_ids: list[str] | None = None) -> None:
        """Block until these requests (default: all) are past their compile: queued or refused."""
        self.check_open()
        wanted = set(self.compiling) if request_ids is None else set(request_ids)
        while wanted & set(self.compiling):
            self._admit_compiled(COMPILE_POLL_S)

    def take_refused(self) -> dict[str, tuple[str, str]]:
        """Requests refused since the last call, after `add_request` returned: request id ->
        (message, error code). They are gone from the engine; their clients get a 400."""
        self.check_open()
        refused, self.refused = self.refused, {}
        return refused

    def num_compiling(self) -> int:
        """Requests waiting for their grammar to compile."""
        self.check_open()
        return len(self.compiling)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and free its blocks; False when it is unknown or already done."""
        self.check_open()
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if self.pooler is not None:
            self.pooler.drop(request_id)
        compiling = self.compiling.pop(request_id, None)
        if compiling is not None:  # nothing held but a wait on the compile: give that up
            self.grammars.release(request.params.structured_output or {}, compiling.future)
        else:
            self.scheduler.abort(request)
        self.counters["finished_abort"] += 1
        return True

    def reset_prefix_cache(self) -> int:
        """Drop the prefix cache's free blocks (`BlockManager.reset_prefix_cache`); how many."""
        self.check_open()
        return self.block_manager.reset_prefix_cache()

    def has_unfinished_requests(self) -> bool:
        """Requests queued, running or waiting for their grammar."""
        self.check_open()
        return self.scheduler.has_unfinished() or bool(self.compiling)

    # ----- queries (what a driver may ask; it never reaches into the scheduler) ------------
    def queue_lengths(self) -> tuple[int, int, int]:
        """Requests (running, waiting, swapped) right now."""
        self.check_open()
        s = self.scheduler
        return len(s.running), len(s.waiting), len(s.swapped)

    def has_request(self, request_id: str) -> bool:
        """Whether the request is queued, running or compiling its grammar here (not finished, not aborted)."""
        self.check_open()
        return request_id in self.requests

    def running_request_ids(self) -> list[str]:
        """Requests holding device blocks now: what the next step runs first."""
        self.check_open()
        return [request.request_id for request in self.scheduler.running]

    def waiting_request_ids(self) -> list[str]:
        """Requests not admitted yet (new, or preempted by recompute)."""
        self.check_open()
        return [request.request_id for request in self.scheduler.waiting]

    def block_tables(self, max_seqs: int = 64) -> list[dict[str, Any]]:
        """Run-length encoded block tables of up to `max_seqs` running and swapped sequences."""
        self.check_open()
        s = self.scheduler
        seqs = ((req.request_id, seq.index, seq.seq_id) for queue in (s.running, s.swapped)
                for req in queue for seq in req.unfinished_seqs())
        return block_tables(self.block_manager, seqs, max_seqs)

    def cached_keys(self, limit: int) -> list[int]:
        """The prefix-cache keys held, most recently used first (`BlockManager.cached_keys`)."""
        self.check_open()
        return self.block_manager.cached_keys(limit)

    def pool_snapshot(self) -> list[list[int]]:
        """Run-length encoded state of every device block (see `engine.kv.block_stats`)."""
        self.check_open()
        return pool_snapshot(self.block_manager)

    # ----- stepping ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns the deltas of every request that changed. First the
        requests whose grammar compiled are queued (`_admit_compiled`); with nothing else to
        run, it waits up to COMPILE_POLL_S for a compile and returns."""
        self.check_open()
        self._admit_compiled(0.0 if self.scheduler.has_unfinished() else COMPILE_POLL_S)
        if self.compiling and not self.scheduler.has_unfinished():
            return []
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                return self._step()
        except Exception as exc:
            if self.parallel is not None:  # the ranks may be mid-step: the group cannot go on
                raise self.parallel.step_failed(exc) from exc
            raise
        finally:
            self.step_seconds += time.perf_counter() - start
            self.num_steps += 1

    def _step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        self.last_step_decodes = sched.num_decodes
        samples = StepSamples()
        if not sched.is_empty:
            plan = plan_step(sched.scheduled, self.sampler.eos_list, policy=self.policy.ops)
            result = self.runner.execute(sched, plan)
            if self.pooler is not None:
                for item, rows in result.pooled_hidden:
                    pooling = item.seq.request.pooling
                    assert pooling is not None
                    self.pooler.gather(item.seq.request.request_id, pooling.pooling_type, item.start,
                                       item.seq.num_prompt_tokens, rows)
            samples = self.sampler(plan, result)  # every token, the speculative rows' verified
            if self.speculator is not None and all(len(s.token_ids) == 1 or s.num_spec for s in sched.scheduled):
                tokens = len(samples.seqs) + sum(len(r.tokens) for r in samples.spec)
                self.speculator.observe_step(time.perf_counter() - start, tokens, bool(plan.spec))
        outputs = self.scheduler.update_from_output(sched, samples)
        self.counters["finished_error"] += len(sched.rejected)
        if self.config.debug_blocks:
            self.block_manager.check_invariants()
        for out in outputs:
            if out.finished:
                request = self.requests.pop(out.request_id, None)
                if self.pooler is not None:
                    pooling = None if request is None or out.error is not None else request.pooling
                    if pooling is None:
                        self.pooler.drop(out.request_id)
                    else:
                        out.embedding = self.pooler.finish(out.request_id, pooling)
        self.counters["generation_tokens"] += sum(len(s.token_ids) for o in outputs for s in o.outputs)
        return outputs

    def stats(self) -> dict[str, Any]:
        """Block-pool figures, queue lengths and counters, as plain values."""
        self.check_open()
        s = self.scheduler
        return {
            **self.block_manager.stats().to_dict(),
            "kv_layers": dict(self.kv_layers),
            "running": len(s.running),
            "waiting": len(s.waiting),
            "swapped": len(s.swapped),
            "compiling": len(self.compiling),
            "grammars_compiled": self.grammars.num_compiled,
            "grammar_timeouts": self.counters["grammar_timeouts"],
            "preemptions": dict(s.num_preemptions),
            "finished": dict(self.scheduler.post.finished) | {"abort": self.counters["finished_abort"]},
            "prompt_tokens": self.counters["prompt_tokens"],
            "generation_tokens": self.counters["generation_tokens"],
            "num_steps": self.num_steps,
            "step_seconds": self.step_seconds,
            "model_seconds": self.runner.model_seconds + self.sampler.head_seconds,  # forward and lm_head
            "spec": self.speculator.stats() if self.speculator is not None else {},
            "spec_method": self.speculator.config.method if self.speculator is not None else "",
            "spec_accepted_lengths": self.speculator.accepted_lengths() if self.speculator is not None else {},
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "publish_seconds": self.runner.publish_seconds,
        }

    def close(self) -> None:
        """Release everything the engine holds. Idempotent. On return: the tensor-parallel ranks
        are joined and the default process group destroyed (a new engine, of any size, can
        start in this process), the group's threads are joined, and the model weights, KV cache
        and scheduler state are dropped (requests still queued are abandoned). Every later
        call but `close` raises `EngineClosedError`."""
        if self.closed:
            return
        self.closed = True
        self._finalizer()  # the group's close, once
        grammars = self.__dict__.get("grammars")
        if grammars is not None:
            grammars.close()  # its compile threads
        for name in _RELEASED:
            self.__dict__.pop(name, None)
        _collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def check_open(self) -> None:
        """Raise EngineClosedError once `close` ran."""
        if self.closed:
            raise EngineClosedError("the engine is closed; create a new one")


# what close() drops: every holder of the weights, the KV caches and request state
_RELEASED = ("runner", "pooler", "model", "lora", "block_manager", "scheduler", "sampler", "grammars", "speculator",
             "requests", "compiling", "refused")


def _close_group(group: TensorParallelGroup | None) -> None:
    if group is not None:
        group.close()


def _collect() -> None:
    """Collect the closed engine's cycles: `quiet_gc` froze its start-up heap, which the
    collector never scans; unfreeze, collect, and freeze what is still alive again."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()


def _eos_ids(model_path: str, hf_config: Any) -> set[int]:
    """EOS ids from generation_config.json when present, else config.json."""
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_path)
        ids.update(_as_list(gen.eos_token_id))
    except (OSError, ValueError):
        pass
    ids.update(_as_list(getattr(hf_config, "eos_token_id", None)))
    return ids


def _as_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
