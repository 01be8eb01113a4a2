"""Median times of the csr_linear ops (forward, and the backward per strategy) at a few shapes, on one device,
for whichever torch_sparse_metal is first on the path. Used to compare two builds of the kernels in one run
(benchmarks/baseline_compare.sh); prints one JSON object.

Usage: python benchmarks/op_timing.py [--device cuda] [--reps 30] [--label NAME]
"""

from __future__ import annotations

import argparse
import json

import torch

import torch_sparse_metal
from torch_sparse_metal import CSRTopology
from torch_sparse_metal.timing import median_ms

# (in_features, out_features, density, batch, dtype)
CASES = [(4096, 4096, 0.05, 1024, "float32"), (4096, 4096, 0.05, 1024, "bfloat16"),
         (1024, 1024, 0.1, 256, "float32"), (784, 300, 0.1, 64, "float32")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--label", default="", help="copied into the output (which build this is)")
    args = p.parse_args()
    device = torch.device(args.device)
    rows = [time_case(*case, device, args.reps) for case in CASES]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(json.dumps({"label": args.label, "module": torch_sparse_metal.__file__, "device": name, "rows": rows}))


def time_case(n_in: int, n_out: int, density: float, batch: int, dtype: str, device: torch.device,
              reps: int) -> dict:
    ops = torch.ops.torch_sparse_metal
    g = torch.Generator().manual_seed(0)
    topo = CSRTopology.random(n_in, n_out, density, generator=g).to(device)
    t = getattr(torch, dtype)
    x = torch.randn(batch, n_in, generator=g).to(device, t)
    w = torch.randn(topo.nnz, generator=g).to(device, t)
    go = torch.randn(batch, n_out, generator=g).to(device, t)
    idx = topo.kernel_args()
    row = {"case": f"{n_in}x{n_out} d{density} B{batch} {dtype}",
           "forward": median_ms(lambda: ops.csr_linear(x, w, *idx, "auto"), device, reps)}
    for s in ("fused_atomic", "atomic_free"):
        row[s] = median_ms(lambda s=s: ops.csr_linear_backward(go, x, w, *idx, s), device, reps)
    return row

if __name__ == "__main__":
    main()
