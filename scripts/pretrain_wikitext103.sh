#!/usr/bin/env bash
# RoBERTa-base masked-LM pretraining on WikiText-103 with one attention (configs/pretrain_wikitext103.yaml).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/recipe_lib.sh"

RECIPE_ARGS="ATTN"
about() {
  cat <<ABOUT
Pretrain linattn_roberta_base (fairseq's RoBERTa-base recipe: 512 tokens, 2048 sequences per
update, lr 5e-4, 10k warmup, 125k updates) with --encoder-attention-type ATTN (an encoder type:
python -m linattn_tools.methods_cli list --role encoder; or a comma list, one per layer).
Data: python -m linattn_tools.recipes.prepare_wikitext103 --out data-bin/wikitext-103
Checkpoints: OUT [checkpoints/pretrain_wikitext103/ATTN].

$KNOBS_HELP

Examples:
  GPUS_PER_NODE=8 scripts/pretrain_wikitext103.sh lln
  DEVICE=cpu SAMPLE=1 scripts/pretrain_wikitext103.sh softmax,lln   # a few CPU updates on data/
ABOUT
}
recipe_cli "$@"
check_attention encoder "$ATTN"
OUT="${OUT:-$ROOT/checkpoints/pretrain_wikitext103/$ATTN}"
recipe_train pretrain_wikitext103.yaml -- --encoder-attention-type "$ATTN" "${REST[@]}"
echo "[recipe] checkpoints: $OUT  TensorBoard: ${TB:-$OUT/tb}"
