"""Test-wide settings: kernels poison the buffers they must overwrite (NaN), so unwritten elements show."""

import os

os.environ.setdefault("TORCH_SPARSE_METAL_POISON", "1")
