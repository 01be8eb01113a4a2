#!/usr/bin/env bash
# Issue #17 item 4 on one GPU: synchronous training against PD-ASGD 1:1, 1:2 and 1:2 with a straggler, one run
# after the other (one GPU, so no run competes with another), same model, data and seed.
# Usage (device machine, repo root, .data/gcide.dict.dz carried): bash benchmarks/decoupled_device_run.sh [MINUTES]
# Results in $OUT: each run's folder and log, and decoupled.png (python3 examples/char_lm/report.py).
set -o pipefail
MIN=${1:-1.5}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash benchmarks/cuda_device_run.sh build
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
C="--data .data/gcide.dict.dz --minutes $MIN --device cuda --d-model 256 --density 0.25 --eval-every 2000"
run() {
  name=$1; shift
  bash benchmarks/train_device_run.sh start "$name" $C "$@" > /dev/null
  bash benchmarks/train_device_run.sh wait "$name" $(python3 -c "print(int($MIN * 60 + 120))")
}
run sync
run pd_1x1 --decoupled 1:1
run pd_1x2 --decoupled 1:2
run pd_1x2_straggler --decoupled 1:2 --straggler-ms 5
bash benchmarks/train_device_run.sh collect sync pd_1x1 pd_1x2 pd_1x2_straggler
python3 examples/char_lm/report.py "$OUT/sync" "$OUT/pd_1x1" "$OUT/pd_1x2" "$OUT/pd_1x2_straggler" \
  --out "$OUT/decoupled.png"
