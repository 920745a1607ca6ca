"""Browser test support: finding (or installing) Debian's chromium, a real `pagedserve up`
stack on a free port, background load through the OpenAI API, and DOM helpers."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "artifacts" / "screenshots"
API_KEY = "sk-browser-test"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]


def find_chromium() -> tuple[str | None, str]:
    """The chromium binary, running scripts/install_chromium.sh first when it is missing;
    (None, why) when there is still none."""
    path = shutil.which("chromium")
    if path:
        return path, ""
    script = ROOT / "scripts" / "install_chromium.sh"
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=600)
    path = shutil.which("chromium")
    why = f"chromium not on PATH after {script.name} (rc {result.returncode}): {result.stderr.strip()[-500:]}"
    return path, "" if path else why


@dataclass
class Stack:
    """`pagedserve up` as a child process: embedded Redis, one engine, the gateway."""

    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @classmethod
    def start(cls, model: Path, log_dir: Path, kv_cache_memory: str = "1MiB") -> Stack:
        port = free_port()
        log_path = log_dir / "up.log"
        cmd = [sys.executable, "-m", "pagedserve.cli", "up", "--model", str(model), "--port", str(port),
               "--served-model-name", "tiny", "--device", "cpu", "--kv-cache-memory", kv_cache_memory,
               # fp32 weights and cache: the pool sizes the pages are tested with (1 MiB = 128 blocks of the
               # tiny model), whatever dtype `auto` picks on this CPU (bf16 where it computes bf16 natively)
               "--kv-cache-dtype", "auto", "--engine-args=--dtype float32",
               "--api-key", API_KEY]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        stack = cls(f"http://127.0.0.1:{port}", proc, log_path)
        try:
            stack.wait_healthy()
        except BaseException:
            stack.stop()
            raise
        return stack

    def wait_healthy(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pagedserve up not healthy:\n{self.log_tail()}")
            time.sleep(0.3)

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def engine_pid(self) -> int:
        """The `pagedserve engine` child of this `up` (read from /proc)."""
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if int(fields[1]) == self.proc.pid and b"engine" in cmdline:
                return int(stat.parent.name)
        raise RuntimeError("pagedserve up has no engine child")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        """SIGTERM: `up` stops the gateway, the engine and Redis in order."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def chat(self, **body: Any) -> dict[str, Any]:
        """A non-streaming chat completion (background load)."""
        data = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Fill the cache"}],
                           **body}).encode()
        request = urllib.request.Request(f"{self.url}/v1/chat/completions", data=data, headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(request, timeout=180) as resp:
            return dict(json.loads(resp.read()))

    def load(self, pool: ThreadPoolExecutor, requests: int, **body: Any) -> list[Future[dict[str, Any]]]:
        return [pool.submit(self.chat, **body) for _ in range(requests)]
