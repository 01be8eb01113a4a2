"""The executor's traffic model beside Nsight Compute's counters of the same kernels through the CUDA translation.

Run on a machine with an NVIDIA GPU, ``ncu`` and ``g++`` (repo root)::

    python3 benchmarks/traffic_validate.py --out /tmp/out          # model, ncu run, comparison table + JSON

It (1) computes the model on the CPU (MSL-on-CPU executor) for every op, variant P and dtype at the M1 Pro sizes
(1024 x 1024 layer, batch 128, 22K-61K edges: selfcheck's timing table), (2) runs the very same host code and
inputs on CUDA under ``ncu --csv --page raw`` (this script with ``--launch``, which logs how many CUDA launches
each Metal dispatch took: a 2-D dispatch launches its partial threadgroups separately), and (3) prints, per
dispatch, model vs measured: global load / store / atomic requests (model: SIMD-group instructions) and sectors
(model: 32-byte segments), shared-memory instructions and wavefronts, with the ratio; ``!`` marks a ratio outside
0.9-1.1. ``--ncu-csv FILE`` compares an earlier ncu run instead of profiling.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

#: model quantity -> the ncu metrics whose sum it predicts (metrics this ncu lacks are dropped and shown as n/a).
PAIRS = {
    "ld requests": ("device.load.instructions", ["l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum"]),
    "ld sectors": ("device.load.seg32", ["l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum"]),
    "st requests": ("device.store.instructions", ["l1tex__t_requests_pipe_lsu_mem_global_op_st.sum"]),
    "st sectors": ("device.store.seg32", ["l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum"]),
    "atomic requests": ("device.atomic.instructions", ["l1tex__t_requests_pipe_lsu_mem_global_op_red.sum",
                                                        "l1tex__t_requests_pipe_lsu_mem_global_op_atom.sum"]),
    "atomic sectors": ("device.atomic.seg32", ["l1tex__t_sectors_pipe_lsu_mem_global_op_red.sum",
                                               "l1tex__t_sectors_pipe_lsu_mem_global_op_atom.sum"]),
    # one L1 tag lookup per 128-byte line an atomic request touches
    "atomic lines": ("device.atomic.seg128", ["l1tex__t_set_accesses_pipe_lsu_mem_global_op_red.sum",
                                             "l1tex__t_set_accesses_pipe_lsu_mem_global_op_atom.sum"]),
    "shared ld instr": ("threadgroup.load.instructions", ["smsp__inst_executed_op_shared_ld.sum"]),
    "shared st instr": ("threadgroup.store.instructions", ["smsp__inst_executed_op_shared_st.sum"]),
    "shared ld wavefronts": ("threadgroup.load.wavefronts", ["l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum"]),
    "shared st wavefronts": ("threadgroup.store.wavefronts",
                             ["l1tex__data_pipe_lsu_wavefronts_mem_shared_op_st.sum"]),
}
EXTRA_METRICS = ["gpu__time_duration.sum", "launch__registers_per_thread", "dram__bytes.sum"]
DTYPES = {"float32": torch.float32, "float16": torch.float16}


def cases(args: argparse.Namespace) -> list[tuple[str, int, int, str]]:
    """(dtype, P, edges, op) in the order both the model and the profiled run go through them."""
    from tsm_dev.traffic_model import OPS

    return [(d, p, e, op) for d in args.dtypes for p in args.p for e in args.edges for op in OPS]


class _Logged:
    """A CUDA translation library whose kernels log (name, CUDA launches) per dispatch."""

    def __init__(self, lib: Any, log: list[tuple[str, int]]):
        self._lib, self._log = lib, log

    def __getattr__(self, name: str) -> Any:
        from tsm_dev.msl.cuda import _launches
        from tsm_dev.msl.executor import dispatch_shape

        fn = getattr(self._lib, name)

        class Call:
            def __getattr__(self, attr: str) -> Any:
                return getattr(fn, attr)

            def __call__(s, *a: Any, threads: Any = None, group_size: Any = None, **kw: Any) -> None:  # noqa: N805
                first = next((t.numel() for t in a if isinstance(t, torch.Tensor)), None)
                grid, group = dispatch_shape(name, threads, group_size, first, fn.max_threads_per_threadgroup)
                self._log.append((name, len(_launches(grid, group))))
                fn(*a, threads=threads, group_size=group_size, **kw)

        return Call()


def launch(args: argparse.Namespace) -> None:
    """The profiled program: every case on CUDA through MetalCsrLinear; writes the dispatch log."""
    from torch_sparse_metal.backends.mps import MetalCsrLinear
    from tsm_dev.msl import cuda
    from tsm_dev.traffic_model import case_inputs, run_op

    log: list[tuple[str, int]] = []
    for dtype, p, edges, op in cases(args):
        metal = MetalCsrLinear(lambda src: _Logged(cuda.compile_shader(src), log), device_type="cuda",
                               values_per_lane=p)
        topo, x, w, go = case_inputs(args.features, edges, args.batch, DTYPES[dtype], "cuda")
        start = len(log)
        run_op(metal, op, topo, x, w, go)
        torch.cuda.synchronize()
        for i in range(start, len(log)):
            log[i] = (*log[i], dtype, p, topo.nnz, op)
    Path(args.launch).write_text(json.dumps(log))


def available_metrics(wanted: list[str]) -> list[str]:
    """The metrics of ``wanted`` this ncu knows (an unknown one would fail the whole run)."""
    proc = subprocess.run(["ncu", "--query-metrics"], capture_output=True, text=True, check=False)
    known = {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}
    return [m for m in wanted if m.rsplit(".", 1)[0] in known] if known else wanted


def profile(args: argparse.Namespace, out: Path) -> tuple[str, list[Any]]:
    metrics = available_metrics(sorted({m for _, ms in PAIRS.values() for m in ms} | set(EXTRA_METRICS)))
    log_path = out / "traffic_launches.json"
    cmd = ["ncu", "--csv", "--page", "raw", "--print-units", "base", "--clock-control", "none",
           "-k", "regex:tsm_entry", "--metrics", ",".join(metrics), sys.executable, __file__, "--launch",
           str(log_path), "--features", str(args.features), "--batch", str(args.batch), "--edges",
           *map(str, args.edges), "--dtypes", *args.dtypes, "--p", *map(str, args.p)]
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    (out / "traffic_ncu.csv").write_text(proc.stdout)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
        raise SystemExit(f"ncu failed (rc {proc.returncode})")
    return proc.stdout, json.loads(log_path.read_text())


def parse_ncu(text: str) -> list[dict[str, float]]:
    """One dict of metric values per profiled kernel launch, in launch order."""
    start = text.find('"ID"')
    rows = []
    for row in csv.DictReader(io.StringIO(text[start:])):
        if not (row.get("ID") or "").strip().isdigit():
            continue  # the units row
        vals = {}
        for k, v in row.items():
            try:
                vals[k] = float(str(v).replace(",", ""))
            except ValueError:
                pass
        rows.append(vals)
    return rows


def _get(report: dict[str, Any], path: str) -> float:
    space, op, field = path.split(".")
    return float(report[space][op][field])


def compare(model: list[dict[str, Any]], measured: list[dict[str, float]], log: list[Any]) -> list[dict[str, Any]]:
    """Per dispatch: model and ncu side by side (ncu summed over the dispatch's launches)."""
    if len(log) != len(model):
        raise SystemExit(f"{len(model)} modelled dispatches but {len(log)} profiled ones: the runs differ")
    out, at = [], 0
    for m, (name, launches, *_case) in zip(model, log):
        if name != m["kernel"]:
            raise SystemExit(f"dispatch order differs: model {m['kernel']}, CUDA {name}")
        rows = measured[at:at + launches]
        at += launches
        entry: dict[str, Any] = {k: m[k] for k in ("dtype", "p", "edges", "op", "kernel")}
        for key, (path, metrics) in PAIRS.items():
            have = [r[mm] for r in rows for mm in metrics if mm in r]
            entry[key] = (_get(m["report"], path), sum(have) if have else None)
        entry["us"] = sum(r.get("gpu__time_duration.sum", 0.0) for r in rows) * 1e6 if rows else None
        out.append(entry)
    return out


def print_table(entries: list[dict[str, Any]]) -> None:
    keys = [k for k in PAIRS if any(e[k][1] is not None and (e[k][0] or e[k][1]) for e in entries)]
    print("model / measured (ratio); '!' = outside 0.9-1.1")
    print(" | ".join(["dtype", "P", "edges", "op", "kernel", *keys]))
    bad = 0
    for e in entries:
        cells = []
        for k in keys:
            model, meas = e[k]
            if meas is None:
                cells.append(f"{model:.0f} / n/a")
                continue
            ratio = model / meas if meas else (1.0 if not model else float("inf"))
            flag = "!" if not 0.9 <= ratio <= 1.1 else ""
            bad += bool(flag)
            cells.append(f"{model:.0f} / {meas:.0f} ({ratio:.2f}){flag}")
        print(" | ".join([e["dtype"], str(e["p"]), str(e["edges"]), e["op"], e["kernel"], *cells]))
    print(f"{bad} quantities outside 10%")


def main() -> None:
    from torch_sparse_metal_tools.selfcheck import BENCH_BATCH, BENCH_FEATURES, PUBLISHED_M1_PRO

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edges", type=int, nargs="+", default=[e for e, _, _ in PUBLISHED_M1_PRO])
    parser.add_argument("--features", type=int, default=BENCH_FEATURES)
    parser.add_argument("--batch", type=int, default=BENCH_BATCH)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument("--p", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--ncu-csv", type=Path, help="compare this ncu --csv --page raw output (with --launch-log)")
    parser.add_argument("--launch-log", type=Path, help="the dispatch log of that ncu run")
    parser.add_argument("--launch", help=argparse.SUPPRESS)  # the profiled program's own mode
    args = parser.parse_args()
    if args.launch:
        return launch(args)
    from tsm_dev.traffic_model import model_rows

    args.out.mkdir(parents=True, exist_ok=True)
    model = model_rows(args.edges, [DTYPES[d] for d in args.dtypes], args.p, args.features, args.batch)
    if args.ncu_csv:
        text, log = args.ncu_csv.read_text(), json.loads(args.launch_log.read_text())
    else:
        text, log = profile(args, args.out)
    entries = compare(model, parse_ncu(text), log)
    (args.out / "traffic_validate.json").write_text(json.dumps(entries, indent=1))
    print_table(entries)


if __name__ == "__main__":
    main()
