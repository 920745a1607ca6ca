"""Serving a gateway app until a signal, then draining it (`gateway.drain`) and exiting 0.

SIGTERM or SIGINT starts the drain; a second one exits at once (status 128 + signal). With
`reuse_port` the listening socket is bound with SO_REUSEPORT and closed when the drain starts:
a new gateway on the same port takes the new connections while this one finishes its streams.
Open connections stay served either way. After a hand-over's drain the keep-alive connections
linger (`_linger`): a looping client may be sending its next request on one, and closing it under
that request would reset it; every response of a drain says ``Connection: close``, so the clients
close them within a request."""

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
LINGER_S = 2.0  # how long a hand-over's keep-alive connections may stay open after its drain
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
        if reuse_port:
            await _stop_listening(site, runner)
            app[DRAIN].refuse_new = False
        await app[DRAIN].run(app[BROKER], drain_timeout_s)
        if reuse_port:
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
    """After a hand-over's drain: wait until the clients have closed their keep-alive connections
    (up to LINGER_S), serving and draining any request that arrives on one meanwhile."""
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
    """Close the listening sockets, keeping the accepted connections and their handlers. A socket
    of a SO_REUSEPORT group closed with connections in its accept queue resets them (unless
    net.ipv4.tcp_migrate_req=1), so the queue is emptied first: the socket is duplicated, the
    server's own descriptor closed (no more reads from the loop), then every queued connection is
    accepted on the duplicate and served, and the duplicate closed right after the queue is empty."""
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
