"""Serving a gateway app until a signal, then draining it (`gateway.drain`) and exiting 0.

SIGTERM or SIGINT starts the drain; a second one exits at once (status 128 + signal). The drain
first closes the listening socket (`_stop_listening`), so a new connection is refused at the TCP
level (ECONNREFUSED) and a load balancer that retries a refused connect sends it to another
gateway; with `reuse_port` (SO_REUSEPORT) a new gateway bound to the same port takes the new
connections instead. Connections already open stay served: a request on one runs normally and its
response says ``Connection: close`` (`Drain.close_connections`), so each such connection carries at
most one more request. Idle keep-alive connections are not closed when the drain starts: a client
may be sending its next request on one at that instant, and closing a connection under a request
resets it, a failure a balancer does not retry for a POST it has sent. After the drain they linger
(`_linger`) until their clients close them, for up to LINGER_S, and the runner's cleanup closes
what is left."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

from aiohttp import web

from common.log import get_logger
from gateway.state import BROKER, DRAIN

log = get_logger("gateway")
LINGER_S = 2.0  # how long keep-alive connections may stay open after the drain
MIGRATE_REQ = Path("/proc/sys/net/ipv4/tcp_migrate_req")


async def serve(app: web.Application, host: str, port: int, drain_timeout_s: float, reuse_port: bool) -> int:
    """Run `app` on host:port until SIGTERM/SIGINT, drain, clean up. Returns the exit status."""
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0)
    await runner.setup()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("second signal: exiting without finishing the drain", signal=signum)
            os._exit(128 + signum)
        log.info("signal: draining", signal=signum)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
        await site.start()
        log.info("listening", host=host, port=port, reuse_port=reuse_port)
        if reuse_port:
            _warn_without_request_migration()
        await stop.wait()
        app[DRAIN].draining = True  # first: once a connect is refused, /health says draining
        await _stop_listening(site, runner)
        await app[DRAIN].run(app[BROKER], drain_timeout_s)
        await _linger(runner, app, drain_timeout_s)
    finally:
        await runner.cleanup()
    log.info("gateway stopped")
    return 0


def _warn_without_request_migration() -> None:
    """A warning when the kernel resets, rather than migrates, the connections queued on a closing
    SO_REUSEPORT listener (docs/deployment.md, the hand-over)."""
    try:
        migrate = MIGRATE_REQ.read_text().strip()
    except OSError:
        return
    if migrate == "0":
        log.warning("net.ipv4.tcp_migrate_req is 0: a connection that reaches this listener in the instant "
                    "a hand-over closes it is reset; set it to 1 for hand-overs without resets")


async def _linger(runner: web.AppRunner, app: web.Application, drain_timeout_s: float) -> None:
    """After the drain: wait until the clients have closed their keep-alive connections (up to
    LINGER_S), serving and draining any request that arrives on one meanwhile."""
    server = runner.server
    if server is None:
        return
    deadline = time.monotonic() + LINGER_S
    while server.connections and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    if app[DRAIN].active:
        await app[DRAIN].run(app[BROKER], drain_timeout_s)
    log.info("lingered", open_connections=len(server.connections))


async def _stop_listening(site: web.TCPSite, runner: web.AppRunner) -> None:
    """Close the listening sockets, keeping the accepted connections and their handlers. A
    listening socket closed with connections in its accept queue resets them (those of a
    SO_REUSEPORT group too, unless net.ipv4.tcp_migrate_req=1): their clients had connected and
    sent a request, so a balancer would not retry it elsewhere. The queue is emptied first: the
    socket is duplicated, the server's own descriptor closed (no more reads from the loop), then
    every queued connection is accepted on the duplicate and served, and the duplicate closed
    right after the queue is empty. From then on a connect is refused."""
    server = site._server  # the asyncio.Server of the site (aiohttp keeps no public handle)
    factory = runner.server
    if not isinstance(server, asyncio.Server) or factory is None:
        return
    loop = asyncio.get_running_loop()
    listeners = [socket.socket(fileno=os.dup(s.fileno())) for s in server.sockets]
    server.close()
    accepted = 0
    for listener in listeners:
        listener.setblocking(False)
        with listener:
            while True:
                try:
                    conn, _ = listener.accept()
                except (BlockingIOError, InterruptedError):
                    break
                conn.setblocking(False)
                await loop.connect_accepted_socket(factory, conn)
                accepted += 1
    log.info("stopped listening", queued_connections_served=accepted)
