#!/usr/bin/env bash
# Qwen2.5-0.5B at 64K tokens on one or two GPUs: the 512K recipe of examples/qwen2.5-3b_32k_to_512k.sh, scaled
# down to a short run that shows the loss and MTraining's metrics (attention density, ring imbalance).
#
#   CHECKPOINT=checkpoints/qwen2.5-0.5b-mcore bash examples/qwen2.5-0.5b_1gpu_demo.sh             # 1 GPU, mock data
#   NGPUS=2 CHECKPOINT=... DATA_PREFIX=data/long_docs bash examples/qwen2.5-0.5b_1gpu_demo.sh     # CP = 2 ring
#   bash examples/qwen2.5-0.5b_1gpu_demo.sh --dry-run                                             # print the command
#
# CHECKPOINT is tools/convert_qwen2_hf_to_megatron.py's output for Qwen2.5-0.5B. Without DATA_PREFIX the run
# uses synthetic data. Every setting of the 3B script can be overridden the same way (SEQ_LEN, TRAIN_ITERS, ...).
set -euo pipefail

export GPUS_PER_NODE=${NGPUS:-1}
export NNODES=1
export SEQ_LEN=${SEQ_LEN:-65536}
export GLOBAL_BATCH_SIZE=${GLOBAL_BATCH_SIZE:-1}
export TRAIN_ITERS=${TRAIN_ITERS:-50}
export WARMUP_ITERS=${WARMUP_ITERS:-5}
export SAVE_INTERVAL=${SAVE_INTERVAL:-50}
export SAVE_DIR=${SAVE_DIR:-checkpoints/qwen2.5-0.5b-64k-demo}
if [[ -z "${DATA_PREFIX:-}" ]]; then
  export MOCK_DATA=1
fi
exec bash "$(dirname "${BASH_SOURCE[0]}")/qwen2.5-3b_32k_to_512k.sh" "$@"
