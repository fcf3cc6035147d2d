#!/usr/bin/env bash
# Extend Qwen2.5-3B from 32K to 512K tokens with MTraining's sparse attention: one node, torchrun.
#
#   CHECKPOINT=checkpoints/qwen2.5-3b-mcore DATA_PREFIX=data/long_docs bash examples/qwen2.5-3b_32k_to_512k.sh
#   bash examples/qwen2.5-3b_32k_to_512k.sh --dry-run     # or DRY_RUN=1: print the command, run nothing
#   bash examples/qwen2.5-3b_32k_to_512k.sh --check       # or CHECK=1: print it, then validate it on this machine
#
# CHECKPOINT is the directory written by tools/convert_qwen2_hf_to_megatron.py; its megatron_model_args.sh
# supplies the model flags and the tokenizer. DATA_PREFIX is the --output-prefix of tools/preprocess_data.py
# (or MOCK_DATA=1 for synthetic data). Training checkpoints go to SAVE_DIR, from which a rerun resumes.
# A dry run or check needs neither: without CHECKPOINT the model flags come from examples/models/$MODEL.sh and
# the command has no --pretrained-checkpoint; without data it uses --mock-data (both said in a comment line).
# The check runs `WORLD_SIZE=<GPUs> $PYTHON -m megatron_mtraining.pretrain --mtraining-check <the flags>`: the
# launcher parses and validates the command as the run would, on CPU, and reads no checkpoint or data.
#
# The GPUs (GPUS_PER_NODE x NNODES) are split into TP x PP x CP x DP (Megatron's order tp-cp-ep-dp-pp). Each
# SEQ_LEN-token sequence is split over the CP ranks in MTraining's striped layout (LAYOUT). A CP group either fits in a
# node (flat ring) or spans whole nodes (examples/slurm/*.sbatch sets NNODES, NODE_RANK and MASTER_ADDR): then
# the ring is hierarchical, an inner ring over the CP ranks of a node inside an outer ring over the nodes.
#
# Settings (environment variables, default):
#   MODEL (qwen2.5-3b)            model size (qwen2.5-0.5b/1.5b/3b/7b, qwen3-0.6b/1.7b/4b/8b): examples/models/
#                                 $MODEL.sh gives the model flags when CHECKPOINT is unset; it also names SAVE_DIR's
#                                 default
#   CHECKPOINT                    converted checkpoint (required for a run, not for --dry-run / --check)
#   TOKENIZER                     replaces the model flags' --tokenizer-model (presets: the hub name, e.g.
#                                 Qwen/Qwen2.5-3B; a checkpoint: the Hugging Face directory it was converted from)
#   DATA_PREFIX, MOCK_DATA (0)    training data, or MOCK_DATA=1 for synthetic data (one is required for a run)
#   SPLIT (98,2,0)                train,valid,test percentages of DATA_PREFIX's documents (integers, sum 100)
#   PACKED_DOCUMENTS (0)          1: packed documents, each sequence's documents kept apart (--reset-attention-mask
#                                 --reset-position-ids --no-rope-fusion --eod-mask-loss): a document ends at each
#                                 end-of-document token (tools/preprocess_data.py appends one to every document),
#                                 attends only within itself, its RoPE positions restart at 0, its EOD has no loss
#   MIN_SPARSE_LENGTH             with PACKED_DOCUMENTS=1: documents of at least this many tokens get their own
#                                 sparse index, shorter ones are attended densely (--mtraining-min-sparse-length;
#                                 unset: the launcher's default)
#   LAYOUT (striped; skewed with PACKED_DOCUMENTS=1)   --mtraining-layout, how each sequence is split over the
#                                 CP ranks: skewed also balances packed documents of one length (docs/benchmarks.md,
#                                 "Skewed stripes"); zigzag and contiguous are accepted too
#   EVAL_INTERVAL (100), EVAL_ITERS (1)   validation every EVAL_INTERVAL iterations, EVAL_ITERS batches each
#                                 (EVAL_ITERS=0: no validation)
#   SEQ_LEN (524288), GLOBAL_BATCH_SIZE (8), TRAIN_ITERS (1000), LR (1e-5), MIN_LR (1e-6), WARMUP_ITERS (20)
#   BUDGET (top-p)                top-p: per-head budgets covering TOP_P (0.9) of the attention mass;
#                                 static: SPARSITY (0.95, the benchmarks' budget) or VERTICAL_SIZE + SLASH_SIZE
#   BLOCK_SLASHES (0), CAP        top-p only: BLOCK_SLASHES=1 ranks whole 128-token block diagonals
#                                 (--mtraining-block-slashes); CAP caps each head's verticals and diagonals
#                                 (--mtraining-cap; unset: the launcher's 4096). The quality study's choice from
#                                 64K on: BLOCK_SLASHES=1 CAP=128 (docs/benchmarks.md, "Capped top-P")
#   GPUS_PER_NODE (8), NNODES (1), NODE_RANK (0), MASTER_ADDR (localhost), MASTER_PORT (6000)
#   TP (1), PP (1), CP (GPUs / (TP x PP))   tensor, pipeline and context parallel sizes; TP divides
#                                 GPUS_PER_NODE; DP = GPUs / (TP x PP x CP) must be a whole number
#   SAVE_DIR (checkpoints/$MODEL-<SEQ_LEN/1024>k), SAVE_INTERVAL (100), LOSS_CHUNK_SIZE (8192)
#   PYTHON (python), EXTRA_ARGS (appended to the launcher's flags, e.g. --transformer-impl local)
set -euo pipefail

EXAMPLES=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MODELS_DIR="$EXAMPLES/models"
MODEL_ARGS_FILE=megatron_model_args.sh

fail() {
  echo "$(basename "$0"): error: $*" >&2
  exit 2
}

# ------------------------------------------------------------------------------------------ mode
usage="usage: $0 [--dry-run | --check]  (settings are environment variables, see the header of $0)"
DRY_RUN=${DRY_RUN:-0}
CHECK=${CHECK:-0}
[[ "$DRY_RUN" == [01] ]] || fail "DRY_RUN=$DRY_RUN must be 0 or 1"
[[ "$CHECK" == [01] ]] || fail "CHECK=$CHECK must be 0 or 1"
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --check) CHECK=1 ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
done
if (( DRY_RUN && CHECK )); then
  fail "--dry-run (DRY_RUN=1) and --check (CHECK=1) together; pick one (--check also prints the command)"
fi
PRINT_ONLY=$(( DRY_RUN || CHECK ))

# ------------------------------------------------------------------------------------------ settings
require_integer() {     # NAME MINIMUM: the variable NAME holds an integer >= MINIMUM
  local value=${!1}
  [[ "$value" =~ ^(0|[1-9][0-9]*)$ ]] && (( value >= $2 )) || fail "$1=$value must be an integer >= $2"
}
require_number() {      # NAME: the variable NAME holds a decimal number such as 1e-5 or 0.9
  [[ "${!1}" =~ ^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$ ]] || fail "$1=${!1} must be a number, e.g. 1e-5 or 0.9"
}
number_satisfies() {    # VALUE CONDITION: awk's CONDITION on x holds for the number VALUE
  awk -v x="$1" "BEGIN { exit !($2) }"
}

MODEL=${MODEL:-qwen2.5-3b}
SEQ_LEN=${SEQ_LEN:-524288}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-1}
PP=${PP:-1}
GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-8}
TRAIN_ITERS=${TRAIN_ITERS:-1000}
LR=${LR:-1e-5}
MIN_LR=${MIN_LR:-1e-6}
WARMUP_ITERS=${WARMUP_ITERS:-20}
SAVE_INTERVAL=${SAVE_INTERVAL:-100}
EVAL_INTERVAL=${EVAL_INTERVAL:-100}
EVAL_ITERS=${EVAL_ITERS:-1}
SPLIT=${SPLIT:-98,2,0}
BUDGET=${BUDGET:-top-p}
LOSS_CHUNK_SIZE=${LOSS_CHUNK_SIZE:-8192}
MOCK_DATA=${MOCK_DATA:-0}
PACKED_DOCUMENTS=${PACKED_DOCUMENTS:-0}
if [[ "$PACKED_DOCUMENTS" == 1 ]]; then LAYOUT=${LAYOUT:-skewed}; else LAYOUT=${LAYOUT:-striped}; fi
PYTHON=${PYTHON:-python}

for name in SEQ_LEN GPUS_PER_NODE NNODES TP PP GLOBAL_BATCH_SIZE TRAIN_ITERS SAVE_INTERVAL EVAL_INTERVAL \
            MASTER_PORT; do
  require_integer "$name" 1
done
for name in NODE_RANK WARMUP_ITERS EVAL_ITERS LOSS_CHUNK_SIZE; do
  require_integer "$name" 0
done
SAVE_DIR=${SAVE_DIR:-checkpoints/$MODEL-$(( SEQ_LEN / 1024 ))k}     # after SEQ_LEN is known to be a number
require_number LR
require_number MIN_LR
[[ "$MOCK_DATA" == [01] ]] || fail "MOCK_DATA=$MOCK_DATA must be 0 or 1"
[[ "$PACKED_DOCUMENTS" == [01] ]] || fail "PACKED_DOCUMENTS=$PACKED_DOCUMENTS must be 0 or 1"
[[ "$LAYOUT" =~ ^(striped|skewed|zigzag|contiguous)$ ]] ||
  fail "LAYOUT=$LAYOUT must be striped, skewed, zigzag or contiguous"
if [[ -n "${MIN_SPARSE_LENGTH:-}" ]]; then
  [[ "$PACKED_DOCUMENTS" == 1 ]] ||
    fail "MIN_SPARSE_LENGTH=$MIN_SPARSE_LENGTH is a packed-documents setting, but PACKED_DOCUMENTS=$PACKED_DOCUMENTS;" \
         "add PACKED_DOCUMENTS=1 or unset MIN_SPARSE_LENGTH"
  require_integer MIN_SPARSE_LENGTH 1
fi
(( NODE_RANK < NNODES )) || fail "NODE_RANK=$NODE_RANK must be below NNODES=$NNODES"

# ------------------------------------------------------------------------------------------ model
available_models() {
  local preset names=()
  for preset in "$MODELS_DIR"/*.sh; do
    names+=("$(basename "$preset" .sh)")
  done
  echo "${names[*]}"
}
[[ "$MODEL" =~ ^[A-Za-z0-9._-]+$ && -f "$MODELS_DIR/$MODEL.sh" ]] ||
  fail "MODEL=$MODEL is not a model preset of $MODELS_DIR; use one of: $(available_models)"
if [[ -n "${CHECKPOINT:-}" ]]; then
  [[ -f "$CHECKPOINT/$MODEL_ARGS_FILE" ]] ||
    fail "CHECKPOINT=$CHECKPOINT has no $MODEL_ARGS_FILE; give the --output-dir of" \
         "tools/convert_qwen2_hf_to_megatron.py"
  source "$CHECKPOINT/$MODEL_ARGS_FILE"      # defines MODEL_ARGS
  MODEL_SOURCE="$CHECKPOINT/$MODEL_ARGS_FILE"
  CHECKPOINT_ARGS=(--pretrained-checkpoint "$CHECKPOINT")
elif (( PRINT_ONLY )); then
  source "$MODELS_DIR/$MODEL.sh"             # defines MODEL_ARGS
  MODEL_SOURCE="examples/models/$MODEL.sh (no CHECKPOINT: no --pretrained-checkpoint; a run needs CHECKPOINT)"
  CHECKPOINT_ARGS=()
else
  fail "set CHECKPOINT to the directory written by tools/convert_qwen2_hf_to_megatron.py (--dry-run and --check" \
       "work without one)"
fi
if [[ -n "${TOKENIZER:-}" ]]; then
  replaced=0
  for index in "${!MODEL_ARGS[@]}"; do
    if [[ "${MODEL_ARGS[index]}" == --tokenizer-model ]]; then
      MODEL_ARGS[index + 1]=$TOKENIZER
      replaced=1
    fi
  done
  (( replaced )) || fail "TOKENIZER=$TOKENIZER: $MODEL_SOURCE has no --tokenizer-model to replace; add" \
                         "--tokenizer-model through EXTRA_ARGS instead"
fi

# ------------------------------------------------------------------------------------------ parallel layout
GPU_COUNT=$(( GPUS_PER_NODE * NNODES ))
(( GPUS_PER_NODE % TP == 0 )) ||
  fail "TP=$TP must divide GPUS_PER_NODE=$GPUS_PER_NODE (tensor parallelism stays inside a node)"
(( GPU_COUNT % (TP * PP) == 0 )) ||
  fail "TP=$TP x PP=$PP must divide the $GPU_COUNT GPUs (GPUS_PER_NODE=$GPUS_PER_NODE x NNODES=$NNODES)"
CP=${CP:-$(( GPU_COUNT / (TP * PP) ))}
require_integer CP 1
(( GPU_COUNT / (TP * PP) % CP == 0 )) ||
  fail "CP=$CP must divide GPUs / (TP x PP) = $GPU_COUNT / ($TP x $PP) = $(( GPU_COUNT / (TP * PP) )) so that" \
       "DP = GPUs / (TP x PP x CP) is a whole number"
DP=$(( GPU_COUNT / (TP * PP * CP) ))
(( GLOBAL_BATCH_SIZE % DP == 0 )) ||
  fail "GLOBAL_BATCH_SIZE=$GLOBAL_BATCH_SIZE must be a multiple of DP=$DP (one sequence per micro-batch)"

CP_SPAN=$(( TP * CP ))      # consecutive ranks of one CP group (with its TP ranks)
if (( GPUS_PER_NODE % CP_SPAN == 0 )); then
  RING="flat"
  MTRAINING_RING_ARGS=(--mtraining-ring flat)
elif (( CP_SPAN % GPUS_PER_NODE == 0 )); then
  CP_PER_NODE=$(( GPUS_PER_NODE / TP ))
  RING="hierarchical (inner $CP_PER_NODE per node x outer $(( CP / CP_PER_NODE )) nodes)"
  MTRAINING_RING_ARGS=(--mtraining-ring hierarchical --mtraining-inner-ring-size "$CP_PER_NODE")
else
  fail "TP=$TP x CP=$CP = $CP_SPAN GPUs per CP group neither fits in a node nor spans whole nodes" \
       "(GPUS_PER_NODE=$GPUS_PER_NODE); choose CP with TP x CP dividing $GPUS_PER_NODE or a multiple of it"
fi
PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP"
               --context-parallel-size "$CP" --cp-comm-type p2p)
if (( TP > 1 )); then
  PARALLEL_ARGS+=(--sequence-parallel)
fi

# ------------------------------------------------------------------------------------------ budget
case "$BUDGET" in
  top-p)
    for name in SPARSITY VERTICAL_SIZE SLASH_SIZE; do
      [[ -z "${!name:-}" ]] || fail "$name=${!name} is a static-budget setting; add BUDGET=static or unset $name"
    done
    TOP_P=${TOP_P:-0.9}
    require_number TOP_P
    number_satisfies "$TOP_P" "x > 0 && x <= 1" || fail "TOP_P=$TOP_P must be in (0, 1], e.g. 0.9"
    BUDGET_ARGS=(--mtraining-budget top-p --mtraining-top-p "$TOP_P")
    BLOCK_SLASHES=${BLOCK_SLASHES:-0}
    [[ "$BLOCK_SLASHES" == [01] ]] || fail "BLOCK_SLASHES=$BLOCK_SLASHES must be 0 or 1"
    if (( BLOCK_SLASHES )); then
      BUDGET_ARGS+=(--mtraining-block-slashes)
    fi
    if [[ -n "${CAP:-}" ]]; then
      require_integer CAP 1
      BUDGET_ARGS+=(--mtraining-cap "$CAP")
    fi
    ;;
  static)
    for name in TOP_P BLOCK_SLASHES CAP; do
      [[ -z "${!name:-}" ]] || fail "$name=${!name} is a top-p setting, but BUDGET=static; unset $name or use BUDGET=top-p"
    done
    if [[ -n "${VERTICAL_SIZE:-}${SLASH_SIZE:-}" ]]; then
      [[ -z "${SPARSITY:-}" ]] || fail "SPARSITY=$SPARSITY and VERTICAL_SIZE/SLASH_SIZE both set a static budget;" \
                                       "give SPARSITY or VERTICAL_SIZE + SLASH_SIZE"
      [[ -n "${VERTICAL_SIZE:-}" && -n "${SLASH_SIZE:-}" ]] ||
        fail "a static budget pair needs both VERTICAL_SIZE and SLASH_SIZE (got VERTICAL_SIZE=${VERTICAL_SIZE:-}," \
             "SLASH_SIZE=${SLASH_SIZE:-})"
      require_integer VERTICAL_SIZE 1
      require_integer SLASH_SIZE 1
      BUDGET_ARGS=(--mtraining-budget static --mtraining-vertical-size "$VERTICAL_SIZE"
                   --mtraining-slash-size "$SLASH_SIZE")
    else
      SPARSITY=${SPARSITY:-0.95}
      require_number SPARSITY
      number_satisfies "$SPARSITY" "x >= 0 && x < 1" || fail "SPARSITY=$SPARSITY must be in [0, 1), e.g. 0.95"
      BUDGET_ARGS=(--mtraining-budget static --mtraining-sparsity "$SPARSITY")
    fi
    ;;
  *) fail "BUDGET=$BUDGET is not a budget; use top-p (with TOP_P) or static (with SPARSITY or VERTICAL_SIZE +" \
          "SLASH_SIZE)" ;;
esac

# ------------------------------------------------------------------------------------------ data and evaluation
[[ "$SPLIT" =~ ^([0-9]+),([0-9]+),([0-9]+)$ ]] ||
  fail "SPLIT=$SPLIT must be three integer percentages train,valid,test, e.g. 98,2,0"
VALID_PERCENT=$(( 10#${BASH_REMATCH[2]} ))
(( 10#${BASH_REMATCH[1]} + VALID_PERCENT + 10#${BASH_REMATCH[3]} == 100 )) ||
  fail "SPLIT=$SPLIT must add up to 100 (train,valid,test percentages), e.g. 98,2,0"
(( 10#${BASH_REMATCH[1]} > 0 )) || fail "SPLIT=$SPLIT leaves no training data; give the train share, e.g. 98,2,0"
(( EVAL_ITERS == 0 || VALID_PERCENT > 0 )) ||
  fail "SPLIT=$SPLIT has no validation share but EVAL_ITERS=$EVAL_ITERS; give one (e.g. SPLIT=98,2,0) or set" \
       "EVAL_ITERS=0"

if [[ "$MOCK_DATA" == 1 ]]; then
  DATA_ARGS=(--mock-data --split "$SPLIT")
  DATA_SOURCE="--mock-data (MOCK_DATA=1: synthetic data)"
elif [[ -n "${DATA_PREFIX:-}" ]]; then
  DATA_ARGS=(--data-path "$DATA_PREFIX" --split "$SPLIT" --data-cache-path "$SAVE_DIR/data_cache")
  DATA_SOURCE="$DATA_PREFIX"
elif (( PRINT_ONLY )); then
  DATA_ARGS=(--mock-data --split "$SPLIT")
  DATA_SOURCE="--mock-data (no DATA_PREFIX; a run needs DATA_PREFIX or MOCK_DATA=1)"
else
  fail "set DATA_PREFIX to the --output-prefix of tools/preprocess_data.py (or MOCK_DATA=1 for synthetic data)"
fi
DOCUMENT_ARGS=()
if [[ "$PACKED_DOCUMENTS" == 1 ]]; then
  DOCUMENT_ARGS=(--reset-attention-mask --reset-position-ids --no-rope-fusion --eod-mask-loss)
  if [[ -n "${MIN_SPARSE_LENGTH:-}" ]]; then
    DOCUMENT_ARGS+=(--mtraining-min-sparse-length "$MIN_SPARSE_LENGTH")
  fi
  DATA_SOURCE+="; packed documents (attention within each document)"
fi

# ------------------------------------------------------------------------------------------ command
TRAINING_ARGS=(
  --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN"
  --micro-batch-size 1 --global-batch-size "$GLOBAL_BATCH_SIZE"
  --train-iters "$TRAIN_ITERS"
  --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS"
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
  --bf16 --use-distributed-optimizer
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  "${CHECKPOINT_ARGS[@]}" --load "$SAVE_DIR" --save "$SAVE_DIR"
  --save-interval "$SAVE_INTERVAL" --ckpt-format torch_dist
  --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
  --log-interval 1 --tensorboard-dir "$SAVE_DIR/tensorboard"
  --distributed-timeout-minutes 60 --seed 1234
)
MTRAINING_ARGS=(
  --mtraining-layout "$LAYOUT" "${BUDGET_ARGS[@]}"
  --mtraining-backend triton --mtraining-loss-chunk-size "$LOSS_CHUNK_SIZE" --mtraining-stats-interval 10
  "${MTRAINING_RING_ARGS[@]}"
)
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"
LAUNCHER_ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}"
               "${DOCUMENT_ARGS[@]}" "${MTRAINING_ARGS[@]}" "${EXTRA[@]}")

COMMAND=(
  "$PYTHON" -m torch.distributed.run
  --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
  -m megatron_mtraining.pretrain "${LAUNCHER_ARGS[@]}"
)

if (( PRINT_ONLY )); then
  echo "# model flags: $MODEL_SOURCE"
  echo "# data: $DATA_SOURCE"
  echo "# layout: GPUS_PER_NODE $GPUS_PER_NODE x NNODES $NNODES = TP $TP x PP $PP x CP $CP x DP $DP; CP ring: $RING"
  printf '%q ' "${COMMAND[@]}"
  echo
  if (( CHECK )); then
    echo "# check: WORLD_SIZE=$GPU_COUNT $PYTHON -m megatron_mtraining.pretrain --mtraining-check <the flags above>"
    WORLD_SIZE=$GPU_COUNT exec "$PYTHON" -m megatron_mtraining.pretrain --mtraining-check "${LAUNCHER_ARGS[@]}"
  fi
  exit 0
fi

export CUDA_DEVICE_MAX_CONNECTIONS=1      # Megatron: keep TP/CP communication kernels in issue order
mkdir -p "$SAVE_DIR"
exec "${COMMAND[@]}"
