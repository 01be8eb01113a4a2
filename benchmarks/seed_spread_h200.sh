#!/usr/bin/env bash
# Seed spread on one GPU when device time is short: several seeds of the d_model 256, density 1/4 RigL model
# and of its dense twin, all trained at the same time. They share the GPU, so each run makes fewer steps than
# alone and steps vary with contention: compare the spread within a configuration, not the configurations.
# Usage (device machine, repo root, .data carried, after `bash benchmarks/cuda_device_run.sh build`):
#   bash benchmarks/seed_spread_h200.sh MINUTES SEED...      (8 files come back at most: 3 seeds, 6 logs + summary)
OUT=${OUT:-/tmp/out}; minutes=$1; shift
common=(--data .data/gcide.dict.dz --device cuda --d-model 256 --density 0.25 --minutes "$minutes" --no-progress)
export OMP_NUM_THREADS=2 PYTHONUNBUFFERED=1
mkdir -p /tmp/spread
for seed in "$@"; do
  python3 examples/train_wikitext103.py "${common[@]}" --seed "$seed" --prune-every 1000 --regrow rigl \
    --out "/tmp/spread/rigl-$seed" > "/tmp/spread/rigl-$seed.log" 2>&1 &
  python3 examples/train_wikitext103.py "${common[@]}" --seed "$seed" --dense \
    --out "/tmp/spread/dense-$seed" > "/tmp/spread/dense-$seed.log" 2>&1 &
done
wait
grep -H -E "Steps completed|Best val BPC|Error" /tmp/spread/*.log | tee "$OUT/spread_summary.txt"
for run in /tmp/spread/*/; do cp "$run/log.json" "$OUT/$(basename "$run").json"; done
