#!/usr/bin/env bash
# Extend Qwen2.5-3B from 32K to 512K tokens with MTraining's sparse attention: one node, torchrun.
#
#   CHECKPOINT=checkpoints/qwen2.5-3b-mcore DATA_PREFIX=data/long_docs bash examples/qwen2.5-3b_32k_to_512k.sh
#   bash examples/qwen2.5-3b_32k_to_512k.sh --dry-run     # or DRY_RUN=1: print the command, run nothing
#
# CHECKPOINT is the directory written by tools/convert_qwen2_hf_to_megatron.py; its megatron_model_args.sh
# supplies the model flags and the tokenizer. DATA_PREFIX is the --output-prefix of tools/preprocess_data.py
# (or MOCK_DATA=1 for synthetic data). Training checkpoints go to SAVE_DIR, from which a rerun resumes.
#
# Each SEQ_LEN-token sequence is split over CP = (GPUS_PER_NODE x NNODES) / TP ranks in MTraining's striped
# layout. When a CP group spans nodes (examples/slurm/*.sbatch sets NNODES, NODE_RANK and MASTER_ADDR) the
# ring is hierarchical: an inner ring over the GPUs of a node inside an outer ring over the nodes.
#
# Environment (default): SEQ_LEN (524288), GPUS_PER_NODE (8), NNODES (1), NODE_RANK (0), MASTER_ADDR
# (localhost), MASTER_PORT (6000), TP (1), GLOBAL_BATCH_SIZE (8), TRAIN_ITERS (1000), LR (1e-5), MIN_LR
# (1e-6), WARMUP_ITERS (20), SAVE_DIR (checkpoints/qwen2.5-3b-512k), SAVE_INTERVAL (100), TOP_P (0.9),
# LOSS_CHUNK_SIZE (8192), PYTHON (python), EXTRA_ARGS (appended to the launcher's flags).
set -euo pipefail

DRY_RUN=${DRY_RUN:-0}
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    *) echo "usage: $0 [--dry-run]  (settings are environment variables, see the header of $0)" >&2; exit 2 ;;
  esac
done

: "${CHECKPOINT:?set CHECKPOINT to the directory written by tools/convert_qwen2_hf_to_megatron.py}"
if [[ ! -f "$CHECKPOINT/megatron_model_args.sh" ]]; then
  echo "error: $CHECKPOINT/megatron_model_args.sh not found;" \
       "convert the model with tools/convert_qwen2_hf_to_megatron.py" >&2
  exit 1
fi
source "$CHECKPOINT/megatron_model_args.sh"      # defines MODEL_ARGS

SEQ_LEN=${SEQ_LEN:-524288}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
TP=${TP:-1}
CP=$((GPUS_PER_NODE * NNODES / TP))
CP_PER_NODE=$((GPUS_PER_NODE / TP))
SAVE_DIR=${SAVE_DIR:-checkpoints/qwen2.5-3b-512k}
PYTHON=${PYTHON:-python}

if (( GPUS_PER_NODE % TP )); then
  echo "error: TP=$TP must divide GPUS_PER_NODE=$GPUS_PER_NODE (tensor parallelism stays inside a node)" >&2
  exit 1
fi

if [[ "${MOCK_DATA:-0}" == 1 ]]; then
  DATA_ARGS=(--mock-data)
else
  : "${DATA_PREFIX:?set DATA_PREFIX to the --output-prefix of tools/preprocess_data.py (or MOCK_DATA=1)}"
  DATA_ARGS=(--data-path "$DATA_PREFIX" --split 100,0,0 --data-cache-path "$SAVE_DIR/data_cache")
fi

PARALLEL_ARGS=(--tensor-model-parallel-size "$TP" --context-parallel-size "$CP" --cp-comm-type p2p)
if (( TP > 1 )); then
  PARALLEL_ARGS+=(--sequence-parallel)
fi
if (( NNODES > 1 )); then
  MTRAINING_RING_ARGS=(--mtraining-ring hierarchical --mtraining-inner-ring-size "$CP_PER_NODE")
else
  MTRAINING_RING_ARGS=(--mtraining-ring flat)
fi

TRAINING_ARGS=(
  --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN"
  --micro-batch-size 1 --global-batch-size "${GLOBAL_BATCH_SIZE:-8}"
  --train-iters "${TRAIN_ITERS:-1000}"
  --lr "${LR:-1e-5}" --min-lr "${MIN_LR:-1e-6}" --lr-decay-style cosine --lr-warmup-iters "${WARMUP_ITERS:-20}"
  --weight-decay 0.1 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95
  --bf16 --use-distributed-optimizer
  --recompute-granularity full --recompute-method uniform --recompute-num-layers 1
  --pretrained-checkpoint "$CHECKPOINT" --load "$SAVE_DIR" --save "$SAVE_DIR"
  --save-interval "${SAVE_INTERVAL:-100}" --ckpt-format torch_dist
  --log-interval 1 --eval-iters 0 --tensorboard-dir "$SAVE_DIR/tensorboard"
  --distributed-timeout-minutes 60 --seed 1234
)
MTRAINING_ARGS=(
  --mtraining-layout striped --mtraining-budget top-p --mtraining-top-p "${TOP_P:-0.9}"
  --mtraining-kernel triton --mtraining-loss-chunk-size "${LOSS_CHUNK_SIZE:-8192}" --mtraining-stats-interval 10
  "${MTRAINING_RING_ARGS[@]}"
)
read -r -a EXTRA <<< "${EXTRA_ARGS:-}"

COMMAND=(
  "$PYTHON" -m torch.distributed.run
  --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
  -m megatron_mtraining.pretrain
  "${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${MTRAINING_ARGS[@]}"
  "${EXTRA[@]}"
)

if [[ "$DRY_RUN" == 1 ]]; then
  printf '%q ' "${COMMAND[@]}"
  echo
  exit 0
fi

export CUDA_DEVICE_MAX_CONNECTIONS=1      # Megatron: keep TP/CP communication kernels in issue order
mkdir -p "$SAVE_DIR"
exec "${COMMAND[@]}"
