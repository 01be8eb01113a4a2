"""Reproduces the CUDA error-path call of tests/test_cuda_backend.py outside pytest (device machine only):
calls the op with an input of the wrong width, prints the error, and marks the interpreter's exit so that a
crash can be placed in the call or at shutdown."""

import atexit

import torch

import torch_sparse_metal  # noqa: F401  (loads the ops)
from torch_sparse_metal.topology import CSRTopology

atexit.register(lambda: print("atexit reached", flush=True))
topo = CSRTopology.random(8, 6, 0.5, generator=torch.Generator().manual_seed(0)).to("cuda")
w = torch.randn(topo.nnz, device="cuda")
try:
    torch.ops.torch_sparse_metal.csr_linear(torch.randn(3, 9, device="cuda"), w, *topo.kernel_args(), "auto")
except RuntimeError as e:
    print("raised:", str(e).splitlines()[0], flush=True)
torch.cuda.synchronize()
print("after the call", flush=True)
