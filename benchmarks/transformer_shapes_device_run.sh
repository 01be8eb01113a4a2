#!/usr/bin/env bash
# One call on the GPU machine for benchmarks/transformer_shapes.py: build the extension (as
# benchmarks/cuda_device_run.sh does), then the sweep; JSON, markdown and log in $OUT.
# Usage (device machine, repo root): bash benchmarks/transformer_shapes_device_run.sh [build] [test] [run]
#   TS_NAME: file stem (default transformer_shapes); TS_ARGS: extra arguments of transformer_shapes.py;
#   TESTS: the pytest selection of the test step.
source benchmarks/device_run_prelude.sh
step_test() { TESTS=${TESTS:-"tests/test_cuda_backend.py tests/test_vector_cuda.py"} bash benchmarks/cuda_device_run.sh test; }
step_run() {
  step transformer_shapes
  python3 benchmarks/transformer_shapes.py --device cuda --out "$OUT" --name "${TS_NAME:-transformer_shapes}" \
    ${TS_ARGS:-} 2>&1 | tee "$OUT/${TS_NAME:-transformer_shapes}.log"
}
run_steps "$@"
