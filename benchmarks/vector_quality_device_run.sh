#!/usr/bin/env bash
# Issue #28 item 4: what vectors cost in quality. The README's model (d_model 256, 4 layers, density 1/4,
# batch 16 x 256) at equal nonzeros and equal steps with block 1, 8 and 16, a static topology and RigL, every
# seed, all runs at once on one GPU (equal steps: sharing the GPU changes their speed, not their results).
# Usage (device machine, repo root, .data/gcide.dict.dz carried, after `bash benchmarks/cuda_device_run.sh build`):
#   STEPS=4000 bash benchmarks/vector_quality_device_run.sh SEED...
# Writes $OUT/<static|rigl>-b<V>-s<seed>.json (the runs' log.json) and $OUT/vector_quality.{json,md}.
OUT=${OUT:-/tmp/out}; STEPS=${STEPS:-4000}
common=(--data .data/gcide.dict.dz --device cuda --d-model 256 --density 0.25 --steps "$STEPS" --no-progress
        --eval-every 1000 ${QUALITY_ARGS:-})
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
mkdir -p /tmp/quality
for seed in "$@"; do
  for block in ${BLOCKS:-1 8 16}; do
    python3 examples/train_wikitext103.py "${common[@]}" --seed "$seed" --block "$block" \
      --out "/tmp/quality/static-b$block-s$seed" > "/tmp/quality/static-b$block-s$seed.log" 2>&1 &
    python3 examples/train_wikitext103.py "${common[@]}" --seed "$seed" --block "$block" \
      --prune-every 500 --regrow rigl \
      --out "/tmp/quality/rigl-b$block-s$seed" > "/tmp/quality/rigl-b$block-s$seed.log" 2>&1 &
  done
done
wait
grep -H -E "Steps completed|Best val BPC|Error" /tmp/quality/*.log | tail -60
for run in /tmp/quality/*/; do cp "$run/log.json" "$OUT/$(basename "$run").json"; done
python3 benchmarks/vector_quality.py "$OUT"/*-b*-s*.json --out "$OUT/vector_quality"
