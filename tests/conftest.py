"""Test-wide settings: kernels poison the buffers they must overwrite (NaN), so unwritten elements show; and
``backward="auto"`` follows its static rule (no timing, no cache file), so results do not depend on the machine.
tests/test_tuning.py turns tuning on with a temporary cache."""

import os

os.environ.setdefault("TORCH_SPARSE_METAL_POISON", "1")
os.environ.setdefault("TORCH_SPARSE_METAL_TUNE", "0")
