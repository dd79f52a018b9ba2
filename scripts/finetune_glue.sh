#!/usr/bin/env bash
# Fine-tune a pretrained linattn RoBERTa on one GLUE task (configs/glue.yaml).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/recipe_lib.sh"

usage() {
  cat <<USAGE
Usage: scripts/finetune_glue.sh TASK ATTN CHECKPOINT [fairseq-train options...]

Fine-tune CHECKPOINT (from scripts/pretrain_wikitext103.sh ATTN) on TASK (mnli, qnli, qqp, sst2;
with SAMPLE=1: kjv_testament, kjv_next_verse) with fairseq's GLUE settings (lr 1e-5, batch 32,
10 epochs, polynomial decay, 6 % warmup; QQP 25 %, its official value). ATTN must be the attention
the checkpoint was pretrained with (the model is rebuilt from these options, then loaded).
The checkpoint is loaded with --finetune-from-model: only when OUT has no checkpoint_last.pt, so
a restarted job resumes its own fine-tuning. Give the pretraining's other architecture options
(e.g. --lln-diag-block-size) as extra arguments if you changed them.
Best validation accuracy: OUT/checkpoint_best.pt; MNLI validates matched (valid) and mismatched
(valid1). Data: python -m fairseq_linattn.recipes.prepare_glue --out data-bin/glue
Checkpoints: OUT [checkpoints/glue/TASK/ATTN].

$KNOBS_HELP

Example:
  scripts/finetune_glue.sh mnli lln checkpoints/pretrain_wikitext103/lln/checkpoint_best.pt
USAGE
}
case "${1:-}" in -h|--help|"") usage; [ -n "${1:-}" ]; exit $?;; esac
[ $# -ge 3 ] || { usage >&2; exit 2; }
TASK="$1"; ATTN="$2"; CHECKPOINT="$3"; shift 3
check_attention "$ATTN"
[ -f "$CHECKPOINT" ] || die "no checkpoint $CHECKPOINT"
OUT="${OUT:-$ROOT/checkpoints/glue/$TASK/$ATTN}"
config_args glue.yaml --task "$TASK"
DATA_DIR="$(data_dir glue.yaml "$TASK-bin")"
train "$DATA_DIR" "${ARGS[@]}" --encoder-attention-type "$ATTN" --finetune-from-model "$CHECKPOINT" "$@"
echo "[recipe] best checkpoint: $OUT/checkpoint_best.pt  TensorBoard: ${TB:-$OUT/tb}"
