#!/usr/bin/env bash
# Train the GPT-2-small-sized causal LM on PG-19 with one decoder attention (configs/pg19_lm.yaml).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/recipe_lib.sh"

RECIPE_ARGS="ATTN"
about() {
  cat <<ABOUT
Train linattn_lm_gpt (12 layers, 768-d) on PG-19 with --decoder-attention-type ATTN (a causal type:
python -m linattn_tools.methods_cli list --role decoder; or a comma list, one per layer): LAVO's setting, context 8192,
2^17 tokens per update, AdamW (0.9, 0.999), wd 0.01, lr 5e-4 inverse-sqrt after 10k warmup, 125k updates, dropout
0.1. An all-LAVO model has no token position embeddings (LAVO §4.1). Then: scripts/eval_pg19.sh.
Data: python -m linattn_tools.recipes.prepare_pg19 --source DIR --out data-bin/pg19
Checkpoints: OUT [checkpoints/pg19/ATTN].

$KNOBS_HELP

Examples:
  GPUS_PER_NODE=8 scripts/train_pg19.sh lavo
  NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 GPUS_PER_NODE=8 scripts/train_pg19.sh lln   # on node0; NODE_RANK=1 on the other
ABOUT
}
recipe_cli "$@"
check_attention decoder "$ATTN"
OUT="${OUT:-$ROOT/checkpoints/pg19/$ATTN}"
recipe_train pg19_lm.yaml -- --decoder-attention-type "$ATTN" "${REST[@]}"
echo "[recipe] checkpoints: $OUT  TensorBoard: ${TB:-$OUT/tb}  next: scripts/eval_pg19.sh $OUT/checkpoint_best.pt"
