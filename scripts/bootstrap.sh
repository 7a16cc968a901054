#!/usr/bin/env bash
# Set up .venv in the repo root with Strata and every extra (dev, engine, loadtest, router, gpu,
# ucx, peers).
#
# Idempotent: the pip work runs only when .venv/.strata-stamp does not hold the sha256 of
# pyproject.toml, so a second run returns at once and an edited pyproject reinstalls.
# Progress goes to stderr, so `./strata ... > out.json` stays clean.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.strata-stamp"
MIN_PYTHON="3.11"

say() { echo "strata: $*" >&2; }
die() { echo "strata: error: $*" >&2; exit 1; }

python_ok() {  # python_ok EXE: is EXE a Python >= MIN_PYTHON?
    "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null
}

cd "$ROOT"
mkdir -p "$VENV"

# One bootstrap at a time (./strata and scripts/test may start together).
if command -v flock >/dev/null 2>&1; then
    exec 9>"$VENV/.strata-lock"
    flock 9
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    command -v python3 >/dev/null 2>&1 || die "python3 not found on PATH (Strata needs Python >= $MIN_PYTHON)"
    python_ok python3 || die "Strata needs Python >= $MIN_PYTHON; python3 on PATH is $(python3 -V 2>&1)"
    say "creating .venv"
    python3 -m venv "$VENV"
    rm -f "$STAMP"
fi
python_ok "$VENV/bin/python" \
    || die ".venv has $("$VENV/bin/python" -V 2>&1); Strata needs Python >= $MIN_PYTHON (remove .venv and rerun)"

want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
    exit 0
fi

say "installing dependencies (first run takes a few minutes)"
pip=("$VENV/bin/python" -m pip install -q)
# torch first, pinned: a CPU build that lies on this machine's disk. Unpinned, the engine extra
# would pull a multi-GB CUDA build.
"${pip[@]}" "torch==2.13.0" || die "pip could not install torch==2.13.0"
# peers: Mooncake Store's PyPI build, for `strata bench store --against mooncake` and its tests.
"${pip[@]}" -e "$ROOT[dev,engine,loadtest,router,gpu,ucx,peers]" || die "pip could not install Strata ($ROOT)"

echo "$want" >"$STAMP.tmp"
mv "$STAMP.tmp" "$STAMP"
say "ready ($("$VENV/bin/python" -V 2>&1), .venv)"
