"""Time of the CPU ops at a few sizes (the package's timer: median of interleaved rounds), to measure what the O(E)
index validation of csr_linear_checks.cpp costs: run it on a build with the checks and on one without, same
machine.

Example:
    python benchmarks/cpu_validation_cost.py --label with_checks
"""

from __future__ import annotations

import argparse
import json
import platform

import torch

import torch_sparse_metal  # noqa: F401
from torch_sparse_metal import CSRTopology
from torch_sparse_metal.timing import Timer

OPS = torch.ops.torch_sparse_metal
CASES = [(1024, 0.05, 1), (1024, 0.05, 256), (4096, 0.01, 1), (4096, 0.01, 256)]


def _medians(n: int, density: float, batch: int, reps: int) -> dict[str, float]:
    topo = CSRTopology.random(n, n, density, generator=torch.Generator().manual_seed(0))
    x, go, w = torch.randn(batch, n), torch.randn(batch, n), torch.randn(topo.nnz)
    fns = {"forward": lambda: OPS.csr_linear(x, w, *topo.kernel_args(), "auto"),
           "backward": lambda: OPS.csr_linear_backward(go, x, w, *topo.kernel_args(), "fused_atomic")}
    times = Timer(torch.device("cpu"), reps).many(fns)
    return {"nnz": topo.nnz, **{f"{k}_ms": t.ms for k, t in times.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", required=True)
    p.add_argument("--reps", type=int, default=41)
    args = p.parse_args()
    rows = []
    for n, density, batch in CASES:
        row = {"label": args.label, "n": n, "density": density, "batch": batch,
               **_medians(n, density, batch, args.reps)}
        rows.append(row)
        print(f"{args.label:>14} {n}^2 d={density} B={batch:<4} fwd {row['forward_ms']:8.3f} ms  "
              f"bwd {row['backward_ms']:8.3f} ms")
    print(json.dumps({"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                      "rows": rows}))


if __name__ == "__main__":
    main()
