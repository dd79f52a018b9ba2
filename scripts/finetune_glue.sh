#!/usr/bin/env bash
# Fine-tune a pretrained linattn RoBERTa on one GLUE task (configs/glue.yaml).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/recipe_lib.sh"

RECIPE_ARGS="TASK ATTN CHECKPOINT"
about() {
  cat <<ABOUT
Fine-tune CHECKPOINT (from scripts/pretrain_wikitext103.sh ATTN) on TASK (mnli, qnli, qqp, sst2;
with SAMPLE=1: kjv_testament, kjv_next_verse) with fairseq's GLUE settings (lr 1e-5, batch 32,
10 epochs, polynomial decay, 6 % warmup; QQP 25 %, its official value). ATTN must be the attention
the checkpoint was pretrained with (the model is rebuilt from these options, then loaded).
The checkpoint is loaded with --finetune-from-model: only when OUT has no checkpoint_last.pt, so
a restarted job resumes its own fine-tuning. Give the pretraining's other architecture options
(e.g. --lln-diag-block-size) as extra arguments if you changed them.
Best validation accuracy: OUT/checkpoint_best.pt; MNLI validates matched (valid) and mismatched
(valid1). Data: python -m linattn_tools.recipes.prepare_glue --out data-bin/glue
Checkpoints: OUT [checkpoints/glue/TASK/ATTN].

$KNOBS_HELP

Example:
  scripts/finetune_glue.sh mnli lln checkpoints/pretrain_wikitext103/lln/checkpoint_best.pt
ABOUT
}
recipe_cli "$@"
check_attention encoder "$ATTN"
[ -f "$CHECKPOINT" ] || die "no checkpoint $CHECKPOINT"
OUT="${OUT:-$ROOT/checkpoints/glue/$TASK/$ATTN}"
recipe_train glue.yaml --task "$TASK" --data-subdir "$TASK-bin" -- \
  --encoder-attention-type "$ATTN" --finetune-from-model "$CHECKPOINT" "${REST[@]}"
echo "[recipe] best checkpoint: $OUT/checkpoint_best.pt  TensorBoard: ${TB:-$OUT/tb}"
