#!/usr/bin/env bash
# The first thing to run on a CUDA machine (docs/first_gpu_run.md): every stage of the GPU self-test.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${VENV:-$ROOT/.venv}/bin/python"  # PYTHON names setup_env.sh's base Python, not this one
[ -x "$PY" ] || PY="$(command -v python3)"
case "${1:-}" in
  -h|--help)
    cat <<USAGE
Usage: bash scripts/gpu_selftest.sh [--device cuda|cpu] [--quick] [--stages STAGE...] [--work DIR]
                                    [--updates 50] [--min-loss-scale 1] [--methods METHOD...]

About 15 minutes on one GPU (set CUDA_VISIBLE_DEVICES to choose; 2 or more visible GPUs add multi_gpu);
the .venv must hold a CUDA build of torch. Each stage prints PASS/FAIL per check with the measured number
and its threshold:
  env        torch, CUDA, driver, GPUs, compute capability, native bfloat16 (bf16 checks skipped without);
  ops        every method (or --methods) x role x float32/float16/bfloat16 x parallel/looped implementation (and
             fused in float16/bfloat16 where an op has kernels), eval and train mode (EMA statistics, landmark
             redraws, dropout), forward and gradients vs the float64 reference;
  compile    --attention-compile: each method's training step compiled (Triton) vs eager, one graph;
  cuda_graph --attention-cuda-graph: each method's training steps captured and replayed vs eager;
  train      50 --fp16 updates of the sample recipes per attention: loss falls, loss_scale after warm-up
             >= --min-loss-scale (read from this run's TensorBoard), moment statistics finite;
  finetune   scripts/finetune_glue.sh on the SST-2-shaped sample from the train stage's checkpoints;
  eval_lm    scripts/eval_pg19.sh: perplexity at 1x and 2x the training context;
  decode     incremental decoding == full forward on the GPU (padded batch, beam reordering);
  speed      the fused implementation's targets: one module's training step at 32K tokens a step, fp16 and bf16,
             N = 4096 and 16384, against the softmax module (SDPA flash): FAIL over a target's time or 1.5x its
             peak memory; each row names the implementation that ran;
  multi_gpu  2 ranks (torchrun) vs 1 process on the same global batch: moment statistics identical on
             both ranks and equal to the 1-process run's; losses within 2e-3.
Then one line: "gpu_selftest: PASS (...)" or "gpu_selftest: FAIL (...); failed: ...".
Report: DIR/report.md and DIR/report.json [--work runs/gpu_selftest]; each run first removes the previous
run's files there (the prepared samples in DIR/samples are kept).
Exit status 0 = PASS, 1 = a check failed, 2 = no CUDA device (stops at once, naming the torch build).
Without a GPU: --device cpu --quick runs every stage at tiny sizes on the CPU (~5 minutes on 2 cores).
USAGE
    exit 0;;
esac
# the CUDA check comes before fairseq is loaded (linattn_tools.recipes imports no fairseq)
exec "$PY" -m linattn_tools.recipes.gpu_selftest "$@"
