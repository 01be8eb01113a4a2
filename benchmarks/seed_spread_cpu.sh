#!/usr/bin/env bash
# Seed spread of the sparse-vs-dense comparison at CPU scale: static sparse, RigL sparse and the dense twin,
# each over several seeds, same step budget (steps, not time: CPU timing here is noisy).
# Usage: bash benchmarks/seed_spread_cpu.sh TEXT_FILE OUT_DIR [SEEDS...]   (default seeds 0 1 2 3)
# Then:  python examples/char_lm/report.py OUT_DIR/*/ --out OUT_DIR/all.png  (or read */log.json)
set -e
data=$1; out=$2; shift 2; seeds=${*:-0 1 2 3}
common=(--data "$data" --device cpu --size small --steps 1500 --no-progress)
for seed in $seeds; do
  python examples/train_wikitext103.py "${common[@]}" --seed "$seed" --out "$out/static-$seed"
  python examples/train_wikitext103.py "${common[@]}" --seed "$seed" --prune-every 100 --regrow rigl --out "$out/rigl-$seed"
  python examples/train_wikitext103.py "${common[@]}" --seed "$seed" --dense --out "$out/dense-$seed"
done | grep -E "^model:|Best val BPC"
