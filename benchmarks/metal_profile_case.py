"""One forward and both backward strategies of the Metal kernels (through their CUDA translation) and of our
CUDA kernels, at 4096x4096, density 5%, batch 1024: the case Nsight Compute profiles on the H200.

The translated kernels are named ``tsm_entry_<i>``; this prints which Metal kernel each index is.

Example:
    ncu --clock-control none -k regex:"tsm_entry|csr_tile" --metrics gpu__time_duration.sum \
        python3 benchmarks/metal_profile_case.py
"""

from __future__ import annotations

import torch

import torch_sparse_metal  # noqa: F401
from torch_sparse_metal.backends.mps import MetalCsrLinear, load_source
from torch_sparse_metal.testing.msl import cuda
from torch_sparse_metal.testing.msl.source import parse_kernels, preprocess

OPS = torch.ops.torch_sparse_metal

if __name__ == "__main__":
    for i, k in enumerate(parse_kernels(preprocess(load_source(), "csr_linear.metal"))):
        print(f"tsm_entry_{i} = {k.host_name}")
    metal = MetalCsrLinear(cuda.compile_shader, "cuda", poison=False)
    topo = torch_sparse_metal.CSRTopology.random(
        4096, 4096, 0.05, generator=torch.Generator().manual_seed(0)).to("cuda")
    x = torch.randn(1024, 4096, device="cuda")
    g = torch.randn(1024, 4096, device="cuda")
    w = torch.randn(topo.nnz, device="cuda")
    metal.forward(x, w, *topo.kernel_args())
    OPS.csr_linear(x, w, *topo.kernel_args(), "auto")
    for strategy in ("fused_atomic", "atomic_free"):
        metal.backward(g, x, w, topo.row_ptr, topo.dst, topo.src, strategy)
        OPS.csr_linear_backward(g, x, w, topo.row_ptr, topo.dst, topo.src, strategy)
    torch.cuda.synchronize()
