"""The vector layout's CPU kernels against the unstructured ones on the same layer's element topology (one edge per
vector lane: equal nonzeros, V times the index entries) and against dense torch.matmul, per vector length V: forward,
and each backward strategy. Medians of interleaved rounds (torch_sparse_metal.timing.Timer); the ops' results are
checked against each other before timing. Prints a markdown table and writes JSON.

Example:
    python benchmarks/vector_cpu_bench.py --n 1024 --density 0.05 --batch 256 --blocks 8,16,32 \
        --out benchmarks/results/vector_cpu/1024_d05_b256.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import torch_sparse_metal  # noqa: F401  (registers the ops)
from torch_sparse_metal import CSRTopology, devices
from torch_sparse_metal.backends import cpu
from torch_sparse_metal.timing import Timer
from torch_sparse_metal.topology import element_index
from torch_sparse_metal_tools.testing.reference import vector_dense_weight

OPS = torch.ops.torch_sparse_metal
STRATEGIES = ("fused_atomic", "atomic_free")


def _case(n: int, density: float, batch: int, block: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    groups = CSRTopology.random(n, n // block, density, generator=g)
    x = torch.randn(batch, n, generator=g).to(dtype)
    w = torch.randn(groups.nnz, block, generator=g).to(dtype)
    go = torch.randn(batch, (n // block) * block, generator=g).to(dtype)
    return groups, x, w, go


def _fns(groups: CSRTopology, x, w, go) -> dict[str, object]:
    """The callables of one case, keyed '<method> <stage>'; every backward returns (grad_x, grad_w)."""
    block = w.shape[1]
    vec = groups.kernel_args()
    elem = element_index(vec, block)
    we = w.reshape(-1)
    dense = vector_dense_weight(w, groups).to(w.dtype)  # [out, in]
    fns = {"vector forward": lambda: OPS.csr_linear(x, w, *vec, "auto"),
           "csr_linear forward": lambda: OPS.csr_linear(x, we, *elem, "auto"),
           "dense forward": lambda: x @ dense.t()}
    for s in STRATEGIES:
        fns[f"vector {s}"] = lambda s=s: OPS.csr_linear_backward(go, x, w, *vec, s)
        fns[f"csr_linear {s}"] = lambda s=s: OPS.csr_linear_backward(go, x, we, *elem, s)
    fns["dense backward"] = lambda: (go @ dense, go.t() @ x)  # grad_x and the full dense weight gradient
    return fns


def _check(fns: dict[str, object], w: torch.Tensor) -> None:
    """The vector op and csr_linear on the element topology compute the same sums (to float32 rounding)."""
    tol = dict(atol=1e-3, rtol=1e-3) if w.dtype in (torch.float32, torch.float64) else dict(atol=0.1, rtol=0.05)
    torch.testing.assert_close(fns["vector forward"]().float(), fns["csr_linear forward"]().float(), **tol)
    for s in STRATEGIES:
        (vx, vw), (ex, ew) = fns[f"vector {s}"](), fns[f"csr_linear {s}"]()
        torch.testing.assert_close(vx.float(), ex.float(), **tol)
        torch.testing.assert_close(vw.reshape(-1).float(), ew.float(), **tol)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1024, help="in_features = out_features")
    p.add_argument("--density", type=float, default=0.05)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--blocks", default="8,16,32")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "float16", "bfloat16"])
    p.add_argument("--reps", type=int, default=21)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="JSON file")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device("cpu")
    rows = []
    header = ("| V | nnz | stage | vector ms | csr_linear ms | dense ms | csr_linear / vector | dense / vector |\n"
              "|---|---|---|---|---|---|---|---|")
    lines = [header]
    for block in (int(b) for b in args.blocks.split(",")):
        groups, x, w, go = _case(args.n, args.density, args.batch, block, dtype, args.seed)
        fns = _fns(groups, x, w, go)
        _check(fns, w)
        times = Timer(device, args.reps).many(fns)
        ms = {k: t.ms for k, t in times.items()}
        spread = {k: t.spread_ms for k, t in times.items()}
        for stage, dense_key in (("forward", "dense forward"), *((s, "dense backward") for s in STRATEGIES)):
            v, e, d = ms[f"vector {stage}"], ms[f"csr_linear {stage}"], ms[dense_key]
            rows.append({"block": block, "nnz": groups.nnz * block, "vectors": groups.nnz, "stage": stage,
                         "vector_ms": v, "csr_linear_ms": e, "dense_ms": d,
                         "spread_ms": {"vector": spread[f"vector {stage}"], "csr_linear": spread[f"csr_linear {stage}"],
                                       "dense": spread[dense_key]}})
            lines.append(f"| {block} | {groups.nnz * block} | {stage} | {v:.3f} | {e:.3f} | {d:.3f} | {e / v:.2f}x | "
                         f"{d / v:.2f}x |")
    result = {"cpu": devices.cpu_model(), "kernels": cpu.active_kernels()[torch.float32 if dtype != torch.float64
                                                                           else torch.float64],
              "threads": torch.get_num_threads(), "torch": torch.__version__, "n": args.n,
              "density": args.density, "batch": args.batch, "dtype": args.dtype, "reps": args.reps,
              "timer": Timer(device, args.reps).mode, "rows": rows}
    print(f"{result['cpu']}, {result['threads']} threads, kernels {result['kernels']}, {args.n}x{args.n}, "
          f"density {args.density}, batch {args.batch}, {args.dtype}, medians of {args.reps}")
    print("\n".join(lines))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
