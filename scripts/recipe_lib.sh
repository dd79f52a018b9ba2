# Sourced by the recipe scripts: what they all do (usage, arguments, environment knobs, the config's
# fairseq options, the torchrun or one-process launch, the log). Not a command.
#
# Sourcing it only sets variables and defines functions: no Python runs until a recipe checks its
# arguments or launches, so `SCRIPT --help` works without one. A recipe script declares what is its
# own and calls the runner:
#
#   RECIPE_ARGS="TASK ATTN CHECKPOINT"  its positional arguments (recipe_cli sets these variables)
#   RECIPE_PASSES=fairseq-train         where the arguments after them go [fairseq-train]
#   about() { cat <<ABOUT ... ABOUT; }  the usage after the "Usage:" line ($KNOBS_HELP: the knobs)
#   recipe_cli "$@"                     -h/--help, too few arguments; sets the positionals and REST
#   check_attention encoder "$ATTN"     the attention type, as the plugin's registry says
#   OUT="${OUT:-$ROOT/checkpoints/...}" where the run goes
#   recipe_train CONFIG [--task T] [--data-subdir D] -- OPTIONS...
#                                       the config's options + OPTIONS, launched, logged to OUT/train.log

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${VENV:-$ROOT/.venv}/bin/python"  # PYTHON names setup_env.sh's base Python, not this one
[ -x "$PY" ] || PY="$(command -v python3 || echo python3)"
BIN="${PY%/*}"
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
  FP16="${FP16:-0}"
  # glibc keeps freed memory: large temporaries are not page-faulted in again (linattn_tools/malloc.py)
  export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-1099511627776}"
  export MALLOC_TRIM_THRESHOLD_="${MALLOC_TRIM_THRESHOLD_:-1099511627776}"
else
  FP16="${FP16:-1}"
fi
RECIPE_PASSES=fairseq-train

KNOBS_HELP="Environment (defaults in brackets):
  DEVICE=gpu|cpu [gpu]        SAMPLE=1: the shipped samples in data/, a tiny model, a handful of
                              updates (prepared into SAMPLE_DATA [data-bin/samples] when missing) [0]
  GPUS_PER_NODE [all visible GPUs]  NNODES [1]  NODE_RANK [0]: this node's rank  MASTER_ADDR [localhost]
  MASTER_PORT [29500]         (more than one GPU in all: torchrun, static rendezvous at node 0's
                              MASTER_ADDR:MASTER_PORT; start the same command on every node)
  DRY_RUN=1                   print the launch command (torchrun's or fairseq-train's) and run nothing
  PER_DEVICE                  per-GPU batch (sequences, or tokens for the LM) [the config's]
  UPDATE_FREQ                 [computed so that PER_DEVICE x GPUs x nodes x UPDATE_FREQ keeps the
                              paper's batch]
  FP16=1|0 [1 on GPU]         DATA [the config's data directory]
  MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_  [2^40 with DEVICE=cpu: glibc keeps freed memory,
                              1.2-1.5x faster linear attention on long sequences; see docs/benchmarks.md]
  OUT [checkpoints/...]       TB: TensorBoard directory [\$OUT/tb]
Arguments after the positional ones go to fairseq unchanged (later options win).
Log: OUT/train.log, this run's output only; a rerun into the same OUT first moves the earlier log
to OUT/train.log.1 (then .2, .3, ...: numbered in the order they were written)."

# die MESSAGE: print to stderr and exit 2
die() { echo "error: $*" >&2; exit 2; }

# recipe_usage: "Usage: scripts/NAME RECIPE_ARGS [RECIPE_PASSES options...]", then the script's about
recipe_usage() {
  echo "Usage: scripts/${0##*/} $RECIPE_ARGS [$RECIPE_PASSES options...]"
  echo
  about
}

# recipe_cli "$@": -h/--help prints the usage (exit 0); fewer arguments than RECIPE_ARGS names print
# it to stderr (exit 2). Otherwise sets each variable RECIPE_ARGS names from the positional arguments
# and the array REST to the arguments after them (for RECIPE_PASSES).
recipe_cli() {
  local names i value
  read -r -a names <<< "$RECIPE_ARGS"
  case "${1:-}" in -h|--help) recipe_usage; exit 0;; esac
  if [ $# -lt "${#names[@]}" ]; then recipe_usage >&2; exit 2; fi
  for i in "${!names[@]}"; do
    value="${*:i+1:1}"
    case "$value" in  # an option where a positional argument belongs: a mistake
      -*) die "expected ${names[$i]} before the $RECIPE_PASSES options, got '$value' (see --help)";;
    esac
    printf -v "${names[$i]}" '%s' "$value"
  done
  REST=("${@:${#names[@]}+1}")
}

# check_attention ROLE TYPES: TYPES is an attention type (or a comma list, one per layer) the plugin
# takes for ROLE (encoder, decoder or cross), as its registry says (`python -m linattn_tools.methods_cli
# check`); otherwise the registry's message (naming the option and the allowed values) and exit 2.
# Pretraining and GLUE check encoder types, the PG-19 LM decoder types.
check_attention() {
  local out rc=0
  out="$(PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m linattn_tools.methods_cli check \
    --role "$1" "$2" 2>&1)" || rc=$?
  case "$rc" in
    0) return 0;;
    2) echo "$out" >&2; exit 2;;
    *) [ -z "$out" ] || echo "$out" | tail -5 >&2
       die "could not check the $1 attention type '$2' ($PY -m linattn_tools.methods_cli check: exit $rc)";;
  esac
}

# recipe_devices: GPUS_PER_NODE (unset: torch's count of the visible GPUs, at least 1; 1 on the CPU)
# and WORLD = GPUS_PER_NODE x NNODES. Run when launching, not when sourced (it asks torch).
recipe_devices() {
  [ -z "${_RECIPE_DEVICES:-}" ] || return 0
  if [ "$DEVICE" = cpu ]; then
    GPUS_PER_NODE=1
  else
    # torch's count follows CUDA_VISIBLE_DEVICES (nvidia-smi -L lists every GPU of the machine)
    GPUS_PER_NODE="${GPUS_PER_NODE:-$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || true)}"
    [ "${GPUS_PER_NODE:-0}" -ge 1 ] 2>/dev/null || GPUS_PER_NODE=1
  fi
  WORLD=$((GPUS_PER_NODE * NNODES))
  _RECIPE_DEVICES=1
}

# config_get CONFIG KEY: a value of configs/CONFIG (its sample section merged when SAMPLE=1)
config_get() {
  local sample=(); [ "$SAMPLE" = 1 ] && sample=(--sample)
  "$PY" -m linattn_tools.recipes.config get "$CONFIGS/$1" "$2" "${sample[@]}"
}

# config_args CONFIG [--task T]: fills the array ARGS with the config's fairseq-train options
config_args() {
  recipe_devices
  local extra=(--devices "$WORLD" --device gpu)
  [ "$DEVICE" = cpu ] && extra=(--devices "$WORLD" --device cpu)  # --cpu, no fp16 options
  [ "$SAMPLE" = 1 ] && extra+=(--sample)
  [ "$FP16" = 0 ] && extra+=(--no-fp16)
  [ -n "${PER_DEVICE:-}" ] && extra+=(--per-device "$PER_DEVICE")
  [ -n "${UPDATE_FREQ:-}" ] && extra+=(--update-freq "$UPDATE_FREQ")
  mapfile -t ARGS < <("$PY" -m linattn_tools.recipes.config args "$CONFIGS/$1" "${extra[@]}" "${@:2}")
  [ "${#ARGS[@]}" -gt 0 ] || die "could not read $CONFIGS/$1"
  return 0
}

# data_dir CONFIG [SUBDIR]: DATA (or the config's data; under SAMPLE_DATA, prepared when missing, if
# SAMPLE=1), followed by /SUBDIR when given
data_dir() {
  local base rel sub="${2:+/$2}"
  rel="$(config_get "$1" data)"
  if [ -n "${DATA:-}" ]; then
    base="$DATA"
  elif [ "$SAMPLE" = 1 ]; then
    if [ ! -f "$SAMPLE_DATA/$rel$sub/.done" ]; then
      "$PY" -m linattn_tools.recipes.prepare_samples --out "$SAMPLE_DATA" >&2 || die "preparing the samples failed"
    fi
    base="$SAMPLE_DATA/$rel"
  else
    case "$rel" in /*) base="$rel";; *) base="$ROOT/$rel";; esac
  fi
  if [ ! -d "$base$sub" ]; then  # DRY_RUN prints the command before the data is there
    [ "${DRY_RUN:-0}" = 1 ] || die "no data directory $base$sub (prepare it first, or set DATA)"
    echo "[recipe] note: no data directory $base$sub yet (prepare it first, or set DATA)" >&2
  fi
  echo "$base$sub"
}

# fresh_log FILE: an earlier FILE moves to FILE.N (the first free N = 1, 2, ...), so FILE starts empty
fresh_log() {
  local n=1
  [ -e "$1" ] || return 0
  while [ -e "$1.$n" ]; do n=$((n + 1)); done
  mv "$1" "$1.$n"
}

# launch_train ARGS...: fairseq-train on this machine, or torchrun over GPUS_PER_NODE x NNODES
# processes; its output also goes to OUT/train.log, started afresh (fairseq's own --log-file repeats
# lines)
launch_train() {
  recipe_devices
  local common=(--user-dir "$USER_DIR" --save-dir "$OUT" --tensorboard-logdir "${TB:-$OUT/tb}") cmd
  if [ "$WORLD" -gt 1 ]; then  # torchrun's static rendezvous: this node is NODE_RANK of NNODES, rank 0 at MASTER_ADDR
    [ "$NODE_RANK" -ge 0 ] 2>/dev/null && [ "$NODE_RANK" -lt "$NNODES" ] \
      || die "NODE_RANK must be an integer in [0, NNODES = $NNODES), got '$NODE_RANK'"
    cmd=("$PY" -m torch.distributed.run --nnodes "$NNODES" --node_rank "$NODE_RANK" --nproc_per_node "$GPUS_PER_NODE"
         --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
         -m fairseq_cli.train "$@" "${common[@]}" --distributed-world-size "$WORLD")
  else  # one process: fairseq would otherwise start one per visible GPU (the batch is split for one)
    cmd=("$BIN/fairseq-train" "$@" "${common[@]}" --distributed-world-size 1)
  fi
  if [ "${DRY_RUN:-0}" = 1 ]; then  # the command, one shell-quoted line, and nothing run
    printf '%q ' "${cmd[@]}"; echo
    return 0
  fi
  mkdir -p "$OUT"
  fresh_log "$OUT/train.log"
  echo "[recipe] fairseq-train $* ${common[*]}" >&2
  "${cmd[@]}" 2>&1 | tee "$OUT/train.log"
}

# recipe_train CONFIG [--task T] [--data-subdir D] -- OPTIONS...: the runner. fairseq-train on the
# data of configs/CONFIG (DATA, or the config's; /D after it) with the config's options (for task T),
# then OPTIONS (the recipe's own, then the user's: later options win), into OUT
recipe_train() {
  local config="$1" task=() sub="" data
  shift
  while [ "${1:-}" != -- ]; do
    case "${1:-}" in
      --task) task=(--task "$2"); shift 2;;
      --data-subdir) sub="$2"; shift 2;;
      *) die "recipe_train: unexpected '${1:-}' (options end with --)";;
    esac
  done
  shift
  config_args "$config" "${task[@]}"
  data="$(data_dir "$config" "$sub")"
  launch_train "$data" "${ARGS[@]}" "$@"
}
