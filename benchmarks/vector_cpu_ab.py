"""Minimum wall time of the vector layout's backward (one strategy) at 1024 -> 1024, 5%, V in 8/16/32: the A/B of two
CPU builds on a loaded machine, where medians moved by 2x (docs/vector.md, "Tried and not kept"). Run it alternately
under each build (copy each build's torch_sparse_metal/_C*.so in place between runs), several times.

Example:
    OMP_WAIT_POLICY=passive python benchmarks/vector_cpu_ab.py --batch 256 --strategy atomic_free
"""

from __future__ import annotations

import argparse
import time

import torch

import torch_sparse_metal  # noqa: F401  (registers the ops)
from torch_sparse_metal import CSRTopology

OPS = torch.ops.torch_sparse_metal


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--strategy", default="atomic_free", choices=["atomic_free", "fused_atomic"])
    args = p.parse_args()
    out = []
    for block in (8, 16, 32):
        groups = CSRTopology.random(1024, 1024 // block, 0.05, generator=torch.Generator().manual_seed(0))
        x, w, go = torch.randn(args.batch, 1024), torch.randn(groups.nnz, block), torch.randn(args.batch, 1024)
        index = groups.kernel_args()
        times = []
        for _ in range(max(10, 20480 // max(args.batch, 1))):
            t0 = time.perf_counter()
            OPS.csr_linear_backward(go, x, w, *index, args.strategy)
            times.append(time.perf_counter() - t0)
        out.append(f"V{block} {min(times) * 1e3:.2f} ms")
    print(f"batch {args.batch} {args.strategy}: " + "  ".join(out))


if __name__ == "__main__":
    main()
