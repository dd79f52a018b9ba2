#!/usr/bin/env bash
# Create (or reuse) .venv inside the repository and install what is missing (the README's commands call it).
# Idempotent: a stamp file records the hash of the set-up files; a second run with nothing changed returns in a
# few seconds. --help for the three cases (a Python with torch, a bare machine, a machine without a network).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
EXTENSIONS="${FAIRSEQ_EXTENSIONS:-minimal}"

usage() {
  cat <<'USAGE'
Usage: bash scripts/setup_env.sh                      set up .venv (PyPI for what is missing)
       bash scripts/setup_env.sh --offline DIR        set up .venv from the wheelhouse DIR, without a network
       bash scripts/setup_env.sh --download DIR [--python-version X.Y] [--platform TAG] [--torch SPEC]
                                                      fill the wheelhouse DIR for a machine without a network

.venv is made from PYTHON [python3] (3.10, 3.11 or 3.12). When that Python imports torch (a container's or a
conda env's CUDA build, a venv of your own), .venv sees its packages and keeps that torch: only what is missing is
installed, never a second torch. Otherwise TORCH_SPEC [torch==2.13.0] is installed (from PyPI; --offline: from
DIR when the wheelhouse was made with --torch).
fairseq 0.12 (fairseq-fixed==0.12.3.1) is built from its sdist with the extensions training, eval-lm and
generate call (about 30 s); FAIRSEQ_EXTENSIONS=all builds all of them (libbase, libnat, ...: minutes).

--download DIR (run where there is a network, with any Python 3): the fairseq sdist and wheels of every other
  requirement for the target: --python-version X.Y [this Python's], --platform TAG [this machine's; e.g.
  manylinux_2_28_x86_64, or manylinux2014_x86_64 for glibc 2.17]; torch only with --torch SPEC (e.g.
  --torch torch==2.6.0, with PIP_EXTRA_INDEX_URL naming PyTorch's index for a CUDA build).
--offline DIR: install from DIR only (pip --no-index); fairseq is built there from the sdist.

Environment: PYTHON, VENV [ROOT/.venv], TORCH_SPEC, FAIRSEQ_EXTENSIONS [minimal|all].
USAGE
}

die() { echo "setup_env.sh: error: $*" >&2; exit 2; }
MODE=install; DIR=""; TARGET_PY=""; PLATFORM=""; WITH_TORCH=""
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0;;
    --offline|--download|--python-version|--platform|--torch)
      [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (see --help)"
      case "$1" in
        --offline) MODE=offline; DIR="$2";;
        --download) MODE=download; DIR="$2";;
        --python-version) TARGET_PY="$2";;
        --platform) PLATFORM="$2";;
        --torch) WITH_TORCH="$2";;
      esac
      shift 2;;
    *) die "unexpected argument '$1' (see --help)";;
  esac
done
if [ "$MODE" != download ] && [ -n "$TARGET_PY$PLATFORM$WITH_TORCH" ]; then
  die "--python-version, --platform and --torch go with --download DIR"
fi
case "$EXTENSIONS" in minimal|all) ;; *) die "FAIRSEQ_EXTENSIONS=$EXTENSIONS: minimal or all";; esac
supported() { case "$1" in 3.10|3.11|3.12) return 0;; *) return 1;; esac; }
version_of() { "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])'; }
executable_of() { "$1" -c 'import os, sys; print(os.path.abspath(sys.executable))'; }
# Drop two kinds of pip noise: this machine's pip config names index folders that may not exist, and the
# resolver's "conflict" report for torchaudio, which fairseq declares and the fairseq step leaves out on purpose.
# Any other conflict is still printed, with its header.
quiet() {
  awk '/^WARNING: Location .* is ignored/ {next}
       /^ERROR: pip.s dependency resolver/ {hdr = $0; next}
       /requires torchaudio/ {next}
       {if (hdr != "") {print hdr; hdr = ""} print}' >&2 || true
}
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

if [ "$MODE" = download ]; then
  command -v "$PY" > /dev/null || die "PYTHON=$PY: not found"
  TARGET_PY="${TARGET_PY:-$(version_of "$PY")}"
  supported "$TARGET_PY" || die "Python $TARGET_PY: fairseq 0.12 runs on 3.10, 3.11 \
or 3.12 (--python-version X.Y names the target's)"
  # a throwaway venv with pip and setuptools: pip reads fairseq's sdist without build isolation (fairseq_build.py)
  "$PY" -m venv "$tmp/tools" || die "$PY -m venv failed (Debian/Ubuntu: apt-get install python3-venv)"
  "$tmp/tools/bin/python" -m pip --disable-pip-version-check install -q setuptools wheel 2> >(quiet)
  mkdir -p "$DIR"
  "$tmp/tools/bin/python" "$ROOT/scripts/wheelhouse.py" download "$(cd "$DIR" && pwd)" \
    --python-version "$TARGET_PY" ${PLATFORM:+--platform "$PLATFORM"} ${WITH_TORCH:+--torch "$WITH_TORCH"}
  exit 0
fi

if [ -x "$VENV/bin/python" ]; then
  if [ -n "${PYTHON:-}" ] && [ -f "$VENV/.linattn-base" ] && [ "$(cat "$VENV/.linattn-base")" != "$(executable_of "$PY")" ]
  then
    die "$VENV was made over $(cat "$VENV/.linattn-base"), not PYTHON=$PY: remove it (rm -rf $VENV) or name \
another with VENV=..."
  fi
  USE="$VENV/bin/python"
else
  command -v "$PY" > /dev/null || die "PYTHON=$PY: not found (e.g. PYTHON=/path/to/python3.11 bash scripts/setup_env.sh)"
  USE="$PY"
fi
PY_VERSION="$(version_of "$USE")"

supported "$PY_VERSION" || die "$USE is Python $PY_VERSION: fairseq 0.12 runs on 3.10, 3.11 or 3.12; name one \
with PYTHON=/path/to/python3.11 bash scripts/setup_env.sh"
if [ "$MODE" = offline ]; then
  [ -d "$DIR" ] || die "--offline $DIR: not a directory"
  DIR="$(cd "$DIR" && pwd)"
  "$USE" "$ROOT/scripts/wheelhouse.py" check "$DIR" > "$tmp/wheelhouse" 2>&1 || { cat "$tmp/wheelhouse" >&2; exit 2; }
fi

stamp="$VENV/.linattn-installed"
want="$(cat "$ROOT/scripts/setup_env.sh" "$ROOT/scripts/fairseq_build.py" "$ROOT/setup.py" | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import fairseq, fairseq_linattn" 2>/dev/null
then
  exit 0
fi
[ "$MODE" = offline ] && echo "[setup] $(cat "$tmp/wheelhouse")"

SOURCE=()
[ "$MODE" = offline ] && SOURCE=(--no-index --find-links "$DIR")
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2> >(quiet); }
vpy() { "$VENV/bin/python" -c "$@" 2>/dev/null; }
build() { if [ -n "$1" ]; then echo "CUDA $1"; else echo "CPU-only"; fi; }

# PROBE: one line about a Python, fields split by \x1f: version, its torch ('' if none), torch's CUDA version,
# the folder torch lies in, the interpreter, its site-packages folders
PROBE='import os, site, sys
try:
    import torch
    t = (torch.__version__, torch.version.cuda or "", os.path.dirname(os.path.dirname(torch.__file__)))
except Exception:
    t = ("", "", "")
print("%d.%d" % sys.version_info[:2], *t, os.path.abspath(sys.executable), *site.getsitepackages(), sep="\x1f")'

if [ ! -x "$VENV/bin/python" ]; then
  IFS=$'\x1f' read -r -a base <<< "$("$PY" -c "$PROBE" 2>/dev/null)"
  if [ -n "${base[1]:-}" ]; then
    echo "[setup] creating $VENV over $PY (Python $PY_VERSION), which has torch ${base[1]}"
    "$PY" -m venv --system-site-packages "$VENV" || die "$PY -m venv failed (apt-get install python3-venv?)"
    # --system-site-packages shows the base installation's packages, not a venv's or a --user torch's: add the
    # base's site dirs (and torch's) that .venv does not see yet, with their .pth files
    seen="$("$VENV/bin/python" -c 'import sys; print("\n".join(sys.path))')"
    for d in "${base[@]:5}" "${base[3]}"; do
      if [ -d "$d" ] && ! grep -qxF "$d" <<< "$seen"; then
        echo "import site; site.addsitedir('$d')"
        seen+=$'\n'"$d"
      fi
    done > "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/linattn_base_python.pth"
  else
    echo "[setup] creating $VENV (Python $PY_VERSION, $PY)"
    "$PY" -m venv "$VENV" || die "$PY -m venv failed (apt-get install python3-venv?)"
  fi
  echo "${base[4]:-$PY}" > "$VENV/.linattn-base"
fi

IFS=$'\x1f' read -r -a have <<< "$(vpy "$PROBE" || true)"
if [ -n "${have[1]:-}" ]; then
  echo "[setup] torch ${have[1]} ($(build "${have[2]}")) kept, from ${have[3]}"
elif [ "$MODE" = offline ]; then
  wheel="$(ls "$DIR"/torch-*.whl 2>/dev/null | tail -1)"
  [ -n "$wheel" ] || die "no torch: $PY has none and $DIR holds none (install one into $PY, or make the \
wheelhouse with --torch SPEC)"
  echo "[setup] installing $(basename "$wheel")"
  pip install -q "${SOURCE[@]}" "$wheel"
else
  echo "[setup] installing $TORCH_SPEC (no torch in $PY; for a CUDA build see docs/first_gpu_run.md)"
  pip install -q "$TORCH_SPEC"
fi
# every later pip call keeps this torch: a requirement that wanted another one would fail, not replace it
# (the distribution's version: PyPI's CUDA wheels say 2.11.0 where torch.__version__ says 2.11.0+cu130)
vpy 'from importlib.metadata import version; print("torch==" + version("torch"))' > "$VENV/.linattn-constraints.txt"
KEEP=(-c "$VENV/.linattn-constraints.txt")

# torch among the requirements: pip then picks tools that suit its own pins (torch 2.11 caps setuptools below 82)
pip install -q "${SOURCE[@]}" "${KEEP[@]}" torch numpy cython wheel "setuptools>=70.1"

extensions="import fairseq.data.data_utils_fast, fairseq.data.token_block_utils_fast, fairseq.libbleu"
if vpy "$extensions"; then
  echo "[setup] fairseq $(vpy 'import fairseq; print(fairseq.__version__)') kept, with its extensions"
else
  if [ "$MODE" = offline ]; then
    sdist="$("$VENV/bin/python" "$ROOT/scripts/fairseq_build.py" sdist "$DIR")"
  else
    sdist="$("$VENV/bin/python" "$ROOT/scripts/fairseq_build.py" fetch "$tmp/sdist")"
  fi
  echo "[setup] building fairseq from $(basename "$sdist") (FAIRSEQ_EXTENSIONS=$EXTENSIONS)"
  built="$("$VENV/bin/python" "$ROOT/scripts/fairseq_build.py" wheel "$sdist" "$tmp/wheel" --extensions "$EXTENSIONS")"
  IFS=$'\t' read -r wheel seconds what <<< "$built"
  echo "[setup] built in $seconds ($what)"
  # fairseq's metadata asks for torchaudio (a second, multi-GB torch): no deps; setup.py lists what it needs
  pip install -q --no-deps --no-index --force-reinstall "$wheel"
fi

echo "[setup] installing fairseq_linattn and what it needs that is missing"
pip install -q "${SOURCE[@]}" "${KEEP[@]}" --use-pep517 --no-build-isolation -e "$ROOT[test]"
"$VENV/bin/python" -c "import fairseq_linattn" || die "import fairseq_linattn failed in $VENV (above)"
echo "$want" > "$stamp"
IFS=$'\x1f' read -r -a have <<< "$(vpy "$PROBE")"
echo "[setup] done: $VENV (Python ${have[0]}, torch ${have[1]} $(build "${have[2]}"), \
fairseq $(vpy 'import fairseq; print(fairseq.__version__)'))"
