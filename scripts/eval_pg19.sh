#!/usr/bin/env bash
# Perplexity of a PG-19 LM at 1x, 1.5x and 2x its training context (the extrapolation table).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/recipe_lib.sh"

RECIPE_ARGS="CHECKPOINT"
RECIPE_PASSES=fairseq-eval-lm
about() {
  cat <<ABOUT
Run fairseq-eval-lm on CHECKPOINT (from scripts/train_pg19.sh) at each context length of
configs/pg19_lm.yaml eval.contexts (8192, 12288, 16384; SAMPLE=1: 128, 192, 256) in
non-overlapping blocks (--context-window 0), overriding the model's tokens_per_sample and
max_target_positions. Prints the table (context, loss in bits per token, token-level perplexity,
word-level perplexity 2^(loss x tokens / words) with the words of the raw split that
prepare_pg19 wrote beside the data, nan without it) and writes it to OUT/extrapolation.tsv
[OUT: the checkpoint's directory]. The printed table adds LAVO Table 2's perplexity at the same
ratio to the first context ("paper ppl": the paper's row for the attention, softmax's is FlashAttention;
— where the paper has none).
Environment: CONTEXTS ["the config's"], SUBSET [test], CONTEXT_WINDOW [0], DEVICE, SAMPLE, FP16, DATA
(as for the training scripts), ATTN [the checkpoint's decoder attention type] for the paper column.
ABOUT
}
recipe_cli "$@"
[ -f "$CHECKPOINT" ] || die "no checkpoint $CHECKPOINT"
OUT="${OUT:-$(dirname "$CHECKPOINT")}"
DATA_DIR="$(data_dir pg19_lm.yaml)"
read -r -a LENGTHS <<< "${CONTEXTS:-$(config_get pg19_lm.yaml eval.contexts)}"
SUBSET="${SUBSET:-$(config_get pg19_lm.yaml eval.gen-subset)}"
CONTEXT_WINDOW="${CONTEXT_WINDOW:-$(config_get pg19_lm.yaml eval.context-window)}"
device=(); [ "$DEVICE" = cpu ] && device=(--cpu --num-workers 0)
[ "$DEVICE" != cpu ] && [ "$FP16" = 1 ] && device+=(--fp16)
mkdir -p "$OUT"
table="$OUT/extrapolation.tsv"
raw="$(dirname "$DATA_DIR")/raw/pg19.$SUBSET.txt"  # PG-19 reports perplexity per whitespace word
words=0; [ -f "$raw" ] && words="$(wc -w < "$raw")"
printf 'context\tratio\tloss_bits\tppl\tword_ppl\n' > "$table.partial"
for L in "${LENGTHS[@]}"; do
  echo "[recipe] fairseq-eval-lm at context $L" >&2
  # one process (fairseq-eval-lm would shard the set over every visible GPU and report rank 0's
  # share); one L-token sample per batch (a context window pads every sample back to L tokens)
  log="$("$BIN/fairseq-eval-lm" "$DATA_DIR" --path "$CHECKPOINT" --user-dir "$USER_DIR" --gen-subset "$SUBSET" \
    --tokens-per-sample "$L" --max-tokens "$((L - CONTEXT_WINDOW))" --context-window "$CONTEXT_WINDOW" \
    --distributed-world-size 1 \
    --model-overrides "{'tokens_per_sample': $L, 'max_target_positions': $L}" "${device[@]}" "${REST[@]}" 2>&1)" \
    || { echo "$log" | tail -20 >&2; die "fairseq-eval-lm failed at context $L"; }
  result="$(echo "$log" | grep -o 'Loss (base 2): [0-9.e+-]*, Perplexity: \(inf\|[0-9.e+-]*\)' | tail -1 || true)"
  [ -n "$result" ] || { echo "$log" | tail -20 >&2; die "no perplexity in fairseq-eval-lm's output"; }
  loss="$(echo "$result" | sed 's/Loss (base 2): \([^,]*\),.*/\1/')"
  ppl="$(echo "$result" | sed 's/.*Perplexity: //')"
  ratio="$(awk -v l="$L" -v b="${LENGTHS[0]}" 'BEGIN{printf "%.2g", l / b}')"
  tokens="$(echo "$log" | grep -o 'Evaluated [0-9,]* tokens' | tail -1 | awk '{gsub(",", "", $2); print $2}' || true)"
  word_ppl="$(awk -v l="$loss" -v t="${tokens:-0}" -v w="$words" \
    'BEGIN{if (t > 0 && w > 0) printf "%.2f", 2 ^ (l * t / w); else print "nan"}')"
  printf '%s\t%s\t%s\t%s\t%s\n' "$L" "$ratio" "$loss" "$ppl" "$word_ppl" >> "$table.partial"
done
mv "$table.partial" "$table"
"$PY" -m linattn_tools.recipes.report pg19 "$table" --attention "${ATTN:-}" --checkpoint "$CHECKPOINT" \
  || column -t -s $'\t' "$table"
echo "[recipe] table: $table"
