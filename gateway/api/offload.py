"""CPU-heavy request work (chat templates, tokenization, detokenization of whole texts,
grammar checks) runs on the app's own bounded thread pool, never on the event loop, so
one huge prompt does not stall `/health` and every other stream of the gateway.

`ModelTokenizer` releases the GIL for large texts (see `gateway/text/tokenizer.py`), so
the loop keeps running while a pool thread encodes."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from aiohttp import web

CPU_THREADS = 4  # requests tokenized at once; more wait in the pool's queue
CPU_POOL = web.AppKey("cpu_pool", ThreadPoolExecutor)

P = ParamSpec("P")
T = TypeVar("T")


async def off_loop(app: web.Application, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """`fn(*args, **kwargs)` on the app's CPU pool; its exceptions propagate."""
    return await asyncio.get_running_loop().run_in_executor(app[CPU_POOL], functools.partial(fn, *args, **kwargs))


async def cpu_pool_ctx(app: web.Application) -> AsyncIterator[None]:
    """The pool for the app's lifetime; queued work is cancelled at shutdown."""
    pool = ThreadPoolExecutor(max_workers=CPU_THREADS, thread_name_prefix="gateway-cpu")
    app[CPU_POOL] = pool
    try:
        yield
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
