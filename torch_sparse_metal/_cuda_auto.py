"""The ``backward="auto"`` rule on CUDA, from H200 measurements (``benchmarks/results/h200.json``, docs/cuda.md).

Measured with ``python -m torch_sparse_metal.bench --device cuda --cases all --variants`` on one NVIDIA H200
(torch 2.11, CUDA 13), float32, both strategies with the default (direct) kernels, in one run:

- ``fused_atomic`` was faster in every case that takes more than ~0.1 ms: by 1.16x to 1.37x at 4096x4096, batch
  1024, densities 0.1% to 50%; by 1.20x to 1.51x at density 5%, batch 256 to 4096; by 1.76x at 16384x16384, 1%,
  batch 4096 (6.70 ms against 11.81 ms). It gathers each output-gradient row once and uses it for both
  gradients; the two-pass strategy gathers it once per pass, and that second gather costs more than the atomics
  (one per edge and 128-column batch chunk, no contention) and the warp reductions.
- On smaller problems (22K-61K edges at 1024x1024, batch 256, the sizes of docs/metal.md's published M1 Pro
  figures; batch <= 128 at 4096x4096, 5%) both
  take 0.03-0.1 ms and neither wins by more than 9%, within run-to-run noise: ``atomic_free`` won three of
  those eleven cases, by 1-9%.

So the rule is ``fused_atomic`` everywhere: the opposite of the first, naive CUDA kernels (docs/cuda.md), and the
same answer as the published M1 Pro figures on Metal, for a different reason (bytes, not dispatch overhead).
"""

from __future__ import annotations

__all__ = ["choose_cuda_strategy"]


def choose_cuda_strategy(in_features: int, out_features: int, nnz: int, batch: int) -> str:
    """The backward strategy for a CUDA problem of this size.

    Example:
        >>> choose_cuda_strategy(4096, 4096, 838_861, 1024)
        'fused_atomic'
    """
    del in_features, out_features, nnz, batch  # no measured case favoured atomic_free beyond noise
    return "fused_atomic"
