"""Serving a gateway app until a signal, then draining it (`gateway.drain`) and exiting 0.

SIGTERM or SIGINT starts the drain; a second one exits at once (status 128 + signal). With
`reuse_port` the listening socket is bound with SO_REUSEPORT and closed when the drain starts:
a new gateway on the same port takes the new connections while this one finishes its streams.
Open connections stay served either way."""

from __future__ import annotations

import asyncio
import os
import signal
import socket

from aiohttp import web

from common.log import get_logger
from gateway.state import BROKER, DRAIN

log = get_logger("gateway")


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
        await stop.wait()
        if reuse_port:
            await _stop_listening(site, runner)
            app[DRAIN].refuse_new = False
        await app[DRAIN].run(app[BROKER], drain_timeout_s)
    finally:
        await runner.cleanup()
    log.info("gateway stopped")
    return 0


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
