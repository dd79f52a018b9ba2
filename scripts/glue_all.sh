#!/usr/bin/env bash
# Fine-tune one pretrained checkpoint on every GLUE task of configs/glue.yaml; print a summary table.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/recipe_lib.sh"

RECIPE_ARGS="ATTN CHECKPOINT"
about() {
  cat <<ABOUT
Run scripts/finetune_glue.sh for MNLI, QNLI, QQP and SST-2 (SAMPLE=1: the two KJV sample tasks) one
after the other, then print the best validation accuracies as a row like LLN Table 1 (MNLI as
matched/mismatched), each beside the paper's figure for ATTN ("TASK paper": LLN Table 1's SA
baseline, LLN or LLN+Diag row; — where it has none), and write it to OUT_ROOT/summary_ATTN.md.
Runs go to OUT_ROOT/TASK/ATTN [OUT_ROOT: checkpoints/glue]; a finished task is not run again
(remove its directory to redo it). Other knobs as for scripts/finetune_glue.sh:

$KNOBS_HELP
ABOUT
}
recipe_cli "$@"
check_attention encoder "$ATTN"
OUT_ROOT="${OUT_ROOT:-$ROOT/checkpoints/glue}"
read -r -a TASKS <<< "$(config_get glue.yaml tasks)"
runs=()
for TASK in "${TASKS[@]}"; do
  run="$OUT_ROOT/$TASK/$ATTN"
  runs+=("$run")
  if [ -f "$run/finished" ]; then echo "[recipe] $TASK: finished already ($run)"; continue; fi
  OUT="$run" TB="${TB:+$TB/$TASK}" bash "$ROOT/scripts/finetune_glue.sh" "$TASK" "$ATTN" "$CHECKPOINT" "${REST[@]}"
  touch "$run/finished"
done
summary="$("$PY" -m linattn_tools.recipes.report glue --attention "$ATTN" "${runs[@]}")"
echo "$summary" | tee "$OUT_ROOT/summary_$ATTN.md"
