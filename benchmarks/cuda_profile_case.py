"""One forward and both backward strategies at 4096x4096, density 5%, batch 1024, for ncu on the H200.

Example:
    ncu --clock-control none -k regex:csr_tile --section SpeedOfLight --section Occupancy \
        python3 benchmarks/cuda_profile_case.py
"""

from __future__ import annotations

import torch

import torch_sparse_metal  # noqa: F401
from torch_sparse_metal.topology import CSRTopology

OPS = torch.ops.torch_sparse_metal

if __name__ == "__main__":
    topo = CSRTopology.random(4096, 4096, 0.05, generator=torch.Generator().manual_seed(0)).to("cuda")
    x = torch.randn(1024, 4096, device="cuda")
    g = torch.randn(1024, 4096, device="cuda")
    w = torch.randn(topo.nnz, device="cuda")
    OPS.csr_linear(x, w, *topo.kernel_args(), "auto")
    for strategy in ("fused_atomic", "atomic_free"):
        OPS.csr_linear_backward(g, x, w, topo.row_ptr, topo.dst, topo.src, strategy)
    torch.cuda.synchronize()
