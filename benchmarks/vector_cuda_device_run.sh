#!/usr/bin/env bash
# One call on the H200 for the vector ops' CUDA kernels: build (benchmarks/cuda_device_run.sh), the vector tests,
# compute-sanitizer memcheck on a small subset of them (the index attacks and odd shapes), and per-kernel profiles.
# Usage (device machine, repo root): bash benchmarks/vector_cuda_device_run.sh [build] [test] [sanitize] [profile]
#   VTESTS: pytest selection (default tests/test_vector_cuda.py); VCASES: --case arguments of vector_profile_case.py
source "$(dirname "$0")/device_run_prelude.sh"
for arg in "$@"; do
  case "$arg" in
    build) bash benchmarks/cuda_device_run.sh build 2>&1 | tail -20
      python3 -c 'import torch, torch_sparse_metal; print("vector cuda kernel:", torch._C._dispatch_has_kernel_for_dispatch_key("torch_sparse_metal::csr_linear", "CUDA"))' ;;
    test)
      step test; timeout ${TEST_TIMEOUT:-400} python3 -m pytest ${VTESTS:-tests/test_vector_cuda.py} -q -x -p no:cacheprovider -rs \
        > "$OUT/vector_test.log" 2>&1; echo "rc=$?"
      grep -v "^  File" "$OUT/vector_test.log" | grep -E "Error|assert|FAIL|passed|failed" | head -30; tail -3 "$OUT/vector_test.log" ;;
    sanitize)
      step "compute-sanitizer memcheck"
      timeout ${SAN_TIMEOUT:-200} compute-sanitizer --tool memcheck --error-exitcode 9 python3 -m pytest tests/test_vector_cuda.py \
        -q -x -p no:cacheprovider -k "${SAN_K:-guards or (reference and 37x5 and 7 and (bfloat16 or float32)) or (cuda_core and 37x5)}" 2>&1 | tail -8 \
        | tee "$OUT/vector_sanitize_memcheck.log"; echo "rc=$?" ;;
    profile)
      step profile; cases=""
      for c in ${VCASES:-4096x4096x1024:0.05:16 4096x4096x1024:0.25:16 16384x16384x4096:0.01:16}; do cases="$cases --case $c"; done
      timeout ${PROFILE_TIMEOUT:-300} python3 benchmarks/vector_profile_case.py $cases --dtypes ${VDTYPES:-bfloat16,float32} \
        --json "$OUT/vector_profile.json" 2>&1 | tee "$OUT/vector_profile.log" ;;
    *) echo "unknown step $arg" ;;
  esac
done
