"""The engine's own thread: the worker hands it adds and aborts, it steps the `LLMEngine`.

Every engine call (construction included) runs on one dedicated thread, so the asyncio
loop stays free for Redis while a model step runs, and the engine is never touched from
two threads.

Grammars compile off this thread (`engine.sample.grammar`): a request whose grammar is not
ready waits in the engine's `compiling` set, counted in `Queues.compiling`, while the other
streams step on; the engine refuses it after `grammar_compile_timeout`, and that refusal comes
back with the step that made it (`StepResult.rejected`, a 400 for its client).

Containment: a step that raises fails only the requests that step ran (they are aborted,
their blocks freed, their clients get an error); the engine keeps serving the others. The
figures the heartbeat sends are cached at the end of every trip, so a heartbeat never waits
for a long step."""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from common.log import get_logger
from common.pooling_params import PoolingParams
from common.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.sched.admission import RequestRejected
from engine.worker.recovery import RecoveryState

T = TypeVar("T")
log = get_logger("worker.engine")


@dataclass(slots=True, kw_only=True)
class AddJob:
    """A request to start; `generated` holds tokens a dead engine already sent (resume)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generated: list[int] = field(default_factory=list)
    lora_name: str = ""  # the LoRA adapter it runs with (empty: the base model)
    pooling: PoolingParams | None = None  # an embedding request


@dataclass(frozen=True, slots=True, kw_only=True)
class Queues:
    """How many requests the engine holds in each queue after a trip: what the worker steers by."""

    running: int = 0
    waiting: int = 0
    swapped: int = 0
    compiling: int = 0  # waiting for their grammar (not in the scheduler: no reason to stop pulling)

    @property
    def total(self) -> int:
        return self.running + self.waiting + self.swapped + self.compiling


@dataclass(slots=True, kw_only=True)
class StepResult:
    """What one trip to the engine thread produced."""

    outputs: list[RequestOutput]
    rejected: dict[str, tuple[str, str]]  # request id -> (why it could not be queued, error code)
    aborted: list[str]
    stats: dict[str, Any]
    queues: Queues = field(default_factory=Queues)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why its step raised


class EngineThread:
    """Owns the `LLMEngine` and the single thread it lives on. Whether the next trip takes a full
    snapshot is asked of `recovery` (the heartbeat requests one there; this thread takes it).
    `cached_limit`: how many prefix-cache keys each snapshot lists (``cached_keys``, what a
    routed engine announces); 0: none."""

    def __init__(self, recovery: RecoveryState | None = None, cached_limit: int = 0) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.engine: Any = None
        # (figures, pool snapshot) as of the end of the last trip; replaced, never mutated.
        # The pool snapshot and block tables are rebuilt only when the heartbeat asked.
        self.snapshot_cache: tuple[dict[str, Any], list[list[int]]] = ({}, [])
        self.recovery = recovery if recovery is not None else RecoveryState()
        self.cached_limit = cached_limit

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the engine thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def start(self, config: EngineConfig) -> None:
        await self.call(self._build, config)

    def close(self) -> None:
        """Let the running call finish, stop the thread, then `LLMEngine.close` (the offline
        `LLM.close` path: ranks, process group, weights and KV released). Idempotent."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self.engine is not None:
            self.engine.close()

    # ----- on the engine thread --------------------------------------------------------------
    def _build(self, config: EngineConfig) -> None:
        from engine.llm_engine import LLMEngine

        self.engine = LLMEngine(config)
        self.engine.grammars.prewarm()  # the grammar tokenizer: at start-up, not under the first request's neighbours
        if self.engine.parallel is not None:  # a failed rank ends this process: its requests move elsewhere
            self.engine.parallel.exit_on_failure = True
        self.snapshot_cache = self.snapshot()

    def add(self, job: AddJob) -> None:
        """Queue a request; a resumed one restarts by recompute from prompt + generated tokens."""
        from engine.model.lora import LoRARequest

        lora = LoRARequest(job.lora_name) if job.lora_name else None
        self.engine.add_request(job.request_id, job.prompt_token_ids, job.params, generated=job.generated,
                                lora_request=lora, pooling=job.pooling)

    def step(self, jobs: list[AddJob], aborts: list[str]) -> StepResult:
        """Apply aborts and adds, then run one engine step when there is work."""
        aborted = [rid for rid in aborts if self.engine.abort_request(rid)]
        rejected: dict[str, tuple[str, str]] = {}
        for job in jobs:
            try:
                self.add(job)
            except RequestRejected as exc:  # nothing was queued
                rejected[job.request_id] = (str(exc), exc.code)
            except ValueError as exc:  # a parameter the engine cannot apply (a grammar, resumed tokens)
                self.engine.abort_request(job.request_id)
                rejected[job.request_id] = (str(exc), "invalid_parameter")
            except Exception as exc:  # a request the engine cannot even queue: only it fails
                self.engine.abort_request(job.request_id)
                rejected[job.request_id] = (f"the engine could not queue this request: {exc!r}", "engine_error")
        outputs: list[RequestOutput] = []
        failed: dict[str, str] = {}
        if self.engine.has_unfinished_requests():
            in_step = self.engine.running_request_ids() + self.engine.waiting_request_ids()
            try:
                outputs = self.engine.step()
            except Exception as exc:
                failed = self._fail_step(in_step, exc)
        rejected.update(self.engine.take_refused())  # grammars that failed or ran out of time
        running, waiting, swapped = self.engine.queue_lengths()
        queues = Queues(running=running, waiting=waiting, swapped=swapped, compiling=self.engine.num_compiling())
        return StepResult(outputs=outputs, rejected=rejected, aborted=aborted, stats=self._refresh_cache(),
                          queues=queues, failed=failed)

    def _refresh_cache(self, full: bool = False) -> dict[str, Any]:
        # idle after this trip: no later step would refresh it, so take the full snapshot now
        # (the request is taken first: a full snapshot for any reason answers it)
        if self.recovery.take_snapshot() or full or not self.engine.has_unfinished_requests():
            self.snapshot_cache = self.snapshot()
        else:
            old_stats, pool = self.snapshot_cache
            kept = {key: old_stats[key] for key in ("block_tables", "cached_keys") if key in old_stats}
            self.snapshot_cache = (self.engine.stats() | kept, pool)
        return self.snapshot_cache[0]

    def _fail_step(self, candidates: list[str], exc: Exception) -> dict[str, str]:
        """A step raised: abort what it ran (running after the failed schedule, plus the
        candidates it may have admitted), so their blocks return and the engine goes on."""
        log.error("engine step failed; failing its requests", error=repr(exc),
                  traceback=traceback.format_exc(limit=8))
        waiting = set(self.engine.waiting_request_ids())
        ran = set(self.engine.running_request_ids())
        ran |= {rid for rid in candidates if self.engine.has_request(rid) and rid not in waiting}
        message = f"the engine failed while running this request: {exc!r}"
        failed = {}
        for request_id in sorted(ran):
            if self.engine.abort_request(request_id):
                failed[request_id] = message
        return failed

    def abort_all(self, request_ids: list[str]) -> list[str]:
        """Abort these requests (lost ownership, Redis lost its data); returns those aborted."""
        aborted = [rid for rid in request_ids if self.engine.abort_request(rid)]
        self._refresh_cache(full=True)
        return aborted

    def snapshot(self) -> tuple[dict[str, Any], list[list[int]]]:
        """Current figures (with the running and swapped sequences' ``block_tables`` and, when
        `cached_limit`, the prefix-cache keys held as ``cached_keys``) and the run-length
        block-pool snapshot."""
        stats = self.engine.stats()
        stats["block_tables"] = self.engine.block_tables()
        if self.cached_limit:
            stats["cached_keys"] = self.engine.cached_keys(self.cached_limit)
        return stats, self.engine.pool_snapshot()
