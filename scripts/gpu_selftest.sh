#!/usr/bin/env bash
# The first thing to run on a CUDA machine: ops vs references on the GPU, fp16 training, N=4096 benchmark.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
case "${1:-}" in
  -h|--help)
    cat <<USAGE
Usage: bash scripts/gpu_selftest.sh [--parts ops train bench] [--work DIR] [--updates 50]
                                    [--min-loss-scale 1] [--bench-size 4096]

About 5 minutes on one GPU (set CUDA_VISIBLE_DEVICES to choose it); the .venv must hold a CUDA torch.
  1. ops: every attention method in every role (forward and gradients, padded rows) in float32,
     float16 and bfloat16 on the GPU against its float64 reference on the CPU (~1 min);
  2. train: 50 --fp16 updates of each sample recipe on the GPU (pretrain_wikitext103.sh for every
     encoder type, train_pg19.sh for every causal one: python -m linattn.methods list),
     judged from TensorBoard: finite loss, loss_scale never below --min-loss-scale (~3 min);
  3. bench: python -m linattn_tools.benchmark.attention --device cuda --sizes 4096 (CUDA events, ~1 min);
  4. one line: "gpu_selftest: PASS (...)" or "gpu_selftest: FAIL (...); failed: ...".
Exit status 0 = PASS, 1 = a check failed, 2 = no CUDA device (stops at once). Logs, TensorBoard and
the benchmark JSON go to --work [runs/gpu_selftest].
USAGE
    exit 0;;
esac
# the CUDA check comes before fairseq is loaded (linattn_tools.recipes imports no fairseq)
exec "$PY" -m linattn_tools.recipes.gpu_selftest "$@"
