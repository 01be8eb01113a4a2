"""CPU kernels with 1 and 2 threads, on the host as it is and beside a competing busy loop, for one or more
builds of torch_sparse_metal side by side in one run.

One worker process per (build, threads) sets its workload up once; the parent then asks the workers in turn, in a
rotating order, for a few timed iterations each, with and without the load, so that every configuration sees the
same background (other processes on a shared host) within a round. The table shows the median over all timed
iterations. The load is one ``python -c "while True: pass"`` process (bounded by ``timeout``), started before a
pass over the workers and ended after it.

Usage:
    python benchmarks/cpu_threads_under_load.py --build before=/tmp/before \\
        --build before-passive=/tmp/before,OMP_WAIT_POLICY=passive --build after=. --rounds 8 \\
        --json benchmarks/results/cpu_threads_under_load.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

# name -> what a worker times; "train_step": the example's small CPU preset (d_model 128, 2 layers, 2 heads,
# context 128, batch 8, density 0.25); "ops": forward + fused_atomic backward at the README's 1024², 5%, B256.
WORKLOADS = ("train_step", "ops")
ITERATIONS = {"train_step": 6, "ops": 30}  # timed iterations per worker and round
LOAD_LIMIT_S = 120


# ------------------------------------------------------------------------------------------------ child
def _train_step_fn():
    import torch
    from char_lm import CharCorpus, ModelConfig, TrainConfig, Trainer

    g = torch.Generator().manual_seed(0)
    text = "".join(chr(97 + int(i)) for i in torch.randint(0, 26, (200_000,), generator=g))
    corpus = CharCorpus.from_splits(text, text[:20_000], text[:20_000], "random")
    cfg = ModelConfig(vocab_size=corpus.vocab.size, context=128, d_model=128, n_layers=2, n_heads=2,
                      density=0.25, backward="fused_atomic")
    trainer = Trainer(cfg, TrainConfig(steps=10_000, batch_size=8), corpus, "cpu", progress=False, verbose=False)
    return lambda: trainer.train_step(0.5)


def _ops_fn():
    import torch

    from torch_sparse_metal import CSRTopology

    ops = torch.ops.torch_sparse_metal
    g = torch.Generator().manual_seed(0)
    topo = CSRTopology.random(1024, 1024, 0.05, generator=g)
    x, go = torch.randn(256, 1024, generator=g), torch.randn(256, 1024, generator=g)
    w = torch.randn(topo.nnz, generator=g)
    idx = topo.kernel_args()

    def step() -> None:
        ops.csr_linear(x, w, *idx, "fused_atomic")
        ops.csr_linear_backward(go, x, w, *idx, "fused_atomic")

    return step


def serve(workload: str, threads: int) -> None:
    """Worker: set up, warm up, then answer each line N on stdin with the milliseconds of N iterations."""
    import torch

    import torch_sparse_metal

    torch.set_num_threads(threads)
    fn = _train_step_fn() if workload == "train_step" else _ops_fn()
    for _ in range(3):
        fn()
    print(json.dumps({"module": torch_sparse_metal.__file__, "threads": torch.get_num_threads()}), flush=True)
    for line in sys.stdin:
        times = []
        for _ in range(int(line)):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        print(json.dumps(times), flush=True)


# ------------------------------------------------------------------------------------------------ parent
def _niced(nice: int) -> list[str]:
    return ["nice", "-n", str(nice)] if nice else []


def _busy_loop(nice: int) -> subprocess.Popen:
    busy = subprocess.Popen([*_niced(nice), "timeout", str(LOAD_LIMIT_S), sys.executable, "-c", "while True: pass"])
    time.sleep(0.2)  # the loop is running before the timed iterations start
    return busy


def _stop(busy: subprocess.Popen | None) -> None:
    if busy is not None:
        busy.terminate()  # timeout passes SIGTERM on to the loop
        busy.wait()


class Worker:
    def __init__(self, build: str, workload: str, threads: int, nice: int):
        root, *extra = build.split(",")  # ROOT[,VAR=VALUE...]: environment variables for this build's workers
        env = {**os.environ, "PYTHONPATH": os.path.abspath(root), "TORCH_SPARSE_METAL_TUNE": "0",
               "OMP_NUM_THREADS": str(threads), **dict(e.split("=", 1) for e in extra)}
        cmd = [*_niced(nice), sys.executable, os.path.abspath(__file__), "--serve", workload, str(threads)]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/")
        self.info = json.loads(self.proc.stdout.readline())

    def time(self, iterations: int) -> list[float]:
        self.proc.stdin.write(f"{iterations}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def run(builds: dict[str, str], workload: str, threads: list[int], rounds: int, nice: int) -> list[dict]:
    keys = [(b, t) for b in builds for t in threads]
    workers = {}
    try:
        for b, t in keys:
            workers[b, t] = Worker(builds[b], workload, t, nice)
        samples = {(b, t, load): [] for b, t in keys for load in (False, True)}
        loads = {load: [] for load in (False, True)}
        for r in range(rounds):
            order = keys[r % len(keys):] + keys[:r % len(keys)]
            for load in (False, True):
                busy = _busy_loop(nice) if load else None
                try:
                    for b, t in order:
                        samples[b, t, load] += workers[b, t].time(ITERATIONS[workload])
                finally:
                    _stop(busy)
                loads[load].append(os.getloadavg()[0])
            print(f"{workload}: round {r + 1}/{rounds}", file=sys.stderr)
    finally:
        for w in workers.values():
            w.close()
    return [{"workload": workload, "build": b, "spec": builds[b], "module": workers[b, t].info["module"], "threads": t,
             "load": "busy loop" if load else "as is", "median_ms": round(statistics.median(v), 2),
             "p25_ms": round(statistics.quantiles(v, n=4)[0], 2), "p75_ms": round(statistics.quantiles(v, n=4)[2], 2),
             "iterations": len(v), "loadavg_1min": round(statistics.median(loads[load]), 2)}
            for (b, t, load), v in samples.items()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build", action="append", default=None, metavar="NAME=ROOT[,VAR=VALUE...]",
                   help="a checkout whose torch_sparse_metal to time, with environment variables for it "
                        "(repeatable; default: this checkout)")
    p.add_argument("--workload", action="append", choices=WORKLOADS, default=None)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--nice", type=int, default=0,
                   help="run the workers and the busy loop at this niceness (negative, as root: other processes "
                        "on a shared host then disturb the timings less, while the busy loop competes as before)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--serve", nargs=2, metavar=("WORKLOAD", "THREADS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    builds = dict(b.split("=", 1) for b in (args.build or [f"this={here}"]))
    workloads = args.workload or list(WORKLOADS)
    rows = [row for w in workloads for row in run(builds, w, args.threads, args.rounds, args.nice)]
    rows.sort(key=lambda r: (r["workload"], r["load"] != "as is", r["threads"], list(builds).index(r["build"])))
    print(f"{'workload':<11} {'load':<10} {'threads':>7} {'build':<10} {'median ms':>10} {'p25-p75':>16} "
          f"{'loadavg':>8}")
    for r in rows:
        print(f"{r['workload']:<11} {r['load']:<10} {r['threads']:>7} {r['build']:<10} {r['median_ms']:>10.2f} "
              f"{r['p25_ms']:>7.2f}-{r['p75_ms']:<8.2f} {r['loadavg_1min']:>8.2f}")
    if args.json:
        from torch_sparse_metal.devices import cpu_model  # here: only the workers import torch otherwise

        meta = {"cpu": cpu_model(), "cores": os.cpu_count(), "python": platform.python_version(),
                "rounds": args.rounds, "nice": args.nice, "iterations_per_round": ITERATIONS,
                "command": " ".join(["python", *sys.argv])}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
