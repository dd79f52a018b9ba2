# Sourced by the recipe scripts: environment knobs, the config's fairseq options, the launcher.
# (Not a command. Every knob has a default; `SCRIPT --help` lists them.)

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
BIN="$(dirname "$PY")"
USER_DIR="$ROOT/fairseq_linattn"
CONFIGS="$ROOT/configs"

DEVICE="${DEVICE:-gpu}"
SAMPLE="${SAMPLE:-0}"
SAMPLE_DATA="${SAMPLE_DATA:-$ROOT/data-bin/samples}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-localhost}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [ "$DEVICE" = cpu ]; then
  GPUS_PER_NODE=1
  FP16="${FP16:-0}"
else
  # torch's count follows CUDA_VISIBLE_DEVICES (nvidia-smi -L lists every GPU of the machine)
  GPUS_PER_NODE="${GPUS_PER_NODE:-$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || true)}"
  [ "${GPUS_PER_NODE:-0}" -ge 1 ] 2>/dev/null || GPUS_PER_NODE=1
  FP16="${FP16:-1}"
fi
WORLD=$((GPUS_PER_NODE * NNODES))

KNOBS_HELP="Environment (defaults in brackets):
  DEVICE=gpu|cpu [gpu]        SAMPLE=1: the shipped samples in data/, a tiny model, a handful of
                              updates (prepared into SAMPLE_DATA [data-bin/samples] when missing) [0]
  GPUS_PER_NODE [all visible GPUs]  NNODES [1]  NODE_RANK [0]  MASTER_ADDR [localhost]
  MASTER_PORT [29500]         (more than one GPU in all: torchrun with a c10d rendezvous)
  PER_DEVICE                  per-GPU batch (sequences, or tokens for the LM) [the config's]
  UPDATE_FREQ                 [computed so that PER_DEVICE x GPUs x nodes x UPDATE_FREQ keeps the
                              paper's batch]
  FP16=1|0 [1 on GPU]         DATA [the config's data directory]
  OUT [checkpoints/...]       TB: TensorBoard directory [\$OUT/tb]
Arguments after the positional ones go to fairseq unchanged (later options win)."

# die MESSAGE: print to stderr and exit 2
die() { echo "error: $*" >&2; exit 2; }

# check_attention NAME: one of the plugin's attention types (a comma list per layer is allowed)
check_attention() {
  local t
  for t in ${1//,/ }; do
    case "$t" in softmax|lln|lln_diag|skyformer|kernelized|lavo) ;;
      *) die "attention '$t': allowed: softmax, lln, lln_diag, skyformer, kernelized, lavo (or a comma list)";;
    esac
  done
}

# config_get CONFIG KEY: a value of configs/CONFIG (its sample section merged when SAMPLE=1)
config_get() {
  local sample=(); [ "$SAMPLE" = 1 ] && sample=(--sample)
  "$PY" "$ROOT/fairseq_linattn/recipes/config.py" get "$CONFIGS/$1" "$2" "${sample[@]}"
}

# config_args CONFIG [--task T]: fills the array ARGS with the config's fairseq-train options
config_args() {
  local extra=(--devices "$WORLD")
  [ "$SAMPLE" = 1 ] && extra+=(--sample)
  if [ "$DEVICE" = cpu ] || [ "$FP16" = 0 ]; then extra+=(--no-fp16); fi
  [ -n "${PER_DEVICE:-}" ] && extra+=(--per-device "$PER_DEVICE")
  [ -n "${UPDATE_FREQ:-}" ] && extra+=(--update-freq "$UPDATE_FREQ")
  mapfile -t ARGS < <("$PY" "$ROOT/fairseq_linattn/recipes/config.py" args "$CONFIGS/$1" "${extra[@]}" "${@:2}")
  [ "${#ARGS[@]}" -gt 0 ] || die "could not read $CONFIGS/$1"
  [ "$DEVICE" = cpu ] && ARGS+=(--cpu)
  return 0
}

# data_dir CONFIG [SUBDIR]: DATA (or the config's data; under SAMPLE_DATA, prepared when missing, if
# SAMPLE=1), followed by /SUBDIR when given
data_dir() {
  local base rel sub="${2:+/$2}"
  if [ -n "${DATA:-}" ]; then echo "$DATA$sub"; return; fi
  rel="$(config_get "$1" data)"
  if [ "$SAMPLE" = 1 ]; then
    if [ ! -f "$SAMPLE_DATA/$rel$sub/.done" ]; then
      "$PY" -m fairseq_linattn.recipes.prepare_samples --out "$SAMPLE_DATA" >&2 || die "preparing the samples failed"
    fi
    base="$SAMPLE_DATA/$rel"
  else
    case "$rel" in /*) base="$rel";; *) base="$ROOT/$rel";; esac
  fi
  [ -d "$base$sub" ] || die "no data directory $base$sub (prepare it first, or set DATA)"
  echo "$base$sub"
}

# train ARGS...: fairseq-train on this machine, or torchrun over GPUS_PER_NODE x NNODES processes;
# its output is also appended to OUT/train.log (fairseq's own --log-file repeats lines)
train() {
  mkdir -p "$OUT"
  local common=(--user-dir "$USER_DIR" --save-dir "$OUT" --tensorboard-logdir "${TB:-$OUT/tb}")
  echo "[recipe] fairseq-train $* ${common[*]}" >&2
  if [ "$WORLD" -gt 1 ]; then
    "$PY" -m torch.distributed.run --nnodes "$NNODES" --nproc_per_node "$GPUS_PER_NODE" \
      --rdzv_backend c10d --rdzv_endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv_id "${RDZV_ID:-linattn}" \
      -m fairseq_cli.train "$@" "${common[@]}" --distributed-world-size "$WORLD" 2>&1 | tee -a "$OUT/train.log"
  else  # one process: fairseq would otherwise start one per visible GPU (the batch is split for one)
    "$BIN/fairseq-train" "$@" "${common[@]}" --distributed-world-size 1 2>&1 | tee -a "$OUT/train.log"
  fi
}
