#!/usr/bin/env bash
# The quality study on one 2-GPU host: three runs at once, then the report.
#
#   examples/quality/run_all.sh OUT_DIR [extra train.py flags, applied to all three runs]
#
# Dense on $DENSE_DEVICE (cuda:0), MTraining top-P 0.9 on $P90_DEVICE (cuda:1) and top-P 0.95 on
# $P95_DEVICE (cuda:0, next to dense, whose cuDNN attention is the cheapest). Each run stops training
# $QUALITY_EVAL_RESERVE_S (60) s before $QUALITY_BUDGET_S (420) s so that its evaluation fits; a run that
# stopped early is marked in its JSON and in the summary.
# Writes OUT_DIR/runs/<run>.json, OUT_DIR/<run>.log and OUT_DIR/figures/ (PNGs + quality_summary.md).
set -euo pipefail

OUT=${1:?usage: run_all.sh OUT_DIR [train.py flags]}
shift
HERE=$(cd "$(dirname "$0")" && pwd)
PYTHON=${PYTHON:-python}
mkdir -p "$OUT/runs"
common=(--out "$OUT/runs" --time-budget-s "${QUALITY_BUDGET_S:-420}" --eval-reserve-s "${QUALITY_EVAL_RESERVE_S:-60}" "$@")

"$PYTHON" "$HERE/train.py" --run dense --attention dense --device "${DENSE_DEVICE:-cuda:0}" "${common[@]}" \
    > "$OUT/dense.log" 2>&1 &
dense=$!
"$PYTHON" "$HERE/train.py" --run topp0.9 --attention mtraining --top-p 0.9 --device "${P90_DEVICE:-cuda:1}" \
    "${common[@]}" > "$OUT/topp0.9.log" 2>&1 &
p90=$!
"$PYTHON" "$HERE/train.py" --run topp0.95 --attention mtraining --top-p 0.95 --device "${P95_DEVICE:-cuda:0}" \
    "${common[@]}" > "$OUT/topp0.95.log" 2>&1 &
p95=$!

status=0
for pid in "$dense" "$p90" "$p95"; do
    wait "$pid" || status=1
done
grep -h "^\[" "$OUT"/*.log | tail -n 30 || true
"$PYTHON" "$HERE/report.py" "$OUT/runs" --out "$OUT/figures" --baseline dense || status=1
exit $status
