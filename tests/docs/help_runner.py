"""Run each named Python script with `--help` in this one process (torch imported once): the
docs check's proof that every documented script at least starts. Prints one JSON line per script:
its path and the exit code `--help` ended with (0 = parsed and printed usage)."""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys


def help_exit_code(path: str) -> tuple[int, str]:
    """The exit status of `python path --help` (run in-process) and the tail of its output."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv = [path, "--help"]
    out = io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception as exc:
        code, out = 1, io.StringIO(f"{type(exc).__name__}: {exc}")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return code, out.getvalue()[-300:]


if __name__ == "__main__":
    for script in sys.argv[1:]:
        code, tail = help_exit_code(script)
        print(json.dumps({"script": script, "code": code, "tail": tail}), flush=True)
