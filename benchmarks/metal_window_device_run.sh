#!/usr/bin/env bash
# One call on the H200 for the row-window SpMM's CUDA translation (issue 27 item 2): build the extension, run
# tests/test_metal_window.py on the GPU (its cuda cases), then time direct vs window vs our CUDA kernels
# (benchmarks/metal_window_bench.py, graph replays). BASE_TAR, if set, is a tar of the committed csrc/ and the
# Python files that call into it, unpacked over the copy first, so that "our CUDA kernel" is the committed one
# whatever else the working tree holds (make it with `git archive HEAD csrc torch_sparse_metal/backends/cpu.py
# torch_sparse_metal/settings.py > build/metal_window_base.tar`). BENCH_ARGS go to the benchmark.
source "$(dirname "$0")/device_run_prelude.sh"
if [ -n "${BASE_TAR:-}" ]; then tar xf "$BASE_TAR" && echo "unpacked $BASE_TAR"; fi
bash benchmarks/cuda_device_run.sh build 2>&1 | tail -4
step test
timeout ${TEST_TIMEOUT:-90} python3 -m pytest tests/test_metal_window.py -k cuda -q -p no:cacheprovider -rs \
  > "$OUT/metal_window_tests.log" 2>&1; echo "rc=$?"; tail -4 "$OUT/metal_window_tests.log"
step bench
timeout ${BENCH_TIMEOUT:-120} python3 benchmarks/metal_window_bench.py --device cuda --graphs --reps ${BENCH_REPS:-30} \
  --json "$OUT/metal_window_h200.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/metal_window_h200.log"
step done
