#!/usr/bin/env bash
# The quality study on one 2-GPU host: a shared short-context run, four runs branched from it, the report.
#
#   examples/quality/run_all.sh OUT_DIR [extra train.py flags, applied to every run]
#
# 1. short_context (dense, $DENSE_DEVICE = cuda:0) trains the first $QUALITY_SHARED_PHASES (1) phases and
#    writes OUT_DIR/short_context.pt (no time budget: the branches need all of it).
# 2. From that checkpoint, concurrently: dense (cuDNN SDPA, cuda:0), dense_triton (the same dense attention
#    through our Triton kernels, cuda:1: the spread between two dense runs is the noise floor of the
#    comparison), MTraining top-P 0.9 (cuda:1) and 0.95 (cuda:0). Each stops training
#    $QUALITY_EVAL_RESERVE_S (60) s before $QUALITY_BUDGET_S (300) s so that its evaluation fits; a run that
#    stopped early is marked in its JSON and in the summary.
# Writes OUT_DIR/runs/<run>.json, OUT_DIR/<run>.log and OUT_DIR/figures/ (PNGs + quality_summary.md).
set -euo pipefail

OUT=${1:?usage: run_all.sh OUT_DIR [train.py flags]}
shift
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python}
DENSE_DEVICE=${DENSE_DEVICE:-cuda:0}
OTHER_DEVICE=${OTHER_DEVICE:-cuda:1}
mkdir -p "$OUT/runs"

"$PYTHON" "$HERE/train.py" --run short_context --attention dense --device "$DENSE_DEVICE" --out "$OUT" \
    --stop-after-phase "${QUALITY_SHARED_PHASES:-1}" "$@" > "$OUT/short_context.log" 2>&1 \
    || { tail -n 20 "$OUT/short_context.log"; exit 1; }
grep "^\[" "$OUT/short_context.log" | tail -n 3

common=(--out "$OUT/runs" --resume "$OUT/short_context.pt" --time-budget-s "${QUALITY_BUDGET_S:-300}"
        --eval-reserve-s "${QUALITY_EVAL_RESERVE_S:-60}" "$@")
pids=()
start_run() {  # name device flags...
    local name=$1 device=$2
    shift 2
    "$PYTHON" "$HERE/train.py" --run "$name" --device "$device" "$@" "${common[@]}" > "$OUT/$name.log" 2>&1 &
    pids+=($!)
}
start_run dense "$DENSE_DEVICE" --attention dense
start_run dense_triton "$OTHER_DEVICE" --attention dense --kernel triton
start_run topp0.9 "$OTHER_DEVICE" --attention mtraining --top-p 0.9
start_run topp0.95 "$DENSE_DEVICE" --attention mtraining --top-p 0.95

status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=1
done
grep -h "^\[" "$OUT"/*.log | tail -n 30 || true
"$PYTHON" "$HERE/report.py" "$OUT/runs" --out "$OUT/figures" --baseline dense || status=1
exit $status
