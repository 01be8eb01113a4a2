"""The CUDA SpMM stage's two walks side by side in one process: direct (csr_tile_kernel) against panel-staged
(reuse_spmm_kernel), for the forward and for atomic_free's backward (whose pass 2 is the SpMM), each forced
through ``_C.set_cuda_spmm``, timed by CUDA-graph replays (a graph of ``--calls`` op calls, replays timed with
events), the two walks alternating round by round; medians over ``--rounds``. Also prints each case's relative
difference between the walks' outputs and what ``auto`` picks. Writes JSON lines to ``--out``.

The panel-staged walk and its switch (``_C.set_cuda_spmm``, ``TORCH_SPARSE_METAL_CUDA_SPMM``) are in commit 92cd446
only (slower than the direct walk, removed after; docs/cuda.md, "Operand reuse: a panel-staged SpMM"): run this
from that commit's tree, or against a later walk that takes the same switch.

Usage (device machine, after benchmarks/cuda_device_run.sh build):
    python benchmarks/cuda_spmm_reuse.py [--rounds 7] [--calls 10] [--out cuda_spmm_reuse.jsonl]
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import torch_sparse_metal  # noqa: F401  (loads the ops)
from torch_sparse_metal import _C
from torch_sparse_metal.topology import CSRTopology

OPS = torch.ops.torch_sparse_metal
# (in_features = out_features, density, batch)
CASES = [(16384, 0.01, 4096), (4096, 0.01, 1024), (4096, 0.02, 1024), (4096, 0.05, 1024)]
DTYPES = ("bfloat16", "float32")
WALKS = ("direct", "reuse", "reuse8")


def graph_of(fn, calls: int) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()  # warm
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--out", default="cuda_spmm_reuse.jsonl")
    args = p.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(dev), torch.__version__)
    print(f"{'case':28} {'op':12} {'direct ms':>9} {'reuse ms':>9} {'reuse8 ms':>9} {'reuse/direct':>12} "
          f"{'rel diff':>9} auto")
    with open(args.out, "w") as out:
        for n, density, batch in CASES:
            gen = torch.Generator().manual_seed(0)
            topo = CSRTopology.random(n, n, density, generator=gen).to(dev)
            idx = topo.kernel_args()
            for dtype in DTYPES:
                t = getattr(torch, dtype)
                g = torch.Generator(device=dev).manual_seed(1)
                x = torch.randn(batch, n, device=dev, generator=g).to(t)
                w = torch.randn(topo.nnz, device=dev, generator=g).to(t)
                go = torch.randn(batch, n, device=dev, generator=g).to(t)
                ops = {"forward": lambda x=x, w=w, idx=idx: OPS.csr_linear(x, w, *idx, "auto"),
                       "atomic_free": lambda x=x, w=w, go=go, idx=idx: OPS.csr_linear_backward(
                           go, x, w, *idx, "atomic_free")[0]}
                for op, fn in ops.items():
                    results, graphs = {}, {}
                    for walk in WALKS:
                        _C.set_cuda_spmm(walk)
                        results[walk] = fn().float()
                        graphs[walk] = graph_of(fn, args.calls)
                    _C.set_cuda_spmm("auto")
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        fn()
                        torch.cuda.synchronize()
                    auto = "reuse" if any("reuse_spmm" in e.name for e in prof.events()) else "direct"
                    times = {walk: [] for walk in WALKS}
                    for _ in range(args.rounds):
                        for walk in WALKS:
                            times[walk].append(replay_ms(graphs[walk], args.calls))
                    med = {walk: statistics.median(v) for walk, v in times.items()}
                    diff = max(float((results[k] - results["direct"]).norm() / results["direct"].norm())
                               for k in ("reuse", "reuse8"))
                    case = f"{n}x{n} d{density} B{batch} {dtype}"
                    print(f"{case:28} {op:12} {med['direct']:9.4f} {med['reuse']:9.4f} {med['reuse8']:9.4f} "
                          f"{med['reuse'] / med['direct']:12.3f} {diff:9.1e} {auto}", flush=True)
                    out.write(json.dumps({"case": case, "op": op, "times_ms": times, "median_ms": med,
                                          "rel_diff": diff, "auto": auto,
                                          "device": torch.cuda.get_device_name(dev)}) + "\n")
                    del graphs, results
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
