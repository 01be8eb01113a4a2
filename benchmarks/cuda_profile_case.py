"""One forward and both backward strategies at 4096x4096, density 5%, batch 1024, for ncu on the H200.

Example:
    ncu --clock-control none -k regex:csr_tile --section SpeedOfLight --section Occupancy \
        python3 benchmarks/cuda_profile_case.py --dtype bfloat16
"""

from __future__ import annotations

import argparse

import torch

import torch_sparse_metal  # noqa: F401
from torch_sparse_metal.topology import CSRTopology

OPS = torch.ops.torch_sparse_metal

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    dtype = getattr(torch, p.parse_args().dtype)
    topo = CSRTopology.random(4096, 4096, 0.05, generator=torch.Generator().manual_seed(0)).to("cuda")
    x = torch.randn(1024, 4096, device="cuda", dtype=dtype)
    g = torch.randn(1024, 4096, device="cuda", dtype=dtype)
    w = torch.randn(topo.nnz, device="cuda", dtype=dtype)
    OPS.csr_linear(x, w, *topo.kernel_args(), "auto")
    for strategy in ("fused_atomic", "atomic_free"):
        OPS.csr_linear_backward(g, x, w, *topo.kernel_args(), strategy)
    torch.cuda.synchronize()
