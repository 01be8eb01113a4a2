"""The Metal SpMM kernels side by side: the direct kernel (``spmm``, the static rule) against the row-window kernel
(``spmm_window``, P = 1 and 4), for the forward and for atomic_free's backward (whose pass 2 is the SpMM), in one
round-robin per case and dtype, with each output first checked against a float64 reference.

On a Mac (Metal, ``torch.mps.compile_shader``; ``auto`` is the registered MPS op as a user runs it)::

    python benchmarks/metal_window_bench.py --device mps --json metal_window_mps.json

On an NVIDIA GPU the same shaders and host code run through the CUDA translation (tsm_dev/msl/cuda.py), beside our
CUDA kernels (``cuda``); such times say nothing about Apple GPUs (docs/metal.md)::

    python benchmarks/metal_window_bench.py --device cuda --graphs --json metal_window_h200.json

``--device cpu`` runs the kernels under the MSL-on-CPU executor (a check of this script, not a timing).

Prints a table (median ms over the rounds, ratio to the direct kernel of the same run) and writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tsm_dev, from a checkout

from torch_sparse_metal import CSRTopology, devices  # noqa: E402
from torch_sparse_metal.backends.mps import MetalCsrLinear  # noqa: E402
from torch_sparse_metal.timing import Timer  # noqa: E402
from torch_sparse_metal_tools.testing.reference import dense_weight  # noqa: E402
from tsm_dev.metal_bench import rel_error, report_rows  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _case(text: str) -> tuple[int, float, int]:
    n, density, batch = text.split(",")
    return int(n), float(density), int(batch)


def designs(device: str) -> dict[str, MetalCsrLinear]:
    """label -> host: the direct SpMM at the static P, the window at P = 1 and 4."""
    if device == "mps":
        compile_fn = torch.mps.compile_shader
    elif device == "cpu":
        from tsm_dev.msl import compile_shader as compile_fn
    else:
        from tsm_dev.msl import cuda

        compile_fn = cuda.compile_shader
    return {"direct": MetalCsrLinear(compile_fn, device, poison=False, spmm="direct"),
            "window_p1": MetalCsrLinear(compile_fn, device, poison=False, spmm="window", values_per_lane=1),
            "window_p4": MetalCsrLinear(compile_fn, device, poison=False, spmm="window", values_per_lane=4)}


def run_case(n: int, density: float, batch: int, dtype: torch.dtype, device: str, hosts: dict, reps: int,
             graphs: bool) -> list[dict]:
    g = torch.Generator().manual_seed(n + batch + int(density * 1e4))
    topo = CSRTopology.random(n, n, density, generator=g)
    x, w = torch.randn(batch, n, generator=g), torch.randn(topo.nnz, generator=g)
    go = torch.randn(batch, n, generator=g)
    x, w, go = (t.to(device, dtype) for t in (x, w, go))
    ref_device = "cuda" if device == "cuda" else "cpu"  # MPS has no float64
    w64 = dense_weight(w.cpu(), topo).to(ref_device)
    x64, go64 = x.to(ref_device).double(), go.to(ref_device).double()
    y_ref, gx_ref = (x64 @ w64.T).cpu(), (go64 @ w64).cpu()
    del w64, x64, go64
    args = topo.to(device).kernel_args()
    ops = torch.ops.torch_sparse_metal
    fwd = {label: (lambda h=h: h.forward(x, w, *args)) for label, h in hosts.items()}
    bwd = {label: (lambda h=h: h.backward(go, x, w, *args, "atomic_free")) for label, h in hosts.items()}
    ours = {"cuda": "cuda", "mps": "auto", "cpu": "cpu"}[device]
    fwd[ours] = lambda: ops.csr_linear(x, w, *args, "atomic_free")
    bwd[ours] = lambda: ops.csr_linear_backward(go, x, w, *args, "atomic_free")
    errors = {f"fwd {k}": rel_error(f(), y_ref) for k, f in fwd.items()}
    errors |= {f"grad_x {k}": rel_error(f()[0], gx_ref) for k, f in bwd.items()}
    bad = {k: e for k, e in errors.items() if not e < (1e-5 if dtype == torch.float32 else 2e-2)}
    if bad:
        raise SystemExit(f"{n}², {density}, B{batch}, {dtype}: wrong results {bad}")
    timer = Timer(torch.device(device), reps, graphs=graphs)
    rows = []
    for stage, fns in (("forward", fwd), ("atomic_free bwd", bwd)):
        times = timer.many(fns)
        for label, t in times.items():
            rows.append({"n": n, "density": density, "batch": batch, "edges": topo.nnz, "dtype": str(dtype)[6:],
                         "stage": stage, "method": label, "ms": t.ms, "spread_ms": t.spread_ms,
                         "vs_direct": t.ms / times["direct"].ms, "rel_error": errors[
                             f"{'fwd' if stage == 'forward' else 'grad_x'} {label}"]})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["mps", "cuda", "cpu"], required=True)
    parser.add_argument("--cases", type=_case, nargs="+", default=[(4096, 0.01, 1024), (4096, 0.05, 1024)],
                        help="features,density,batch (a square layer)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--graphs", action="store_true", help="CUDA: time CUDA-graph replays")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    hosts = designs(args.device)
    name = ("cpu (MSL-on-CPU executor)" if args.device == "cpu"
            else devices.get(args.device).describe(torch.device(args.device)))
    print(f"{name}, torch {torch.__version__}; median ms of {args.reps} interleaved rounds"
          + (", graph replays" if args.graphs else ""))
    rows = []
    for n, density, batch in args.cases:
        for dtype in args.dtypes:
            rows += run_case(n, density, batch, DTYPES[dtype], args.device, hosts, args.reps, args.graphs)
    report_rows(rows, lambda r: f"{r['n']}², {r['density'] * 100:g}%, B{r['batch']}", "direct", name, args.json)


if __name__ == "__main__":
    main()
