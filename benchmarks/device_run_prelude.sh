# Sourced by the device-run scripts (benchmarks/*_device_run.sh): a failing command fails its pipeline, results go
# to $OUT (default /tmp/out), Python prints as it goes, and step NAME prints a timed heading.
set -o pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
step() { echo "=== $* ($(date +%T))"; }
# run_steps "$@": each argument names a step, run by the script's function step_<name>; build is the CUDA build of
# benchmarks/cuda_device_run.sh unless the script defines its own. An unknown name is said and skipped.
step_build() { bash benchmarks/cuda_device_run.sh build; }
run_steps() {
  for arg in "$@"; do
    if declare -F "step_$arg" > /dev/null; then "step_$arg"; else echo "unknown step $arg"; fi
  done
}
