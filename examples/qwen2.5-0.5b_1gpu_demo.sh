#!/usr/bin/env bash
# Qwen2.5-0.5B at 64K tokens on one or two GPUs: the 512K recipe of examples/qwen2.5-3b_32k_to_512k.sh, scaled
# down to a short run that shows the loss and MTraining's metrics (attention density, ring imbalance).
#
#   CHECKPOINT=checkpoints/qwen2.5-0.5b-mcore bash examples/qwen2.5-0.5b_1gpu_demo.sh             # 1 GPU, mock data
#   NGPUS=2 CHECKPOINT=... DATA_PREFIX=data/long_docs bash examples/qwen2.5-0.5b_1gpu_demo.sh     # CP = 2 ring
#   bash examples/qwen2.5-0.5b_1gpu_demo.sh --dry-run     # or DRY_RUN=1: print the command, run nothing
#   bash examples/qwen2.5-0.5b_1gpu_demo.sh --check       # or CHECK=1: print it, then validate it on this machine
#
# CHECKPOINT is tools/convert_qwen2_hf_to_megatron.py's output for Qwen2.5-0.5B (not needed for --dry-run or
# --check). Without DATA_PREFIX the run uses synthetic data (MOCK_DATA=1).
#
# Settings: those of examples/qwen2.5-3b_32k_to_512k.sh (listed in its header), with these defaults:
#   NGPUS (1; the same as GPUS_PER_NODE), NNODES (1), MODEL (qwen2.5-0.5b), SEQ_LEN (65536), GLOBAL_BATCH_SIZE (1),
#   TRAIN_ITERS (50), WARMUP_ITERS (5), SAVE_INTERVAL (50), EVAL_INTERVAL (25), EVAL_ITERS (1),
#   SAVE_DIR (checkpoints/qwen2.5-0.5b-64k-demo).
set -euo pipefail

if [[ -n "${NGPUS:-}" && -n "${GPUS_PER_NODE:-}" && "$NGPUS" != "$GPUS_PER_NODE" ]]; then
  echo "$(basename "$0"): error: NGPUS=$NGPUS and GPUS_PER_NODE=$GPUS_PER_NODE disagree; set one of them" >&2
  exit 2
fi
export GPUS_PER_NODE=${NGPUS:-${GPUS_PER_NODE:-1}}
export NNODES=${NNODES:-1}
export MODEL=${MODEL:-qwen2.5-0.5b}
export SEQ_LEN=${SEQ_LEN:-65536}
export GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-1}
export TRAIN_ITERS=${TRAIN_ITERS:-50}
export WARMUP_ITERS=${WARMUP_ITERS:-5}
export SAVE_INTERVAL=${SAVE_INTERVAL:-50}
export EVAL_INTERVAL=${EVAL_INTERVAL:-25}
export EVAL_ITERS=${EVAL_ITERS:-1}
export SAVE_DIR=${SAVE_DIR:-checkpoints/qwen2.5-0.5b-64k-demo}
if [[ -z "${DATA_PREFIX:-}" ]]; then
  export MOCK_DATA=1
fi
exec bash "$(dirname "${BASH_SOURCE[0]}")/qwen2.5-3b_32k_to_512k.sh" "$@"
