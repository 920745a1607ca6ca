"""The engine's own thread: the worker hands it adds and aborts, it steps the `LLMEngine`.

Every engine call (construction included) runs on one dedicated thread, so the asyncio
loop stays free for Redis while a model step runs, and the engine is never touched from
two threads."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.config import EngineConfig
from engine.kv.block_stats import block_tables, pool_snapshot
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

T = TypeVar("T")


@dataclass(slots=True)
class AddJob:
    """A request to start; `generated` holds tokens a dead engine already sent (resume)."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    generated: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepResult:
    """What one trip to the engine thread produced."""

    outputs: list[RequestOutput]
    rejected: dict[str, str]
    aborted: list[str]
    stats: dict[str, Any]


class EngineThread:
    """Owns the `LLMEngine` and the single thread it lives on."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self.engine: Any = None

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run `fn(*args)` on the engine thread."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def start(self, config: EngineConfig) -> None:
        await self.call(self._build, config)

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    # ----- on the engine thread --------------------------------------------------------------
    def _build(self, config: EngineConfig) -> None:
        from engine.llm_engine import LLMEngine

        self.engine = LLMEngine(config)

    def add(self, job: AddJob) -> None:
        """Queue a request; a resumed one restarts by recompute from prompt + generated tokens."""
        params = SamplingParams.from_dict(job.params)
        self.engine.add_request(job.request_id, job.prompt_token_ids, params, generated=job.generated)

    def step(self, jobs: list[AddJob], aborts: list[str]) -> StepResult:
        """Apply aborts and adds, then run one engine step when there is work."""
        aborted = [rid for rid in aborts if self.engine.abort_request(rid)]
        rejected: dict[str, str] = {}
        for job in jobs:
            try:
                self.add(job)
            except ValueError as exc:  # nothing was queued
                rejected[job.request_id] = str(exc)
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        return StepResult(outputs, rejected, aborted, self.engine.stats())

    def snapshot(self) -> tuple[dict[str, Any], list[list[int]]]:
        """Current figures (with the running and swapped sequences' ``block_tables``) and the
        run-length block-pool snapshot."""
        scheduler = self.engine.scheduler
        seqs = ((req.request_id, seq.index, seq.seq_id) for queue in (scheduler.running, scheduler.swapped)
                for req in queue for seq in req.unfinished_seqs())
        stats = self.engine.stats()
        stats["block_tables"] = block_tables(self.engine.block_manager, seqs)
        return stats, pool_snapshot(self.engine.block_manager)
