#!/usr/bin/env bash
# The README's main command: set up .venv (idempotent), then the CPU quick-start on the shipped samples.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "${1:-}" in
  -h|--help)
    cat <<USAGE
Usage: bash scripts/quickstart.sh

On the CPU, with the KJV samples in data/ (configs/quickstart.yaml; about 5-10 minutes on 2 cores):
  1. prepare the samples (SentencePiece, fairseq-preprocess) into SAMPLE_DATA [data-bin/samples];
  2. pretrain a tiny RoBERTa with softmax, LLN and LLN+Diag attention (same seed, same updates);
  3. fine-tune each on the KJV testament classification sample;
  4. train a tiny causal LM with softmax, LLN and LAVO attention, and evaluate it at 1x, 1.5x and
     2x its training context;
  5. write RUN/REPORT.md (tables), loss_curves.png, ppl_vs_context.png; TensorBoard logs in RUN.
Environment: RUN [runs/quickstart] (emptied first), FAST=1 (a few updates per run: a smoke test),
SAMPLE_DATA, OMP_NUM_THREADS [1]. Each step runs the GPU recipe scripts with DEVICE=cpu SAMPLE=1
(which also has glibc keep freed memory: MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_ [2^40]).
USAGE
    exit 0;;
  "") ;;
  *) echo "error: unexpected argument '$1' (see --help)" >&2; exit 2;;
esac
bash "$ROOT/scripts/setup_env.sh"

export DEVICE=cpu SAMPLE=1
# tiny 64-d models: one thread each is fastest (more threads mostly wait on each other)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MKL_NUM_THREADS="${MKL_NUM_THREADS:-1}"
source "$ROOT/scripts/recipe_lib.sh"
RUN="${RUN:-$ROOT/runs/quickstart}"
SIZE=full; [ "${FAST:-0}" = 1 ] && SIZE=fast
q() { config_get quickstart.yaml "$1"; }
SEED="$(q seed)"
PRETRAIN_UPDATES="$(q "$SIZE.pretrain_updates")"
FINETUNE_UPDATES="$(q "$SIZE.finetune_updates")"
LM_UPDATES="$(q "$SIZE.lm_updates")"
TASK="$(q finetune_task)"
read -r -a ENCODERS <<< "$(q pretrain_attentions)"
read -r -a DECODERS <<< "$(q lm_attentions)"

case "$RUN" in ""|/|"$ROOT") die "RUN=$RUN: refusing to empty it";; esac
rm -rf "$RUN"
mkdir -p "$RUN/logs"
started=$(date +%s)

# step NAME COMMAND...: run COMMAND with its output in RUN/logs/NAME.log; one line of progress
step() {
  local name="$1" t0=$SECONDS; shift
  printf '[quickstart] %-34s' "$name" >&2
  if "$@" > "$RUN/logs/$name.log" 2>&1; then
    echo " done ($((SECONDS - t0)) s)" >&2
  else
    echo " FAILED; the end of $RUN/logs/$name.log:" >&2
    tail -30 "$RUN/logs/$name.log" >&2
    exit 1
  fi
}
# schedule UPDATES [decay]: the training length (and the polynomial decay's length with "decay")
schedule() {
  echo --max-update "$1" --warmup-updates "$(($1 / 10 + 1))" --seed "$SEED"
  [ "${2:-}" = decay ] && echo --total-num-update "$1"
  return 0
}

step prepare_samples "$PY" -m linattn_tools.recipes.prepare_samples --out "$SAMPLE_DATA"
for attn in "${ENCODERS[@]}"; do
  OUT="$RUN/pretrain/$attn" step "pretrain_$attn" bash "$ROOT/scripts/pretrain_wikitext103.sh" "$attn" \
    $(schedule "$PRETRAIN_UPDATES" decay)
done
for attn in "${ENCODERS[@]}"; do
  OUT="$RUN/finetune/$attn" step "finetune_${TASK}_$attn" bash "$ROOT/scripts/finetune_glue.sh" "$TASK" "$attn" \
    "$RUN/pretrain/$attn/checkpoint_last.pt" $(schedule "$FINETUNE_UPDATES" decay)
done
for attn in "${DECODERS[@]}"; do
  OUT="$RUN/lm/$attn" step "lm_$attn" bash "$ROOT/scripts/train_pg19.sh" "$attn" \
    $(schedule "$LM_UPDATES")
  OUT="$RUN/lm/$attn" step "lm_${attn}_eval" bash "$ROOT/scripts/eval_pg19.sh" "$RUN/lm/$attn/checkpoint_last.pt"
done

wall=$(( $(date +%s) - started ))
"$PY" -m linattn_tools.recipes.report quickstart "$RUN" \
  --meta "seed=$SEED" --meta "updates (pretrain / fine-tune / LM)=$PRETRAIN_UPDATES / $FINETUNE_UPDATES / $LM_UPDATES" \
  --meta "fine-tuning task=$TASK (data/glue_sample)" --meta "wall time=${wall} s (FAST=${FAST:-0})" \
  --meta "threads (OMP_NUM_THREADS)=$OMP_NUM_THREADS" > /dev/null
echo
cat "$RUN/REPORT.md"
echo "[quickstart] report: $RUN/REPORT.md"
echo "[quickstart] plots: $RUN/loss_curves.png $RUN/ppl_vs_context.png"
echo "[quickstart] TensorBoard logs: tensorboard --logdir $RUN"
