"""One forward and both backward strategies of a Metal design (through the CUDA translation) and of our CUDA
kernels, at 4096x4096, density 5%, batch 1024: the case Nsight Compute profiles on the H200.

The translated kernels are named ``tsm_entry_<i>``; this prints which Metal kernel each index is.
``--baseline DIR`` profiles the design in DIR (benchmarks/metal_baseline.sh) instead of the shipped one.

Example:
    ncu --clock-control none -k regex:"tsm_entry|csr_tile" --metrics gpu__time_duration.sum \
        python3 benchmarks/metal_profile_case.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

import torch_sparse_metal

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tsm_dev lives in the checkout, not installed
from tsm_dev.metal_bench import metal_designs  # noqa: E402
from tsm_dev.msl.source import parse_kernels, preprocess  # noqa: E402

OPS = torch.ops.torch_sparse_metal

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", type=Path, default=None)
    args = parser.parse_args()
    metal = metal_designs()["metal"] if args.baseline is None else metal_designs(args.baseline)["metal_base"]
    source = metal.source()  # the design's own library source (a baseline's files behind its constants)
    for i, k in enumerate(parse_kernels(preprocess(source, "csr_linear.metal"))):
        print(f"tsm_entry_{i} = {k.host_name}")
    topo = torch_sparse_metal.CSRTopology.random(4096, 4096, 0.05, generator=torch.Generator().manual_seed(0))
    topo = topo.to("cuda")
    x = torch.randn(1024, 4096, device="cuda")
    g = torch.randn(1024, 4096, device="cuda")
    w = torch.randn(topo.nnz, device="cuda")
    metal.forward(x, w, *topo.kernel_args())
    OPS.csr_linear(x, w, *topo.kernel_args(), "auto")
    for strategy in ("fused_atomic", "atomic_free"):
        metal.backward(g, x, w, *topo.kernel_args(), strategy)
        OPS.csr_linear_backward(g, x, w, *topo.kernel_args(), strategy)
    torch.cuda.synchronize()
