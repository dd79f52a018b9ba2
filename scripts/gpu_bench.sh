#!/usr/bin/env bash
# The fused kernels' targets table (docs/design.md §1.3, "the fused implementation") on one GPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
OUT="$ROOT/runs/gpu_bench"
CAP=300
QUICK=0
IMPL=
TUNE=0
PROFILE=0
FLA_WHEELS=
DTYPES_ARG=()
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help)
      cat <<USAGE
Usage: bash scripts/gpu_bench.sh [--out DIR] [--cap SECONDS] [--impl fused|parallel|auto] [--dtypes DTYPE...]
                                 [--tune SECONDS] [--profile] [--fla-wheels DIR] [--quick]

One attention module's training step (768 wide, 12 heads, weights and inputs in the dtype, forward + backward from
an output gradient with no loss, median of 10 after 3 warm-up steps, CUDA events; also the host's time to issue
it, and the step captured in one CUDA graph and replayed, or why it could not be captured) for LLN, LLN causal,
LLN+Diag, LAVO causal and Skyformer with --attention-impl IMPL [fused; auto with --quick], against the softmax module (SDPA) of the same
causality, in float16 and bfloat16, at N = 2048, 4096, 16384, 32768 with 32768 tokens per step (B = 16, 8, 2, 1);
causal steps unpadded, non-causal ones with the last eighth of one sequence padded. One small step of every series
per dtype first compiles the kernels (Triton caches them on disk). Each (dtype, N) point runs in a process of its
own, capped at --cap seconds [$CAP] (a point over it is left out of the table and named); it writes DIR/<dtype>_<N>.json
[DIR: runs/gpu_bench], then DIR/targets.md: time over softmax's (the issue's target, the implementation that ran,
for fused steps their byte floor over their time, docs/benchmarks/step_floors.json) and the worst peak memory over
softmax's. --dtypes: some of float16 bfloat16 [both].
--tune SECONDS: first \`python -m dev.perf.tune_fused\` (its float64 checks, then the launch settings
of the kernels, LLN's first, then the block softmax's, Skyformer's and LAVO's; capped at SECONDS: what it found by
then counts, its checks included) writes DIR/tune_fused.json and DIR/tune_fused.env, and the points run with the
settings it found (LINATTN_TRITON_LAUNCH). --profile: then DIR/profile_<method>.txt, the profiler's kernel table of
the step at N = 4096 for LLN (both causalities), LAVO causal, Skyformer and LLN+Diag. --quick: the CPU, float32,
N = 32 and 64, one step each, the implementations auto picks (checks that the script runs: fused refuses float32). On a lent GPU: --tune 150 --profile --cap 60 takes about
7 minutes.
Each causal point also times the baseline fla_linear: flash-linear-attention's chunked causal linear attention
(fla-core) in the softmax module's projections, where fla imports on a GPU (else each point's JSON says why not).
--fla-wheels DIR: first install the wheels in DIR, offline (fla-core and einops, fetched where there is a network:
pip download fla-core==0.6.0 einops --no-deps -d DIR).
USAGE
      exit 0 ;;
    --out) OUT="$2"; shift 2 ;;
    --cap) CAP="$2"; shift 2 ;;
    --impl) IMPL="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --tune) TUNE="$2"; shift 2 ;;
    --profile) PROFILE=1; shift ;;
    --fla-wheels) FLA_WHEELS="$2"; shift 2 ;;
    --dtypes) shift; while [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; do DTYPES_ARG+=("$1"); shift; done ;;
    *) echo "gpu_bench.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "$IMPL" ]; then
  if [ "$QUICK" = 1 ]; then IMPL=auto; else IMPL=fused; fi
fi
if [ "$QUICK" = 1 ]; then
  DTYPES=(float32); SIZES=(32 64); EXTRA=(--device cpu --tokens-per-step 64 --warmup 1 --repeats 1)
  WARM=(--device cpu)
  PROFILE_ARGS=(--device cpu --n 64 --tokens-per-step 64)
else
  DTYPES=(float16 bfloat16); SIZES=(2048 4096 16384 32768); EXTRA=(--tokens-per-step 32768)
  WARM=()
  PROFILE_ARGS=(--n 4096 --tokens-per-step 32768)
fi
[ ${#DTYPES_ARG[@]} -gt 0 ] && DTYPES=("${DTYPES_ARG[@]}")
mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT/targets.md" "$OUT"/tune_fused.* "$OUT"/profile_*.txt
cd "$ROOT"
failed=()
if [ -n "$FLA_WHEELS" ]; then
  "$PY" -m pip install --no-index --no-deps -q "$FLA_WHEELS"/*.whl \
    || failed+=("installing the wheels of $FLA_WHEELS (the points run without the fla_linear baseline)")
fi
if [ "$TUNE" != 0 ]; then
  timeout "$TUNE" "$PY" -m dev.perf.tune_fused --json "$OUT/tune_fused.json" --env "$OUT/tune_fused.env" \
    || failed+=("tune_fused (over ${TUNE} s or a check failed: the points run LAUNCH's settings)")
  if [ -f "$OUT/tune_fused.env" ]; then set -a; . "$OUT/tune_fused.env"; set +a; fi
fi
for dtype in "${DTYPES[@]}"; do
  # Triton compiles each kernel once per specialisation (dtype, flags, lengths divisible by 16): one small step of
  # every series first, so that no point's cap is spent compiling (it caches them on disk for the points' processes)
  timeout 600 "$PY" -m linattn_tools.benchmark.targets --n "${SIZES[0]}" --tokens-per-step "${SIZES[0]}" \
    --dtype "$dtype" --impl "$IMPL" --warmup 1 --repeats 1 ${WARM[@]+"${WARM[@]}"} >/dev/null \
    || failed+=("${dtype} warm-up (compiling the kernels)")
  for n in "${SIZES[@]}"; do
    if ! timeout "$CAP" "$PY" -m linattn_tools.benchmark.targets --n "$n" --dtype "$dtype" --impl "$IMPL" \
        "${EXTRA[@]}" --json "$OUT/${dtype}_${n}.json"; then
      failed+=("${dtype} N=${n}")
    fi
  done
done
if [ "$PROFILE" = 1 ]; then
  for case in "lln" "lln --causal" "lavo --causal" "skyformer" "lln_diag"; do
    read -r method causal <<< "$case"
    timeout "$CAP" "$PY" -m dev.perf.profile_step --method "$method" $causal "${PROFILE_ARGS[@]}" \
      --impl "$IMPL" --dtype "${DTYPES[0]}" --out "$OUT/profile_${method}${causal:+_causal}.txt" >/dev/null \
      || failed+=("profile $case")
  done
fi
shopt -s nullglob
points=("$OUT"/[fb]*_[0-9]*.json)
[ ${#points[@]} -gt 0 ] || { echo "gpu_bench.sh: no point finished" >&2; exit 1; }
FLOORS=()  # each fused step's byte floor (counted on the meta device, committed) over its time
[ "$IMPL" = fused ] && [ -f "$ROOT/docs/benchmarks/step_floors.json" ] && \
  FLOORS=(--floors "$ROOT/docs/benchmarks/step_floors.json")
"$PY" -m linattn_tools.benchmark.targets --render "${points[@]}" ${FLOORS[@]+"${FLOORS[@]}"} | tee "$OUT/targets.md"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_bench.sh: over the cap or failed: ${failed[*]}" | tee -a "$OUT/targets.md" >&2
  exit 1
fi
