"""Test-wide settings: kernels poison the buffers they must overwrite (NaN), so unwritten elements show; and
``backward="auto"`` follows its static rule (tuning off: no timing, no cache file), so results do not depend on the
machine. tests/test_tuning.py turns tuning on with a temporary cache. OpenMP threads sleep when they wait
(``OMP_WAIT_POLICY=passive``, read by libgomp when torch loads): with the default spin-wait, a 2-core machine
with another heavy job ran each parallel op up to 10x slower (benchmarks/results/cpu_threads_under_load.txt)."""

import os

os.environ.setdefault("TORCH_SPARSE_METAL_POISON", "1")
os.environ.setdefault("TORCH_SPARSE_METAL_TUNE", "0")
os.environ.setdefault("OMP_WAIT_POLICY", "passive")
