#!/usr/bin/env bash
# The fused kernels' targets table (docs/design.md §1.3, "the fused implementation") on one GPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
OUT="$ROOT/runs/gpu_bench"
CAP=300
QUICK=0
IMPL=fused
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help)
      cat <<USAGE
Usage: bash scripts/gpu_bench.sh [--out DIR] [--cap SECONDS] [--impl fused|parallel|auto] [--quick]

One attention module's training step (768 wide, 12 heads, weights and inputs in the dtype, forward + backward,
median of 10 after 3 warm-up steps, CUDA events) for LLN, LLN causal, LLN+Diag, LAVO causal and Skyformer with
--attention-impl IMPL [fused], against the softmax module (SDPA) of the same causality, in float16 and bfloat16,
at N = 2048, 4096, 16384, 32768 with 32768 tokens per step (B = 16, 8, 2, 1); causal steps unpadded, non-causal
ones with the last eighth of one sequence padded. Each (dtype, N) point runs in a process of its own, capped at
--cap seconds [$CAP] (a point over it is left out of the table and named); it writes DIR/<dtype>_<N>.json
[DIR: runs/gpu_bench], then DIR/targets.md: time over softmax's (the issue's target, the implementation that ran)
and the worst peak memory over softmax's. --quick: the CPU, float32, N = 32 and 64, one step each (checks that
the script runs).
USAGE
      exit 0 ;;
    --out) OUT="$2"; shift 2 ;;
    --cap) CAP="$2"; shift 2 ;;
    --impl) IMPL="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    *) echo "gpu_bench.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
if [ "$QUICK" = 1 ]; then
  DTYPES=(float32); SIZES=(32 64); EXTRA=(--device cpu --tokens-per-step 64 --warmup 1 --repeats 1)
else
  DTYPES=(float16 bfloat16); SIZES=(2048 4096 16384 32768); EXTRA=(--tokens-per-step 32768)
fi
mkdir -p "$OUT"
rm -f "$OUT"/*.json "$OUT/targets.md"
cd "$ROOT"
failed=()
for dtype in "${DTYPES[@]}"; do
  for n in "${SIZES[@]}"; do
    if ! timeout "$CAP" "$PY" -m linattn_tools.benchmark.targets --n "$n" --dtype "$dtype" --impl "$IMPL" \
        "${EXTRA[@]}" --json "$OUT/${dtype}_${n}.json"; then
      failed+=("${dtype} N=${n}")
    fi
  done
done
shopt -s nullglob
points=("$OUT"/*.json)
[ ${#points[@]} -gt 0 ] || { echo "gpu_bench.sh: no point finished" >&2; exit 1; }
"$PY" -m linattn_tools.benchmark.targets --render "${points[@]}" | tee "$OUT/targets.md"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_bench.sh: over the cap or failed: ${failed[*]}" | tee -a "$OUT/targets.md" >&2
  exit 1
fi
