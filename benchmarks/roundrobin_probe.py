"""Why a callable is slower inside the benchmark's round-robin than timed on its own, when every call is timed
from an idle device (CUDA).

Builds the callables of one case exactly as ``torch_sparse_metal_tools.bench`` does (every dtype of ``--dtypes`` plus
the float32 baselines, in the benchmark's order) and times each call from an idle device (synchronised before
and after) three ways:

- ``event``: device events around the call;
- ``host``: the host's time inside the call (Python, dispatch, checks, allocation, launches);
- ``span``: the device span of the call's kernels, first start to last end (torch.profiler's GPU range of a
  ``record_function`` around the call), in a separate profiled pass of the same order;

in four orders: ``alone`` (each callable repeated on its own), ``fixed`` (the benchmark's round-robin),
``shuffled`` (a fresh random order each round, seeded) and ``after-idle`` (the fixed order with a 2 ms host sleep
before each call). Last comes the benchmark's own ``Timer`` (events while the host runs ahead) on the fixed
order. Prints one table of medians; ``--json`` writes every per-call time.

Usage (a machine with a CUDA GPU, the extension built):
    python benchmarks/roundrobin_probe.py --rounds 100 --json /tmp/out/probe.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from torch_sparse_metal.contract import supported_dtypes
from torch_sparse_metal.timing import Timer
from torch_sparse_metal_tools.bench import Case, _dtype_fns, case_operands


def case_fns(case: Case, dtypes: list[torch.dtype]) -> dict[str, Callable[[], object]]:
    """The benchmark's callables of one case (``run_case``'s construction and order), keyed ``method/stage@dtype``."""
    topo, x, go, w, dense = case_operands(case, torch.device("cuda"))
    ours = [d for d in dtypes if d in supported_dtypes("cuda")]
    fns: dict[str, Callable[[], object]] = {}
    for d in dict.fromkeys([*ours, torch.float32]):
        d_fns, _ = _dtype_fns(topo, x.to(d), go.to(d), w.to(d), dense.to(d), d in ours, {})
        fns.update({f"{k}@{str(d).removeprefix('torch.')}": f for k, f in d_fns.items()})
    return fns


def timed_call(fn: Callable[[], object]) -> tuple[float, float]:
    """(event ms, host ms) of one call, started on an idle device."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    fn()
    host = (time.perf_counter() - t0) * 1e3
    end.record()
    end.synchronize()
    return start.elapsed_time(end), host


def orders(keys: list[str], rounds: int, how: str, rng: random.Random) -> list[list[str]]:
    if how == "alone":
        return [[k] * rounds for k in keys]
    out = []
    for _ in range(rounds):
        order = list(keys)
        if how == "shuffled":
            rng.shuffle(order)
        out.append(order)
    return out


def run(fns: dict[str, Callable[[], object]], rounds: int, how: str, rng: random.Random) -> dict[str, dict]:
    times: dict[str, dict[str, list[float]]] = defaultdict(lambda: {"event": [], "host": []})
    for order in orders(list(fns), rounds, how, rng):
        for k in order:
            if how == "after-idle":
                time.sleep(0.002)
            ev, host = timed_call(fns[k])
            times[k]["event"].append(ev)
            times[k]["host"].append(host)
    return times


def spans(fns: dict[str, Callable[[], object]], rounds: int, how: str, rng: random.Random) -> dict[str, list[float]]:
    """Device span (ms) of each call's kernels, from the profiler's GPU ranges of ``record_function``."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for order in orders(list(fns), rounds, how, rng):
            for k in order:
                if how == "after-idle":
                    time.sleep(0.002)
                with record_function(k):
                    fns[k]()
                torch.cuda.synchronize()
    out: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name in fns:
            out[e.name].append(e.time_range.elapsed_us() / 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=4096)
    p.add_argument("--density", type=float, default=0.05)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--orders", nargs="+", default=["alone", "fixed", "shuffled", "after-idle"])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__)
    fns = case_fns(Case(args.size, args.size, args.density, args.batch), [getattr(torch, d) for d in args.dtypes])
    torch.backends.cuda.matmul.allow_tf32 = False  # as the benchmark's round-robin
    for f in fns.values():  # warm-up: module load, allocator, cuSPARSE handles
        f(), f()
    torch.cuda.synchronize()
    rng = random.Random(0)
    result: dict[str, dict] = {}
    for how in args.orders:
        t = run(fns, args.rounds, how, rng)
        s = spans(fns, min(args.rounds, 10), how, rng)
        result[how] = {k: {**t[k], "span": s.get(k, [])} for k in fns}
    timer = Timer(torch.device("cuda"), args.rounds).many(fns)
    result["timer"] = {k: {"event": t.ms, "host": t.host_ms} for k, t in timer.items()}
    med = statistics.median
    print(f"\n{args.size}² d={args.density} B={args.batch}, medians of {args.rounds} calls (span: of 10)")
    print(f"{'callable':28}" + "".join(f" {how[:10]:>10} ev/host/span" for how in args.orders)
          + "    Timer ev/host")
    for k in fns:
        cells = []
        for how in args.orders:
            r = result[how][k]
            span = med(r["span"]) if r["span"] else float("nan")
            cells.append(f" {med(r['event']):.3f}/{med(r['host']):.3f}/{span:.3f}")
        print(f"{k:28}" + "".join(f"{c:>23}" for c in cells) + f"  {timer[k].ms:.3f}/{timer[k].host_ms:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
