"""The vector layout of the ops (a weight [vectors, V]: V consecutive outputs share each input connection) against the
same layer as unstructured edges (``csr_linear`` over the element-level topology, ``topology.element_index``: the same
connections edge by edge) and against dense ``x @ W^T``, in one round-robin per case and dtype: the forward and both
backward strategies, each output first checked against the float64 reference.

On a Mac (the registered MPS ops, i.e. shaders/vector_csr_linear.metal and shaders/csr_linear.metal through
``torch.mps.compile_shader``)::

    python benchmarks/metal_vector_bench.py --device mps --json metal_vector_mps.json
    python benchmarks/metal_vector_bench.py --device mps --cases 1024,0.05,16,256 4096,0.05,32,1024

``--device cuda`` / ``--device cpu`` time the registered ops of those devices the same way. ``--executor`` (with
``--device cpu``) runs both Metal hosts under the MSL-on-CPU executor instead: a check of this script, not a timing.

Prints a table (median ms over the rounds, the ratio to the element-level op of the same run, the spread) and writes
the rows as JSON with the device's description.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tsm_dev, from a checkout

from torch_sparse_metal import CSRTopology, devices  # noqa: E402
from torch_sparse_metal.timing import Timer  # noqa: E402
from torch_sparse_metal.topology import element_index  # noqa: E402
from torch_sparse_metal_tools.testing.reference import reference_vector_outputs  # noqa: E402
from tsm_dev.metal_bench import rel_error, report_rows  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
STRATEGIES = ("fused_atomic", "atomic_free")


def _case(text: str) -> tuple[int, float, int, int]:
    n, density, block, batch = text.split(",")
    return int(n), float(density), int(block), int(batch)


def ops(device: str, executor: bool) -> tuple[Callable, Callable, Callable, Callable]:
    """(vector forward, vector backward, element forward, element backward), each taking the op's arguments (the
    same ops for both layouts, told apart by the weight)."""
    if not executor:
        o = torch.ops.torch_sparse_metal
        return (lambda *a: o.csr_linear(*a, "auto"), o.csr_linear_backward,
                lambda *a: o.csr_linear(*a, "auto"), o.csr_linear_backward)
    from torch_sparse_metal.backends.mps import MetalCsrLinear
    from tsm_dev.msl import compile_shader

    metal = MetalCsrLinear(compile_shader, "cpu")
    return metal.forward, metal.backward, metal.forward, metal.backward


def run_case(n: int, density: float, block: int, batch: int, dtype: torch.dtype, device: str, executor: bool,
             reps: int) -> list[dict]:
    """A square layer of ``n`` features at element density ``density`` as vectors of ``block`` outputs."""
    g = torch.Generator().manual_seed(n + block + batch + int(density * 1e4))
    groups = CSRTopology.random(n, n // block, density, generator=g)
    x, w = torch.randn(batch, n, generator=g), torch.randn(groups.nnz, block, generator=g)
    go = torch.randn(batch, n // block * block, generator=g)
    y_ref, gx_ref, gw_ref = reference_vector_outputs(go.to(dtype), x.to(dtype), w.to(dtype), groups)
    x, w, go = (t.to(device, dtype) for t in (x, w, go))
    args = groups.to(device).kernel_args()
    e_args = element_index(args, block)
    w1 = w.reshape(-1)
    dense = torch.zeros(n // block * block, n, dtype=dtype, device=device)
    dense[e_args[1].long(), e_args[2].long()] = w1
    vf, vb, ef, eb = ops(device, executor)
    fwd = {"vector": lambda: vf(x, w, *args), "element": lambda: ef(x, w1, *e_args), "dense": lambda: x @ dense.T}
    errors = {"forward " + k: rel_error(f(), y_ref) for k, f in fwd.items()}
    stages = {"forward": fwd}
    for s in STRATEGIES:
        stages[f"{s} bwd"] = {"vector": lambda s=s: vb(go, x, w, *args, s),
                              "element": lambda s=s: eb(go, x, w1, *e_args, s),
                              "dense": lambda: (go @ dense, go.T @ x)}
        got = vb(go, x, w, *args, s)
        errors[f"{s} bwd vector"] = max(rel_error(got[0], gx_ref), rel_error(got[1], gw_ref))
        got = eb(go, x, w1, *e_args, s)
        errors[f"{s} bwd element"] = max(rel_error(got[0], gx_ref), rel_error(got[1].view(-1, block), gw_ref))
        errors[f"{s} bwd dense"] = rel_error(go.double().cpu() @ dense.double().cpu(), gx_ref)
    limit = 1e-5 if dtype == torch.float32 else 2e-2
    bad = {k: e for k, e in errors.items() if not e < limit}
    if bad:
        raise SystemExit(f"{n}², {density}, V{block}, B{batch}, {dtype}: wrong results {bad}")
    timer = Timer(torch.device(device), reps)
    rows = []
    for stage, fns in stages.items():
        times = timer.many(fns)
        for label, t in times.items():
            rows.append({"n": n, "density": density, "block": block, "batch": batch, "vectors": groups.nnz,
                         "dtype": str(dtype)[6:], "stage": stage, "method": label, "ms": t.ms, "host_ms": t.host_ms,
                         "spread_ms": t.spread_ms, "vs_element": t.ms / times["element"].ms,
                         "rel_error": errors.get(f"{stage} {label}", float("nan"))})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["mps", "cuda", "cpu"], required=True)
    parser.add_argument("--executor", action="store_true", help="cpu only: the Metal hosts under the MSL executor")
    parser.add_argument("--cases", type=_case, nargs="+",
                        default=[(1024, 0.05, 16, 256), (4096, 0.05, 16, 1024), (4096, 0.05, 32, 1024)],
                        help="features,density,V,batch (a square layer; density of its element-level edges)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16"], choices=list(DTYPES))
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.executor and args.device != "cpu":
        parser.error("--executor runs on the CPU: use --device cpu")
    name = ("cpu (MSL-on-CPU executor: no timing)" if args.executor
            else devices.get(args.device).describe(torch.device(args.device)))
    print(f"{name}, torch {torch.__version__}; median ms of {args.reps} interleaved rounds (synchronised wall time "
          f"on MPS and CPU, device time on CUDA)")
    rows = []
    for n, density, block, batch in args.cases:
        for dtype in args.dtypes:
            rows += run_case(n, density, block, batch, DTYPES[dtype], args.device, args.executor, args.reps)
    report_rows(rows, lambda r: f"{r['n']}², {r['density'] * 100:g}%, V{r['block']}, B{r['batch']}", "element", name,
                args.json)
    return rows


if __name__ == "__main__":
    main()
