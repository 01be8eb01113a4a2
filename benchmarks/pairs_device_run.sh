#!/usr/bin/env bash
# Issue #29's pairs on one H200 (benchmarks/pairs.py says how the runs share the GPU and what each is given).
# Usage (device machine, repo root, .data/gcide.dict.dz carried, after `bash benchmarks/cuda_device_run.sh build`):
#   bash benchmarks/pairs_device_run.sh rates launch monitor   # the first call: solo rates, start, follow
#   bash benchmarks/pairs_device_run.sh monitor                # later calls while the runs go on
#   bash benchmarks/pairs_device_run.sh monitor report         # the last: follow to the end, results to $OUT
# MINUTES (solo minutes a run is given, 10), END_IN (wall minutes from the launch by which runs end, 18),
# MONITOR_S (seconds a monitor step follows, 540), RUNS (/tmp/runs).
set -o pipefail
OUT=${OUT:-/tmp/out}; RUNS=${RUNS:-/tmp/runs}; mkdir -p "$OUT" "$RUNS"
export PYTHONUNBUFFERED=1
B="--dtype bfloat16"
W="--d-model 1024 --density 0.015625"  # 4x the README's width at 1/16 of its density: the same 786,432 edges
R="--prune-every 1000 --regrow rigl"   # the sparse side's topology evolves as in the README's pair
# In priority order: the pairs first (seed 0), then their second seeds; the monitor stops runs from the end.
SET=(
  "dense_d132_s0=--dense $B --seed 0"
  "sparse_d256_s0=$B --seed 0 $R"
  "sparse_d1024_v16_s0=$W --block 16 $B --seed 0 $R"
  "dense_d160_s0=--dense $W $B --seed 0"
  "dense_d132_s1=--dense $B --seed 1"
  "sparse_d256_s1=$B --seed 1 $R"
  "sparse_d1024_v16_s1=$W --block 16 $B --seed 1 $R"
  "dense_d160_s1=--dense $W $B --seed 1"
  "sparse_d256_v16_s0=--block 16 $B --seed 0 $R"
  "sparse_d1024_s0=$W $B --seed 0 $R"
)
runs=(); for r in "${SET[@]}"; do runs+=(--run "$r"); done
step() { echo "=== $* ($(date +%T))"; }
for arg in "$@"; do
  case "$arg" in
    rates)
      step rates; python3 benchmarks/pairs.py rates --data .data/gcide.dict.dz --out "$RUNS/rates.json" "${runs[@]}" ;;
    launch)
      step launch
      # CUDA's multi-process service lets the runs' kernels share the SMs; without it they take turns.
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps/log
      mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
      if nvidia-cuda-mps-control -d && python3 -c "
import torch
x = torch.ones(1024, device='cuda'); s = torch.cuda.Stream(); g = torch.cuda.CUDAGraph()
with torch.cuda.stream(s):
    y = x * 2
with torch.cuda.graph(g):
    y = x * 2
g.replay(); torch.cuda.synchronize(); assert float(y.sum()) == 2048
print('MPS: on, graph replay works')"; then :; else
        echo "MPS: off"; echo quit | nvidia-cuda-mps-control 2>/dev/null; unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
      fi
      python3 benchmarks/pairs.py launch --rates "$RUNS/rates.json" --minutes ${MINUTES:-10} --end-in ${END_IN:-18} \
        --runs-dir "$RUNS" --data .data/gcide.dict.dz "${runs[@]}" ;;
    monitor)
      step monitor; python3 benchmarks/pairs.py monitor --runs-dir "$RUNS" --for ${MONITOR_S:-540} | tee -a "$RUNS/monitor.log" | tail -25
      nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv ;;
    report)
      step report; python3 benchmarks/pairs.py report --runs-dir "$RUNS" --out "$OUT/pairs.json" --plot "$OUT/pairs.png"
      cp "$RUNS/plan.json" "$RUNS/rates.json" "$OUT/"
      (cd "$RUNS" && tar czf "$OUT/runs.tgz" --exclude=checkpoint.pt *.log */log.json */bpc.png 2>/dev/null) ;;
    *) echo "unknown step $arg"; exit 2 ;;
  esac
done
