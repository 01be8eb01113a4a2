"""Per-kernel device times of the vector ops on CUDA (torch.profiler), beside dense bf16, for a few cases.

For each case (shape, density, block V, dtype) it runs the forward and both backward strategies of the
vector-layout ops ``--reps`` times under the profiler and prints each kernel's mean time per call, then the
median graph-replay times of the forward, each backward, and dense ``F.linear`` + its two backward matmuls in the same
dtype (torch_sparse_metal.timing.Timer, CUDA graphs). Where the time of a stage goes (transpose, grad_w, grad_x,
atomics) decides the next change; benchmarks/crossover.py --blocks gives the published comparison.

    python benchmarks/vector_profile_case.py --case 4096x4096x1024:0.05:16 --case 16384x16384x4096:0.01:16
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
import torch.nn.functional as F

import torch_sparse_metal  # noqa: F401  (loads the ops)
from torch_sparse_metal.timing import Timer
from torch_sparse_metal.topology import CSRTopology

OPS = torch.ops.torch_sparse_metal


def parse_case(text: str) -> tuple[int, int, int, float, int]:
    """``INxOUTxBATCH:DENSITY:V``."""
    dims, density, v = text.split(":")
    i, o, b = (int(t) for t in dims.split("x"))
    return i, o, b, float(density), int(v)


def random_vectors(in_features: int, groups: int, density: float, seed: int) -> CSRTopology:
    """``round(density * in * groups)`` distinct vectors, drawn on the GPU (as benchmarks/crossover.py does)."""
    nnz = CSRTopology.random_edge_count(in_features, groups, density)
    gen = torch.Generator("cuda").manual_seed(seed)
    flat = torch.randperm(in_features * groups, generator=gen, device="cuda")[:nnz].sort().values
    return CSRTopology.from_edges(flat // groups, flat % groups, in_features, groups, sort=False)


def profile(topo: CSRTopology, shape: tuple[int, int, int, float, int], dtype: torch.dtype, reps: int,
            timer: Timer) -> dict:
    """One case in one dtype: per-kernel profiler times and graph-replay medians (printed and returned)."""
    in_f, out_f, batch, density, v = shape
    idx = topo.kernel_args()
    g = torch.Generator("cuda").manual_seed(2)
    x = torch.randn(batch, in_f, device="cuda", generator=g).to(dtype)
    go = torch.randn(batch, out_f, device="cuda", generator=g).to(dtype)
    w = (torch.randn(topo.nnz, v, device="cuda", generator=g) * 0.05).to(dtype)
    wd = (torch.randn(out_f, in_f, device="cuda", generator=g) * 0.05).to(dtype)
    calls = {
        "fwd": lambda: OPS.csr_linear(x, w, *idx, "auto"),
        "bwd fused_atomic": lambda: OPS.csr_linear_backward(go, x, w, *idx, "fused_atomic"),
        "bwd atomic_free": lambda: OPS.csr_linear_backward(go, x, w, *idx, "atomic_free"),
        "dense fwd": lambda: F.linear(x, wd),
        "dense bwd": lambda: (go.t() @ x, go @ wd),
    }
    kernels: dict[str, dict[str, float]] = {}
    for label in ("fwd", "bwd fused_atomic", "bwd atomic_free"):
        calls[label]()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                calls[label]()
            torch.cuda.synchronize()
        per: dict[str, float] = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                per[e.name[:90]] += e.device_time / reps / 1e3
        kernels[label] = dict(sorted(per.items(), key=lambda kv: -kv[1]))
    timings = timer.many(calls)
    ms = {k: t.ms for k, t in timings.items()}
    spread = {k: t.spread_ms for k, t in timings.items()}
    case = f"{in_f}x{out_f} B{batch} d={density:g} V={v} {str(dtype).removeprefix('torch.')}"
    print(f"== {case} (vectors {topo.nnz})")
    for label, per in kernels.items():
        print(f"  {label}: " + "; ".join(f"{k} {t:.4f} ms" for k, t in per.items()))
    step = ms["fwd"] + min(ms["bwd fused_atomic"], ms["bwd atomic_free"])
    dense = ms["dense fwd"] + ms["dense bwd"]
    print("  graph replay ms (median, max - min): " + ", ".join(f"{k} {t:.4f} ({spread[k]:.4f})" for k, t in ms.items())
          + f"; step {step:.4f} vs dense {dense:.4f}: {dense / step:.2f}x", flush=True)
    return {"case": case, "kernels": kernels, "ms": ms, "spread_ms": spread, "speedup_step": dense / step,
            "device": torch.cuda.get_device_name(), "torch": torch.__version__}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", action="append", type=parse_case, required=True)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args()
    results = []
    timer = Timer(torch.device("cuda"), 20, budget_s=0.3, graphs=True)
    for shape in args.case:
        in_f, out_f, _, density, v = shape
        topo = random_vectors(in_f, out_f // v, density, seed=1)
        for name in args.dtypes.split(","):
            results.append(profile(topo, shape, getattr(torch, name), args.reps, timer))
            torch.cuda.empty_cache()
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
