"""Where the time of one op call goes on CUDA: the event-timed milliseconds the benchmark reports (the device's
time for the call while the host runs ahead), the host's own time in the call, the same call replayed from a
CUDA graph, and the kernels' own time (CUPTI, through torch.profiler); event time beyond the kernels' is gaps
between them.

Prints one table per case: per callable, event ms, host ms, graph-replay ms, kernel-sum ms, and the mean duration
of each kernel it launched. Medians over ``--reps`` calls; everything of one case runs in one process, one after
another.

Usage (a machine with a CUDA GPU, the extension built):
    python benchmarks/op_timeline.py --dtype bfloat16 float32 --reps 50
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

import torch_sparse_metal  # noqa: F401  (registers the ops)
from torch_sparse_metal.ops._csr_linear import CSRLinearFunction
from torch_sparse_metal.timing import Timer
from torch_sparse_metal.topology import CSRTopology
from torch_sparse_metal_tools.bench import torch_sparse_ops

OPS = torch.ops.torch_sparse_metal


def kernel_us(fn: Callable[[], object], reps: int) -> dict[str, float]:
    """Mean device microseconds per call of each kernel ``fn`` launches (CUPTI, through torch.profiler)."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            name = e.name.removeprefix("void ").replace("torch_sparse_metal::(anonymous namespace)::", "")
            total[name.replace("at::native::", "")[:48]] += e.time_range.elapsed_us()
    return {k: v / reps for k, v in total.items()}


def callables(topo: CSRTopology, x: torch.Tensor, w: torch.Tensor, go: torch.Tensor) -> dict[str, Callable]:
    """The timed calls of one dtype: our forward by its three entry points, both backward strategies, and (in
    float32) torch.sparse's forward and backward as the benchmark times them."""
    idx = topo.kernel_args()
    fns = {
        "ours fwd (torch.ops, autograd wrapper)": lambda: OPS.csr_linear(x, w, *idx, "auto"),
        "ours fwd (below autograd, as SparseLinear)": lambda: OPS.csr_linear.default(x, w, *idx, "auto"),
        "ours fwd (CSRLinearFunction.apply)": lambda: CSRLinearFunction.apply(x, w, topo, "auto"),
        "ours bwd fused_atomic": lambda: OPS.csr_linear_backward(go, x, w, *idx, "fused_atomic"),
        "ours bwd atomic_free": lambda: OPS.csr_linear_backward(go, x, w, *idx, "atomic_free"),
    }
    if x.dtype == torch.float32:
        sparse_fwd, sparse_bwd, _ = torch_sparse_ops(topo, w, x, go)
        fns["torch.sparse fwd"], fns["torch.sparse bwd"] = sparse_fwd, sparse_bwd
    return fns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--density", type=float, default=0.05)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--reps", type=int, default=50)
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    topo = CSRTopology.random(args.size, args.size, args.density, generator=torch.Generator().manual_seed(0)).to("cuda")
    # the benchmark's timers, every callable timed on its own for all --reps (no time budget)
    eager = Timer(torch.device("cuda"), args.reps)
    replayed = Timer(torch.device("cuda"), args.reps, graphs=True)
    for name in args.dtype:
        dtype = getattr(torch, name)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(args.batch, args.size, generator=g).cuda().to(dtype)
        go = torch.randn(args.batch, args.size, generator=g).cuda().to(dtype)
        w = torch.randn(topo.nnz, generator=g).cuda().to(dtype)
        fns = callables(topo, x, w, go)
        print(f"\n== {args.size}x{args.size} d={args.density} B={args.batch} {name}, medians of {args.reps}")
        print(f"{'callable':44} {'event ms':>9} {'host ms':>8} {'graph ms':>9} {'kernels ms':>10}  kernels (us each)")
        for label, fn in fns.items():
            ev = eager.many({label: fn})[label]
            # cuSPARSE allocates inside its calls, so torch.sparse is not captured (as in the benchmark)
            gr = float("nan") if label.startswith("torch.sparse") else replayed.many({label: fn})[label].ms
            kern = kernel_us(fn, args.reps)
            parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(kern.items(), key=lambda kv: -kv[1]))
            print(f"{label:44} {ev.ms:9.4f} {ev.host_ms:8.4f} {gr:9.4f} {sum(kern.values()) / 1e3:10.4f}  {parts}")


if __name__ == "__main__":
    main()
