#!/usr/bin/env bash
# One call on the H200 for the dtype axis of the benchmark: build (benchmarks/cuda_device_run.sh build, with the system
# g++), then ours, dense and torch.sparse in float32, bfloat16 and float16, every dtype of a case in one round-robin,
# with our speedups over torch.sparse fp32, dense fp32 and dense in the same dtype (bf16/fp16 dense: tensor cores).
# Cases: the `design` group (1024², 5%, B256; 4096², 5% and 1%, B1024; 16384², 1%, B4096).
# Usage (device machine, repo root): bash benchmarks/dtype_cuda_device_run.sh [build] [bench]
#   BENCH_CASES (default design), BENCH_DTYPES (default float32,bfloat16,float16), BENCH_REPS (default 50),
#   BENCH_ARGS (e.g. --graphs), BENCH_NAME (file stem, default dtype_h200). Output in $OUT (default /tmp/out).
source "$(dirname "$0")/device_run_prelude.sh"
step_bench() {
  step bench
  python3 -m torch_sparse_metal_tools.bench --device cuda --dtypes ${BENCH_DTYPES:-float32,bfloat16,float16} \
    --cases ${BENCH_CASES:-design} --reps ${BENCH_REPS:-50} ${BENCH_ARGS:-} --out "$OUT" --name ${BENCH_NAME:-dtype_h200} \
    2>&1 | tee "$OUT/${BENCH_NAME:-dtype_h200}.log" | grep -v "^case"
}
run_steps "$@"
