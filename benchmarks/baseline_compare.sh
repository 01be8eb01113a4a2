#!/usr/bin/env bash
# Times the C++/CUDA ops of this tree against those of an earlier commit in one run on one machine, builds
# alternating (ABAB...) so that drift hits both: prints the per-op ratio of medians (this / baseline).
#   here:   bash benchmarks/baseline_compare.sh extract REV DIR    (writes REV's tree to DIR, e.g. .baseline)
#   device: bash benchmarks/baseline_compare.sh run DIR [ROUNDS]   (after `cuda_device_run.sh build`)
set -euo pipefail
case "${1:?usage: baseline_compare.sh extract REV DIR | run DIR [ROUNDS]}" in
  extract)
    rm -rf "$3"; mkdir -p "$3"; git archive "$2" | tar -x -C "$3"; echo "$2" > "$3/REV" ;;
  run)
    dir=$2; rounds=${3:-3}; OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
    (cd "$dir" && CC=/usr/bin/gcc CXX=/usr/bin/g++ TORCH_CUDA_ARCH_LIST=9.0 TORCH_SPARSE_METAL_CUDA=1 MAX_JOBS=16 \
      python3 setup.py build_ext --inplace > "$OUT/baseline_build.log" 2>&1) || { tail -20 "$OUT/baseline_build.log"; exit 1; }
    : > "$OUT/op_timing.jsonl"
    for r in $(seq "$rounds"); do
      PYTHONPATH=$dir python3 benchmarks/op_timing.py --label baseline >> "$OUT/op_timing.jsonl"
      python3 benchmarks/op_timing.py --label this >> "$OUT/op_timing.jsonl"
    done
    python3 - "$OUT/op_timing.jsonl" "$dir" <<'PY'
import json, statistics, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
base = [r for r in runs if r["label"] == "baseline"]
this = [r for r in runs if r["label"] == "this"]
assert base and this and base[0]["module"] != this[0]["module"], "both builds must be timed"
print(f"{runs[0]['device']}: median over {len(this)} runs each; this tree / baseline ({open(sys.argv[2] + '/REV').read().strip()})")
print(f"{'case':34} {'op':13} {'baseline ms':>11} {'this ms':>9} {'ratio':>6}")
for i, row in enumerate(this[0]["rows"]):
    for op in ("forward", "fused_atomic", "atomic_free"):
        b = statistics.median(r["rows"][i][op] for r in base)
        t = statistics.median(r["rows"][i][op] for r in this)
        print(f"{row['case']:34} {op:13} {b:11.3f} {t:9.3f} {t / b:6.3f}")
PY
    ;;
esac
