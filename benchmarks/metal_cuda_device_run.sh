#!/usr/bin/env bash
# One call on the H200 for the Metal kernels' CUDA translation: build, the Metal tests on the GPU, the benchmark of
# the Metal designs beside our CUDA kernels, and Nsight Compute counters of each kernel at 4096^2, 5%, B1024.
# Usage (device machine, repo root): bash benchmarks/metal_cuda_device_run.sh [build] [test] [bench] [ncu] [traffic]
#   traffic: the executor's traffic model beside Nsight Compute at the M1 Pro sizes (benchmarks/traffic_validate.py).
#   BENCH_CASES (default "design seed"), BENCH_REPS (default 30), BENCH_ARGS (e.g. --graphs), BENCH_NAME (file stem,
#   default metal_h200), BASELINE (default .metal_baseline, made here by
#   `bash benchmarks/metal_baseline.sh b6c1e25 .metal_baseline` and carried to the device).
source "$(dirname "$0")/device_run_prelude.sh"
step_test() {
  step test
  python3 -m pytest tests/test_metal_backend.py tests/test_metal_executor.py -q -p no:cacheprovider -rs \
    > "$OUT/metal_test.log" 2>&1; echo "rc=$?"
  grep -E "passed|failed|Error|error" "$OUT/metal_test.log" | head -30
}
step_bench() {
  step bench
  local base=()
  [ -d "${BASELINE:-.metal_baseline}" ] && base=(--baseline "${BASELINE:-.metal_baseline}")
  python3 -m tsm_dev.metal_bench --device cuda --cases ${BENCH_CASES:-design seed} --reps ${BENCH_REPS:-30} ${BENCH_ARGS:-} \
    "${base[@]}" --out "$OUT" --name ${BENCH_NAME:-metal_h200} 2>&1 \
    | tee "$OUT/${BENCH_NAME:-metal_h200}.log" \
    | sed -n "/Metal designs/,\$p"
}
step_ncu() {
  step ncu
  local metrics=gpu__time_duration.sum,dram__bytes.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum
  metrics=$metrics,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum
  metrics=$metrics,l1tex__t_requests_pipe_lsu_mem_global_op_red.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_red.sum
  metrics=$metrics,l1tex__t_requests_pipe_lsu_mem_global_op_atom.sum
  metrics=$metrics,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
  metrics=$metrics,launch__occupancy_limit_registers,launch__occupancy_limit_shared_mem,sm__throughput.avg.pct_of_peak_sustained_elapsed
  timeout 300 ncu --clock-control none -k regex:"tsm_entry|csr_tile|transpose" --metrics "$metrics" \
    python3 benchmarks/metal_profile_case.py > "$OUT/metal_ncu.txt" 2>&1; echo "rc=$?"
  python3 benchmarks/ncu_summary.py "$OUT/metal_ncu.txt"
  if [ -d "${BASELINE:-.metal_baseline}" ]; then  # the baseline design's kernels alone
    timeout 300 ncu --clock-control none -k regex:"tsm_entry" --metrics "$metrics" python3 \
      benchmarks/metal_profile_case.py --baseline "${BASELINE:-.metal_baseline}" > "$OUT/metal_ncu_base.txt" 2>&1
    echo "rc=$?"; python3 benchmarks/ncu_summary.py "$OUT/metal_ncu_base.txt"
  fi
}
step_traffic() {
  step traffic
  timeout 580 python3 benchmarks/traffic_validate.py --out "$OUT" 2>&1 | tee "$OUT/traffic_validate.log" | tail -80
}
run_steps "$@"
