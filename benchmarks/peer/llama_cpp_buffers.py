"""Which weight buffers llama.cpp put a model in, read from its own log while it loads.

llama.cpp's CPU backend repacks Q4_0 / Q4_K / IQ4_NL weights into interleaved layouts by default
(its "extra buffer types"; the log says ``CPU_REPACK model buffer size = ...``). The benchmarks load
models with llama.cpp's default parameters, as its users do, and report the buffers seen, so a
figure says whether the repacked kernels ran. Runs inside the llama-cpp-python venv.
"""

from __future__ import annotations

import ctypes
import re
from typing import Any

_BUFFER = re.compile(r"\b([A-Za-z0-9_]+) model buffer size")


class BufferLog:
    """Installs a llama.cpp log callback that keeps the names of the model buffers it reports
    (``names``) and passes nothing on; keep the object alive while llama.cpp may log."""

    def __init__(self, llama_cpp: Any) -> None:
        self.names: list[str] = []
        callback_type = getattr(llama_cpp, "ggml_log_callback", None) or getattr(llama_cpp, "llama_log_callback", None)
        if callback_type is None or not hasattr(llama_cpp, "llama_log_set"):
            self.names.append("unknown (no log callback in this llama-cpp-python)")
            return

        def keep(_level: int, text: bytes | None, _user: Any) -> None:
            match = _BUFFER.search((text or b"").decode(errors="replace"))
            if match and match.group(1) not in self.names:
                self.names.append(match.group(1))

        self._callback = callback_type(keep)
        llama_cpp.llama_log_set(self._callback, ctypes.c_void_p(0))

    @property
    def repacked(self) -> bool:
        return any("REPACK" in name.upper() for name in self.names)
