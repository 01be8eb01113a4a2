#!/usr/bin/env bash
# One call on the H200: build for sm_90, CUDA tests, sanitizers on a small subset, then the benchmark.
# Usage (device machine, repo root): bash benchmarks/cuda_device_run.sh [build] [test] [sanitize] [bench]
#   (TESTS, BENCH_ARGS, SAN_TOOLS, SAN_TIMEOUT)
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 TORCH_SPARSE_METAL_CUDA=1 MAX_JOBS=16
# The machine's default CC/CXX (/opt/gcc) link libstdc++ statically: the extension then carries a second copy
# of libstdc++ beside torch's, and formatting a number into an error message segfaulted. Use the system g++.
export CC=/usr/bin/gcc CXX=/usr/bin/g++
step() { echo "=== $* ($(date +%T))"; }
for arg in "$@"; do
  case "$arg" in
    build)
      step build; nvidia-smi -L; python3 -c 'import torch; print(torch.__version__, torch.version.cuda)'
      python3 -m pip install -e . --no-build-isolation --no-deps -q 2>&1 | tail -15 | tee "$OUT/build.log"
      python3 -c 'import torch_sparse_metal' || python3 setup.py build_ext --inplace 2>&1 | tail -15
      python3 -c 'import torch_sparse_metal, torch; print("cuda kernel:", torch._C._dispatch_has_kernel_for_dispatch_key("torch_sparse_metal::csr_linear", "CUDA"))' ;;
    test)
      step test; python3 -m pytest ${TESTS:-tests/test_cuda_backend.py tests/test_dtypes.py} -q -p no:cacheprovider -rs \
        > "$OUT/test.log" 2>&1; echo "rc=$?"
      grep -v "^  File" "$OUT/test.log" | head -40; tail -3 "$OUT/test.log" ;;
    sanitize)
      for tool in ${SAN_TOOLS:-memcheck racecheck}; do
        step "compute-sanitizer $tool"
        sel="matches and float32 and 300x257 and 0.3"
        [ $tool = memcheck ] && sel="matches and float32 and 300x257"
        timeout ${SAN_TIMEOUT:-200} compute-sanitizer --tool $tool --error-exitcode 9 python3 -m pytest tests/test_cuda_backend.py \
          -q -x -p no:cacheprovider -k "$sel" 2>&1 | tail -8 | tee "$OUT/sanitize_$tool.log"; echo "rc=$?"
      done ;;
    bench)
      step bench; python3 -m torch_sparse_metal_tools.bench --device cuda --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
        | tee "$OUT/bench.log" | grep -v "^case" ;;
    ncu)
      step ncu; timeout 60 ncu --clock-control none -k regex:csr_tile --section SpeedOfLight --section Occupancy \
        python3 benchmarks/cuda_profile_case.py > "$OUT/ncu.txt" 2>&1; echo "rc=$?"
      grep -E "csr_tile|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Compute \(SM\)|Achieved Occupancy|Duration|Registers" "$OUT/ncu.txt" | head -60 ;;
    *) echo "unknown step $arg" ;;
  esac
done
