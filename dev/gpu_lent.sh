#!/usr/bin/env bash
# One prepared command for a lent GPU's few minutes (the device kit in .device-kit, docs/first_gpu_run.md §5): the
# set-up, the self-test's ops stage (every kernel against the float64 reference on real Triton), its cuda_graph
# stage's LLN cases (--attention-cuda-graph captured on a GPU), the targets benchmark with the launch tuner and the
# profiler, the compile stage's LLN cases (parallel and fused); every file in one tarball and the tables beside it in
# $OUT.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${1:-}" in
  -h|--help)
    cat <<USAGE
Usage: OUT=DIR bash dev/gpu_lent.sh [--dry-run] [STEP...]

The STEPs [all, in this order of worth], each capped, all within BUDGET seconds [570: the device's 600 s a command,
less the packing]:
  setup    bash .device-kit/setup_gpu_env.sh (the kit: cp -r ../shared/device/. .device-kit/; carry .device-kit)
  ops      bash scripts/gpu_selftest.sh --stages ops: every method's kernels against the float64 reference
  graphs   bash scripts/gpu_selftest.sh --stages cuda_graph --methods lln: LLN's steps captured and replayed
  bench    bash scripts/gpu_bench.sh --tune 150 --profile --cap 60 [--fla-wheels .device-kit/fla where it holds
           fla-core's and einops' wheels]
  compile  bash scripts/gpu_selftest.sh --stages compile --methods lln (the env stage runs with each self-test)
Then DIR/gpu_lent.tar.gz (every output and log), DIR/targets.md, DIR/ops.md, DIR/graphs.md and DIR/compile.md (the
self-tests' reports) and DIR/steps.txt (each step's exit status and seconds). A step that runs out of time is stopped and the
next one runs with what is left; a second call on the warm machine (bash dev/gpu_lent.sh setup compile) takes
what the first had no time for. --dry-run: print the steps' commands and their caps, run nothing.
USAGE
    exit 0 ;;
esac
DRY=0
[ "${1:-}" = "--dry-run" ] && { DRY=1; shift; }
STEPS=("$@")
[ ${#STEPS[@]} -gt 0 ] || STEPS=(setup ops graphs bench compile)
OUT="${OUT:-$ROOT/runs/gpu_lent_out}"
KIT="$ROOT/.device-kit"
WORK="${WORK:-/tmp/gpu_lent}"
BUDGET="${BUDGET:-570}"
FLA=()
[ -n "$(ls "$KIT"/fla/fla_core-*.whl 2>/dev/null)" ] && FLA=(--fla-wheels "$KIT/fla")
START=$SECONDS

step() {  # step NAME CAP COMMAND...: run COMMAND if NAME is asked for, capped at CAP seconds and what is left of BUDGET
  local name=$1 cap=$2 left
  shift 2
  [[ " ${STEPS[*]} " == *" $name "* ]] || return 0
  left=$((BUDGET - (SECONDS - START)))
  [ "$cap" -gt "$left" ] && cap=$left
  if [ "$DRY" = 1 ]; then
    echo "$name (cap ${cap} s): $*"
    return 0
  fi
  if [ "$cap" -le 0 ]; then
    echo "$name: not run (no time left)" | tee -a "$WORK/steps.txt"
    return 0
  fi
  local begin=$SECONDS rc=0
  timeout "$cap" "$@" > "$WORK/$name.log" 2>&1 || rc=$?
  echo "$name: exit $rc in $((SECONDS - begin)) s (cap $cap s)" | tee -a "$WORK/steps.txt"
}

if [ "$DRY" = 0 ]; then
  [ -f "$KIT/setup_gpu_env.sh" ] || { echo "gpu_lent.sh: no device kit in $KIT (see --help)" >&2; exit 2; }
  rm -rf "$WORK" && mkdir -p "$WORK" "$OUT"
fi
cd "$ROOT"
step setup 120 bash "$KIT/setup_gpu_env.sh"
step ops 120 bash scripts/gpu_selftest.sh --stages ops --work "$WORK/ops"
step graphs 60 bash scripts/gpu_selftest.sh --stages cuda_graph --methods lln --work "$WORK/graphs"
step bench 420 bash scripts/gpu_bench.sh --tune 150 --profile --cap 60 --out "$WORK/bench" ${FLA[@]+"${FLA[@]}"}
step compile 150 bash scripts/gpu_selftest.sh --stages compile --methods lln --work "$WORK/compile"
[ "$DRY" = 1 ] && exit 0
cp "$WORK/bench/targets.md" "$OUT/" 2>/dev/null
cp "$WORK/ops/report.md" "$OUT/ops.md" 2>/dev/null
cp "$WORK/graphs/report.md" "$OUT/graphs.md" 2>/dev/null
cp "$WORK/compile/report.md" "$OUT/compile.md" 2>/dev/null
cp "$WORK/steps.txt" "$OUT/"
tar czf "$OUT/gpu_lent.tar.gz" -C "$WORK" .
cat "$WORK/steps.txt"
