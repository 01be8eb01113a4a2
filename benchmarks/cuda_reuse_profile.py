"""One case for Nsight Compute: the bf16 forward at 4096², 5%, B1024 under each SpMM walk (direct, reuse, reuse8),
twice each. Usage: ncu -k regex:'reuse_spmm|csr_tile' python benchmarks/cuda_reuse_profile.py
(needs commit 92cd446's tree, which holds the panel-staged walk and its switch; docs/cuda.md)."""

from __future__ import annotations

import torch

import torch_sparse_metal  # noqa: F401  (loads the ops)
from torch_sparse_metal import _C
from torch_sparse_metal.topology import CSRTopology

topo = CSRTopology.random(4096, 4096, 0.05, generator=torch.Generator().manual_seed(0)).to("cuda")
x = torch.randn(1024, 4096, device="cuda").bfloat16()
w = torch.randn(topo.nnz, device="cuda").bfloat16()
for walk in ("direct", "reuse", "reuse8"):
    _C.set_cuda_spmm(walk)
    for _ in range(2):
        torch.ops.torch_sparse_metal.csr_linear(x, w, *topo.kernel_args(), "auto")
torch.cuda.synchronize()
