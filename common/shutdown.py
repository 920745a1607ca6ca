"""A bounded shutdown for the asyncio services (the engine worker, the gateway app): cancel the
background tasks and wait for them a limited time, then run each cleanup step with its own time
limit. A task that lost its cancellation (Python 3.11's `wait_for` / `timeout` can swallow one
that lands as the awaited read completes) or a wedged connection must not keep a process from
exiting or an app from closing; the loops themselves also stop on a flag. Torch-free."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

from common.log import get_logger

STEP_S = 5.0  # the longest the task wait, or any one cleanup step, may take
log = get_logger("shutdown")


async def shut_down(what: str, tasks: Sequence[asyncio.Task[Any]], steps: Sequence[Awaitable[Any]],
                    step_s: float = STEP_S) -> None:
    """Cancel `tasks`, wait up to `step_s` for them, then await each of `steps` (best effort:
    Redis may be gone) for up to `step_s` each. Logs what did not finish; raises nothing."""
    for task in tasks:
        task.cancel()
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=step_s)
        if pending:
            log.error("tasks did not stop when cancelled", service=what, tasks=[t.get_name() for t in pending])
    for step in steps:
        try:
            await asyncio.wait_for(step, step_s)
        except Exception as exc:  # best effort
            log.warning("shutdown step failed", service=what, error=str(exc) or repr(exc))
