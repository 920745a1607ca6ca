"""Rank 0's side of a tensor-parallel group: it spawns ranks 1..N-1, joins them, sends each step,
watches them, and takes the engine down when one fails.

A failed rank (it exited, or a collective raised or timed out: a hung rank) leaves the group's
state unknown, so the group never recovers: `fail` kills every other rank and, when
`exit_on_failure` is set (`pagedserve engine`), ends the process at once, so the engine's
heartbeat stops and its requests resume on another engine exactly as after a kill -9; offline
(`LLM`) the step raises `TensorParallelError` and the engine refuses further steps.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from typing import Any

import torch

from common.log import get_logger
from common.ports import free_port
from engine.config import EngineConfig
from engine.model.lora.mirror import encode as encode_lora
from engine.model.lora.placement import Weights
from engine.model.sharding import TPShard
from engine.model.spec import ModelSpec
from engine.model.step_inputs import StepInputs
from engine.parallel.channel import Groups, Rendezvous, join
from engine.parallel.rank import RankArgs, rank_main
from engine.parallel.step_message import Command, control, pack

log = get_logger("parallel")
EXIT_RANK_FAILED = 70  # the engine's exit status when a rank failed (EX_SOFTWARE)


class TensorParallelError(RuntimeError):
    """A rank of the group failed; the group (and its engine) cannot go on."""


class TensorParallelGroup:
    """The group as rank 0 sees it: `shard` for its own model, `publish` for the runner."""

    def __init__(self, config: EngineConfig, spec: ModelSpec, device: str, dtype: str, kv_dtype: str, threads: int,
                 profile_tokens: int) -> None:
        """Spawn ranks 1..N-1 and join them (`device`, `dtype`, `kv_dtype`: rank 0's resolved names)."""
        size = config.tensor_parallel_size
        self.size = size
        self.exit_on_failure = False
        self.previous_threads: int | None = None  # this process's torch threads before the group
        self.broken: str | None = None
        self.closing = False
        host = config.master_addr
        port = config.master_port or free_port(host)
        backend = "nccl" if device.startswith("cuda") else "gloo"
        self.rendezvous = Rendezvous(master_addr=host, master_port=port, world_size=size, backend=backend,
                                     timeout_s=config.tensor_parallel_timeout)
        context = multiprocessing.get_context("spawn")
        ranks = [RankArgs(config=config, spec=spec, rank=rank, rendezvous=self.rendezvous, device=device, dtype=dtype,
                          kv_dtype=kv_dtype, threads=threads, profile_tokens=profile_tokens)
                 for rank in range(1, size)]
        self.procs = [context.Process(target=rank_main, name=f"tp-rank-{args.rank}", daemon=True, args=(args,))
                      for args in ranks]
        for proc in self.procs:
            proc.start()
        log.info("tensor-parallel ranks started", size=size, backend=backend, master=f"{host}:{port}",
                 pids=[p.pid for p in self.procs], threads_per_rank=threads)
        self.timeout_s = config.tensor_parallel_timeout
        self._sending_since: float | None = None  # a send in flight (the control group's timeout is long)
        self._watcher = threading.Thread(target=self._watch, name="tp-watch", daemon=True)
        self._watcher.start()
        self._send_watcher = threading.Thread(target=self._watch_sends, name="tp-send-watch", daemon=True)
        self._send_watcher.start()
        try:
            self.groups: Groups = join(self.rendezvous, 0)
        except BaseException:
            self.closing = True
            for proc in self.procs:
                proc.kill()
            self._reap(5.0)
            raise
        self.shard = TPShard(0, size, self.groups.compute)

    # ----- used by the engine -----------------------------------------------------------------
    def agree_min(self, value: int) -> int:
        """The smallest of every rank's `value` (the KV capacity of the group)."""
        self._check()
        return self.groups.all_reduce_min(value)

    def publish(self, inputs: StepInputs) -> None:
        """Send one step's inputs to ranks 1..N-1 (the runner's `StepPublisher`)."""
        self._send(pack(inputs))

    def place_lora(self, slot: int, weights: Weights) -> None:
        """Put an adapter's whole `weights` in `slot` on ranks 1..N-1 (none: empty it), each rank
        keeping its own part (`LoRAManager`'s mirror; `engine.model.lora.mirror`)."""
        self._send(control(Command.LORA, encode_lora(slot, weights)))

    def _send(self, message: torch.Tensor) -> None:
        self._check()
        self._sending_since = time.monotonic()
        try:
            self.groups.send(message)
        finally:
            self._sending_since = None

    def step_failed(self, exc: BaseException) -> TensorParallelError:
        """A step raised on rank 0: the ranks may be mid-step, so the group is done."""
        self.fail(f"a step failed on rank 0: {exc!r}")
        return TensorParallelError(f"tensor-parallel group failed: {self.broken}")

    def fail(self, reason: str) -> None:
        """Kill every rank; exit the process when `exit_on_failure`. Idempotent."""
        if self.broken is not None:
            return
        self.broken = reason
        log.error("tensor-parallel group failed; stopping the engine", reason=reason, size=self.size,
                  exiting=self.exit_on_failure)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        if self.exit_on_failure:
            os._exit(EXIT_RANK_FAILED)
        for proc in self.procs:
            proc.join(5.0)

    def close(self, timeout: float = 10.0) -> None:
        """Tell the ranks to stop, wait for them (killing stragglers), join the watch threads,
        destroy this process's default process group (a later group can start) and restore the
        torch threads. Idempotent; on return no rank process or watch thread is alive."""
        if self.closing:
            return
        self.closing = True
        if self.broken is None:
            try:
                self.groups.send(control(Command.SHUTDOWN))
            except RuntimeError as exc:
                log.warning("could not send shutdown to the ranks", error=repr(exc))
        self._reap(timeout)
        self.groups.close()
        if self.previous_threads is not None:
            torch.set_num_threads(self.previous_threads)

    def _reap(self, timeout: float) -> None:
        """Join the ranks (killing stragglers), then the watch threads (both end once the ranks
        are gone and `closing` is set)."""
        for proc in self.procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout)
        for thread in (self._watcher, self._send_watcher):
            if thread is not threading.current_thread():
                thread.join(timeout)

    def pids(self) -> list[int]:
        """Process ids of ranks 1..N-1."""
        return [int(p.pid) for p in self.procs if p.pid is not None]

    def stats(self) -> dict[str, Any]:
        return {"tensor_parallel_size": self.size, "tensor_parallel_broken": self.broken or ""}

    # ----- internals ----------------------------------------------------------------------------
    def _check(self) -> None:
        if self.broken is not None:
            raise TensorParallelError(f"tensor-parallel group failed: {self.broken}")

    def _watch_sends(self) -> None:
        """A send blocks until every rank takes it (gloo waits for the receiver): one that has not
        gone within the collective timeout means a hung rank; failing the group kills the ranks,
        which ends the blocked send."""
        while not self.closing and self.broken is None:
            since = self._sending_since
            if since is not None and time.monotonic() - since > self.timeout_s:
                self.fail(f"a step was not taken by every rank within {self.timeout_s:g} s")
            time.sleep(0.2)

    def _watch(self) -> None:
        """Wait for any rank to exit; one that exits while the group is open fails it."""
        sentinels = {proc.sentinel: proc for proc in self.procs}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self.closing:
            return
        dead = sentinels[ready[0]]  # type: ignore[index]
        dead.join(1.0)
        self.fail(f"{dead.name} (pid {dead.pid}) exited with status {dead.exitcode}")
