#!/usr/bin/env bash
# Extract the Metal design of an earlier commit (its shaders and MPS host code) into a folder that
# `python -m tsm_dev.metal_bench --device cuda --baseline DIR` times beside the
# current one, through the CUDA translation of the shaders.
# Usage (repo root): bash benchmarks/metal_baseline.sh REV DIR    e.g. REV=b6c1e25 (the first, naive design)
set -euo pipefail
rev=${1:?usage: metal_baseline.sh REV DIR}
dir=${2:?usage: metal_baseline.sh REV DIR}
mkdir -p "$dir"
git show "$rev:shaders/csr_linear_common.h" > "$dir/csr_linear_common.h"
git show "$rev:shaders/csr_linear.metal" > "$dir/csr_linear.metal"
git show "$rev:torch_sparse_metal/backends/mps.py" > "$dir/mps.py"
echo "$rev" > "$dir/REV"
echo "wrote the Metal design of $rev to $dir"
