"""The group's process groups and the step channel over them.

Two torch.distributed groups over the same ranks:

- the compute group (NCCL on CUDA, gloo on the CPU) carries the model's all-reduces, with the
  short collective timeout: a rank that hangs mid-step fails its peers' next collective within it;
- the control group (always gloo, CPU tensors) carries rank 0's step messages. Its timeout is long,
  because the other ranks wait in it while the engine is idle; a rank 0 that dies closes its
  connections, which fails that wait at once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from engine.parallel.step_message import FIRST_PART, header

IDLE_TIMEOUT = timedelta(days=7)  # the control group's: ranks wait in it between steps


@dataclass(frozen=True, slots=True, kw_only=True)
class Rendezvous:
    """Where the ranks meet (rank 0's address and a free port) and how they talk."""

    master_addr: str
    master_port: int
    world_size: int
    backend: str  # the compute group's: "gloo" or "nccl"
    timeout_s: float


@dataclass(slots=True, kw_only=True)
class Groups:
    """This rank's handles on the two groups."""

    rank: int
    size: int
    compute: Any
    control: Any

    def all_reduce_min(self, value: int) -> int:
        """The smallest of every rank's `value` (over the control group: a CPU tensor on any backend)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control)
        return int(tensor.item())

    def send(self, message: Tensor) -> None:
        """Rank 0: broadcast one message (a first part of `FIRST_PART` values, then any rest)."""
        first = torch.zeros(FIRST_PART, dtype=torch.int64)
        n = min(FIRST_PART, int(message.shape[0]))
        first[:n] = message[:n]
        dist.broadcast(first, src=0, group=self.control)
        if message.shape[0] > FIRST_PART:
            rest = message[FIRST_PART:].contiguous()
            dist.broadcast(rest, src=0, group=self.control)

    def receive(self) -> Tensor:
        """Other ranks: the next message from rank 0 (waits while the engine is idle)."""
        first = torch.empty(FIRST_PART, dtype=torch.int64)
        dist.broadcast(first, src=0, group=self.control)
        length = header(first)["length"]
        if length <= FIRST_PART:
            return first[:length]
        rest = torch.empty(length - FIRST_PART, dtype=torch.int64)
        dist.broadcast(rest, src=0, group=self.control)
        return torch.cat([first, rest])

    def close(self) -> None:
        """Leave the groups (best effort: a peer may be gone)."""
        with contextlib.suppress(RuntimeError, ValueError):
            dist.destroy_process_group()


JOIN_TIMEOUT = timedelta(minutes=5)  # ranks start (import torch, load weights) at their own pace


def join(rendezvous: Rendezvous, rank: int) -> Groups:
    """Join the group as `rank` (blocks until every rank has joined, or `JOIN_TIMEOUT`); rank 0
    hosts the TCP store the others meet at."""
    store = dist.TCPStore(rendezvous.master_addr, rendezvous.master_port, rendezvous.world_size,
                          is_master=rank == 0, timeout=JOIN_TIMEOUT)
    dist.init_process_group(rendezvous.backend, store=store, rank=rank, world_size=rendezvous.world_size,
                            timeout=timedelta(seconds=rendezvous.timeout_s))
    try:
        control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    except BaseException:
        dist.destroy_process_group()  # a half-made group would block the next engine's
        raise
    return Groups(rank=rank, size=rendezvous.world_size, compute=dist.group.WORLD, control=control)
