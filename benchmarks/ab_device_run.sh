#!/usr/bin/env bash
# A/B on one GPU machine: the working tree's kernels against HEAD's, each built and measured by
# benchmarks/transformer_shapes.py with the same arguments (AB_ARGS) in the same call. HEAD comes as build/ab/head.tar,
# made here and carried:
#   git archive HEAD csrc torch_sparse_metal torch_sparse_metal_tools setup.py pyproject.toml README.md > build/ab/head.tar
# Both trees are built in place and found through PYTHONPATH alone: an editable install's import hook could answer
# for either tree.
# Usage (device machine, repo root): bash benchmarks/ab_device_run.sh [test]   (TESTS: the pytest selection,
# TEST_TIMEOUT: its limit in seconds, default 300)
source benchmarks/device_run_prelude.sh
export TORCH_CUDA_ARCH_LIST=9.0 TORCH_SPARSE_METAL_CUDA=1 MAX_JOBS=16 CC=/usr/bin/gcc CXX=/usr/bin/g++
head=/tmp/ab_head; rm -rf "$head"; mkdir -p "$head"; tar -xf build/ab/head.tar -C "$head"
step "build HEAD and the working tree"; nvidia-smi -L
(cd "$head" && python3 setup.py build_ext --inplace > "$OUT/build_head.log" 2>&1 || tail -20 "$OUT/build_head.log") &
python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1 || tail -20 "$OUT/build.log"
wait
for tree in "$PWD" "$head"; do
  (cd /tmp && PYTHONPATH="$tree" python3 -c 'import torch_sparse_metal as t; print("imports", t.__file__)')
done
if [ "${1:-}" = test ]; then
  step test; PYTHONPATH="$PWD" timeout ${TEST_TIMEOUT:-300} python3 -m pytest ${TESTS:-tests/test_vector_cuda.py} -q -p no:cacheprovider -rs \
    > "$OUT/test.log" 2>&1; echo "rc=$?"; grep -E "^(FAILED|ERROR)" "$OUT/test.log" | head -20; tail -3 "$OUT/test.log"
fi
for side in new head; do
  step "bench: $side"; tree=$PWD; [ $side = head ] && tree=$head
  PYTHONPATH="$tree" python3 benchmarks/transformer_shapes.py --device cuda --out "$OUT" --name $side ${AB_ARGS:-} \
    > "$OUT/$side.log" 2>&1 || tail -5 "$OUT/$side.log"
done
python3 benchmarks/ab_compare.py "$OUT/head.json" "$OUT/new.json" > "$OUT/ab.txt"
rm -f "$OUT/head.md" "$OUT/build.log" "$OUT/build_head.log"  # at most 8 files come back
cat "$OUT/ab.txt"
