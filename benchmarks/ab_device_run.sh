#!/usr/bin/env bash
# A/B on one GPU machine: the working tree's kernels against HEAD's (build/ab/head.tar, made here with
# `git archive HEAD csrc torch_sparse_metal setup.py pyproject.toml > build/ab/head.tar` and carried), each built
# and measured by benchmarks/transformer_shapes.py with the same arguments (AB_ARGS) in the same call.
# Usage (device machine, repo root): bash benchmarks/ab_device_run.sh [test]
source benchmarks/device_run_prelude.sh
export TORCH_CUDA_ARCH_LIST=9.0 TORCH_SPARSE_METAL_CUDA=1 MAX_JOBS=16 CC=/usr/bin/gcc CXX=/usr/bin/g++
head=/tmp/ab_head; rm -rf "$head"; mkdir -p "$head"; tar -xf build/ab/head.tar -C "$head"
step "build HEAD"; (cd "$head" && python3 setup.py build_ext --inplace > "$OUT/build_head.log" 2>&1) || tail -20 "$OUT/build_head.log"
bash benchmarks/cuda_device_run.sh build
[ "${1:-}" = test ] && bash benchmarks/cuda_device_run.sh test
step "bench: working tree"
python3 benchmarks/transformer_shapes.py --device cuda --out "$OUT" --name new ${AB_ARGS:-} > "$OUT/new.log" 2>&1 || tail -5 "$OUT/new.log"
step "bench: HEAD"
PYTHONPATH="$head" python3 -c 'import torch_sparse_metal, sys; print(torch_sparse_metal.__file__)'
PYTHONPATH="$head" python3 benchmarks/transformer_shapes.py --device cuda --out "$OUT" --name head ${AB_ARGS:-} \
  > "$OUT/head.log" 2>&1 || tail -5 "$OUT/head.log"
python3 benchmarks/ab_compare.py "$OUT/head.json" "$OUT/new.json" > "$OUT/ab.txt"
rm -f "$OUT/head.md" "$OUT/build.log" "$OUT/build_head.log"  # at most 8 files come back
cat "$OUT/ab.txt"
