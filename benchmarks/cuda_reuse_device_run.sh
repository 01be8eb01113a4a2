#!/usr/bin/env bash
# One device call for the panel-staged SpMM (csrc/cuda/spmm_reuse.cuh): build, the CUDA tests with the walk
# forced on (TORCH_SPARSE_METAL_CUDA_SPMM=reuse), then benchmarks/cuda_spmm_reuse.py (direct vs reuse, one process).
# The walk and its switch exist in commit 92cd446's tree only (docs/cuda.md, "Operand reuse: a panel-staged SpMM").
# Usage (device machine, repo root): bash benchmarks/cuda_reuse_device_run.sh [build] [test] [time] [ncu]   (TESTS, ROUNDS)
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for arg in "$@"; do
  case "$arg" in
    build) bash benchmarks/cuda_device_run.sh build 2>&1 | tail -4 ;;
    test)
      echo "=== tests, reuse forced ($(date +%T))"
      TORCH_SPARSE_METAL_CUDA_SPMM=reuse timeout ${TEST_TIMEOUT:-200} python3 -m pytest \
        ${TESTS:-tests/test_cuda_reuse.py tests/test_cuda_backend.py tests/test_index_safety.py tests/test_dtypes.py} \
        -q -p no:cacheprovider --maxfail=5 > "$OUT/test_reuse.log" 2>&1; echo "rc=$?"
      grep -E "^(FAILED|ERROR)|Error|assert" "$OUT/test_reuse.log" | head -20; tail -2 "$OUT/test_reuse.log" ;;
    time)
      echo "=== timing ($(date +%T))"
      timeout ${TIME_TIMEOUT:-200} python3 benchmarks/cuda_spmm_reuse.py --rounds ${ROUNDS:-7} \
        --out "$OUT/cuda_spmm_reuse.jsonl" 2>&1 | tee "$OUT/timing.txt" ;;
    ncu)
      echo "=== ncu ($(date +%T))"
      timeout ${NCU_TIMEOUT:-120} ncu --clock-control none -k regex:'reuse_spmm|csr_tile' --launch-skip 1 --launch-count 5 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section InstructionStats \
        --section LaunchStats python3 benchmarks/cuda_reuse_profile.py > "$OUT/ncu_reuse.txt" 2>&1; echo "rc=$?"
      grep -E "reuse_spmm|csr_tile_kernel|Duration|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\) Th|Achieved Occ|Issue Slots Busy|Executed Ipc A|Stall|No Eligible|Registers Per|Warp Cycles Per Issued" \
        "$OUT/ncu_reuse.txt" | cut -c1-150 | head -70 ;;
    *) echo "unknown step $arg" ;;
  esac
done
