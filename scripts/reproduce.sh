#!/usr/bin/env bash
# The reproduction ledger: measure the papers' claims this machine can check, then write docs/reproduction.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="$ROOT/.venv/bin/python"
cd "$ROOT"

expected() {  # the wall time of each group's committed run
  "$PY" -m linattn_tools.reproduce expected-time 2>/dev/null \
    || echo "expected wall time: run scripts/setup_env.sh, then $PY -m linattn_tools.reproduce expected-time"
}

usage() {
  cat <<USAGE
Usage: bash scripts/reproduce.sh [--only GROUP ...] [--reuse-quickstart] [--reuse-benchmark] [--quick]
       bash scripts/reproduce.sh --render [--check]

Measures every claim group of docs/reproduction.md, writes docs/reproduction/GROUP.json and
regenerates docs/reproduction.md from the JSON. Full run: $(expected).
Groups:
  lln_distribution  LLN Prop. 3.1, Fig. 5b, Fig. 2: var ln P, entropy, spectral gap on Gaussian q, k
  lln_cost          LLN Table 2: RoBERTa-base update time and memory against N (runs
                    python -m linattn_tools.benchmark.model for softmax with attention dropout 0.1, LLN and
                    LLN+Diag at N = 512-1280; the other points from docs/benchmarks/*.json; --reuse-benchmark
                    re-reads that run instead of measuring)
  quickstart        LLN Table 1, LAVO Table 2 analogues: runs scripts/quickstart.sh into
                    runs/reproduction/quickstart (--reuse-quickstart reads an earlier run there)
  skyformer_error   our Skyformer op on synthetic q, k, v: Nyström error against the number of landmarks
  skyformer_fig1    Skyformer Fig. 1 as the paper ran it: softmax attention's output approximated from encoders'
                    own W_Q, W_K, W_V on real text (trains two small softmax RoBERTas first if they are missing)
  decoding          LAVO Table 10: time to generate 2K, 4K, 8K tokens one by one
--render   rewrite docs/reproduction.md from the committed JSON alone (seconds; --check: only compare)
--quick    tiny sizes, to check the code runs (write elsewhere: --out DIR --ledger FILE)
USAGE
}

case "${1:-}" in
  -h|--help) usage; exit 0;;
  --render) shift; exec "$PY" -m linattn_tools.reproduce render "$@";;
esac
bash "$ROOT/scripts/setup_env.sh"
echo "[reproduce] $(expected)"
exec "$PY" -m linattn_tools.reproduce run "$@"
