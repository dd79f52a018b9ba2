#!/usr/bin/env bash
# Create (or reuse) .venv inside the repository and install everything the project needs.
# Idempotent: a stamp file records the hash of this script and setup.py; a second run with
# nothing changed returns in about a second. A torch already in the venv (e.g. a user's CUDA
# build) is kept; otherwise torch==2.13.0 (the CPU wheel on this machine's disk) is installed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
FAIRSEQ_SPEC="fairseq-fixed==0.12.3.1"

stamp="$VENV/.linattn-installed"
want="$(cat "$ROOT/scripts/setup_env.sh" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import fairseq, fairseq_linattn" 2>/dev/null; then
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment $VENV"
  "$PY" -m venv "$VENV"
fi
# Drop two kinds of pip noise: this machine's pip config names index folders that may not exist,
# and the resolver's "conflict" report for torchaudio, which fairseq declares and the fairseq step
# below leaves out on purpose. Any other conflict is still printed, with its header.
quiet() {
  awk '/^WARNING: Location .* is ignored/ {next}
       /^ERROR: pip.s dependency resolver/ {hdr = $0; next}
       /requires torchaudio/ {next}
       {if (hdr != "") {print hdr; hdr = ""} print}' >&2 || true
}
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2> >(quiet); }

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "[setup] installing $TORCH_SPEC"
  pip install -q "$TORCH_SPEC"
fi
pip install -q numpy cython wheel "setuptools>=77"

if ! "$VENV/bin/python" -c "import fairseq" 2>/dev/null; then
  echo "[setup] building $FAIRSEQ_SPEC (C++ extensions; ~5 min the first time, cached by pip afterwards)"
  # fairseq declares torchaudio (a multi-GB CUDA torch): install it without deps, list its needs ourselves.
  # fairseq's setup.py builds CUDA kernels whenever CUDA_HOME is *present* (even empty): remove it.
  env -u CUDA_HOME "$VENV/bin/python" -m pip --disable-pip-version-check install -q --no-deps \
    --no-build-isolation "$FAIRSEQ_SPEC" 2> >(quiet)
fi

echo "[setup] installing fairseq_linattn and its dependencies"
pip install -q -e "$ROOT[test]"
echo "$want" > "$stamp"
echo "[setup] done: $VENV"
