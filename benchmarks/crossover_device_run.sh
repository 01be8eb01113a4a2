#!/usr/bin/env bash
# One call on the H200 for the crossover benchmark (benchmarks/crossover.py): build the extension as
# benchmarks/cuda_device_run.sh does, then the sweep; JSON, markdown table, plot and log in $OUT.
# Usage (device machine, repo root): bash benchmarks/crossover_device_run.sh [build] [run]
#   XO_ARGS: extra arguments of crossover.py; XO_NAME: file stem (default crossover_h200); XO_BUDGET: seconds this
#   script may take in all (the sweep gets --deadline-s of what the build left, less 45 s for its last case).
#   The vector ops' block axis (docs/cuda.md, "Vector layout kernels"), as run on 2026-12-02:
#     XO_NAME=crossover_h200_blocks XO_ARGS="--shapes 4096 16384 --densities 0.01,0.05,0.25 --blocks 16,32,8
#     --no-structured" bash benchmarks/crossover_device_run.sh build run
# With build/xo_head/head.tar carried (git archive of HEAD's csrc/ and torch_sparse_metal/backends/), a build of
# the working tree that fails is retried with HEAD's sources (the log says which one was measured).
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
NAME=${XO_NAME:-crossover_h200}
step() { echo "=== $* ($(date +%T))"; }
built() { python3 -c 'import torch_sparse_metal, torch, sys; sys.exit(0 if torch._C._dispatch_has_kernel_for_dispatch_key("torch_sparse_metal::csr_linear", "CUDA") else 1)'; }
for arg in "$@"; do
  case "$arg" in
    build)
      [ -f build/xo_head/tree_state.txt ] && cp build/xo_head/tree_state.txt "$OUT/tree_state.txt"
      bash benchmarks/cuda_device_run.sh build
      if built; then echo "measured: the working tree's kernels" | tee -a "$OUT/tree_state.txt"
      elif [ -f build/xo_head/head.tar ]; then
        step "the working tree did not build: HEAD's csrc/ and backends/ instead"
        tar -xf build/xo_head/head.tar && bash benchmarks/cuda_device_run.sh build
        built && echo "measured: HEAD's kernels (the working tree did not build)" | tee -a "$OUT/tree_state.txt"
      fi ;;
    run)
      step crossover
      deadline=""; [ -n "${XO_BUDGET:-}" ] && deadline="--deadline-s $((XO_BUDGET - SECONDS - 45))"
      python3 benchmarks/crossover.py --device cuda --out "$OUT" --name "$NAME" $deadline ${XO_ARGS:-} 2>&1 \
        | tee "$OUT/$NAME.log" | grep -v "^hardware" ;;
    *) echo "unknown step $arg" ;;
  esac
done
