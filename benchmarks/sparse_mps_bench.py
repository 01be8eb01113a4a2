"""torch's own sparse CSR products on MPS (through torch_sparse_metal's Metal kernels) against what a Mac user has
without them: torch's COO matmul on MPS, dense matmul on MPS, and torch's CSR on the CPU; forward and backward
(gradients to the dense operand and the sparse values), at the shapes of the users' threads (issue #39).

On a Mac (prints JSON rows; nothing here has been timed on Apple hardware yet)::

    python benchmarks/sparse_mps_bench.py --device mps --out sparse_mps.json

On Linux, ``--device cpu --quick`` is the smoke run of the tests (the "csr" rows are then torch's CPU kernels).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch

import torch_sparse_metal  # noqa: F401  (registers the MPS kernels)

warnings.filterwarnings("ignore", message="Sparse (CSR tensor support is in beta|invariant checks)")

#: (name, rows, cols, nonzeros, dense columns): bag-of-words (pytorch#112849), the 20,000^2 benchmark of
#: pytorch#165232 at 10,000 and 100,000 nonzeros, and a 90%-zeros count matrix (cells x genes, scvi-tools#3981).
CASES = [("bag_of_words", 3, 214_000, 92, 64), ("165232_10k", 20_000, 20_000, 10_000, 200),
         ("165232_100k", 20_000, 20_000, 100_000, 200), ("counts_90pct_zero", 2_048, 2_000, 409_600, 64)]
QUICK = [("bag_of_words", 3, 2_140, 92, 16), ("165232_small", 500, 500, 1_000, 20)]
METHODS = ("csr", "coo", "dense", "cpu_csr")


def sync(device: str) -> None:
    if device == "mps":
        torch.mps.synchronize()
    elif device == "cuda":
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device: str, reps: int) -> float:
    """Median wall time of ``fn`` (device synchronised around each call), after one warm-up call."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def operands(rows: int, cols: int, nnz: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor,
                                                                                    torch.Tensor]:
    """Random COO indices (no duplicates), values and a dense right operand, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.unique(torch.randint(rows * cols, (int(nnz * 1.1) + 8,), generator=g))[:nnz]
    flat = flat[torch.randperm(flat.numel(), generator=g)].sort().values
    idx = torch.stack([flat // cols, flat % cols])
    return idx, torch.randn(flat.numel(), generator=g), torch.randn(cols, width, generator=g)


def time_method(op: Callable, a: torch.Tensor, b: torch.Tensor, device: str, reps: int) -> dict[str, float]:
    """The forward, and the forward plus backward (gradients to both operands), of ``op(a, b)``."""
    fwd = time_ms(lambda: op(a, b), device, reps)
    a_req, b_req = a.detach().requires_grad_(), b.detach().requires_grad_()

    def step():
        a_req.grad = b_req.grad = None
        op(a_req, b_req).sum().backward()

    return {"fwd_ms": fwd, "fwd_bwd_ms": time_ms(step, device, reps)}


def run_case(name: str, rows: int, cols: int, nnz: int, width: int, device: str, reps: int,
             dtype: torch.dtype) -> list[dict]:
    idx, vals, b = operands(rows, cols, nnz, width)
    coo = torch.sparse_coo_tensor(idx, vals, (rows, cols)).coalesce()
    makers = {
        "csr": (coo.to_sparse_csr(), device, torch.sparse.mm),
        "coo": (coo, device, torch.sparse.mm),
        "dense": (coo.to_dense(), device, torch.mm),
        "cpu_csr": (coo.to_sparse_csr(), "cpu", torch.sparse.mm),
    }
    out = []
    for method, (a, dev, op) in makers.items():
        row = {"case": name, "rows": rows, "cols": cols, "nnz": int(coo._nnz()), "width": width, "method": method,
               "device": dev, "dtype": str(dtype).replace("torch.", ""), "torch": torch.__version__}
        try:
            row.update(time_method(op, a.to(device=dev, dtype=dtype), b.to(device=dev, dtype=dtype), dev, reps))
        except (RuntimeError, NotImplementedError) as e:  # e.g. a dense 20,000^2 that does not fit
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="mps" if torch.backends.mps.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--quick", action="store_true", help="small shapes (the CPU smoke run)")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = []
    for case in QUICK if args.quick else CASES:
        rows += run_case(*case, device=args.device, reps=args.reps, dtype=dtype)
    result = {"machine": platform.platform(), "processor": platform.processor(), "rows": rows}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
