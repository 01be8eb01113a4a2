"""The shipped Metal kernels through the executor's traffic model, per op, kernel, variant P and dtype.

``python -m tsm_dev.selfcheck --model`` prints these tables at the published M1 Pro figures' sizes;
``benchmarks/traffic_validate.py`` sets them beside Nsight Compute's counters of the CUDA translation. Inputs are
built by :func:`case_inputs` from a seed per edge count, so every target sees the same topology.

Each op runs with each SpMM kernel (``spmm``: ``direct`` and ``window``, backends/mps.py) where the kernel is the
op's (the forward, atomic_free); :func:`stage_rows` sets them side by side per stage, device and threadgroup
level. ``python -m tsm_dev.traffic_model`` models one size (``--measure-batch`` runs a smaller batch and scales
the batch-proportional kernels, for sizes the executor is too slow for).

Example:
    >>> rows = model_rows([300], [torch.float32], [4], features=64, batch=40, ops=["forward"])
    >>> [(r["kernel"], r["spmm"]) for r in rows]  # doctest: +NORMALIZE_WHITESPACE
    [('forward_operands_float', 'direct'), ('spmm_float_p4', 'direct'),
     ('forward_operands_float', 'window'), ('spmm_window_float_p4', 'window')]
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tsm_dev.msl.traffic import DispatchTraffic, record

__all__ = ["OPS", "case_inputs", "format_stages", "format_summary", "format_tables", "main", "model_rows", "run_op",
           "scaled", "stage_rows", "summary"]

OPS = ("forward", "fused_atomic", "atomic_free")
#: The ops whose kernels include the SpMM (and so differ between the SpMM kernels).
SPMM_OPS = ("forward", "atomic_free")
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def case_inputs(features: int, edges: int, batch: int, dtype: torch.dtype, device: str = "cpu"
                ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(topology, x, weight, grad_out)`` of a ``features`` x ``features`` layer with about ``edges`` edges."""
    from torch_sparse_metal import CSRTopology

    g = torch.Generator().manual_seed(edges)
    topo = CSRTopology.random(features, features, edges / features**2, generator=g)
    x = torch.randn(batch, features, generator=g).to(device, dtype)
    w = torch.randn(topo.nnz, generator=g).to(device, dtype)
    go = torch.randn(batch, features, generator=g).to(device, dtype)
    return topo.to(device), x, w, go


def run_op(metal: Any, op: str, topo: Any, x: torch.Tensor, w: torch.Tensor, go: torch.Tensor) -> None:
    """One op of the contract through a ``MetalCsrLinear``."""
    if op == "forward":
        metal.forward(x, w, *topo.kernel_args())
    else:
        metal.backward(go, x, w, *topo.kernel_args(), op)


def summary(d: DispatchTraffic) -> dict[str, Any]:
    """The columns of the printed table for one dispatch (the JSON keeps the whole report beside them)."""
    ld, st, at = d.device["load"], d.device["store"], d.device["atomic"]
    moved = 32 * (ld.seg32 + st.seg32 + at.seg32)
    tg = d.threadgroup
    occ = d.occupancy()
    return {"ld_instr": ld.instructions, "ld_seg": tuple(ld.per_instruction(k) for k in ("seg32", "seg64", "seg128")),
            "st_instr": st.instructions, "st_seg": tuple(st.per_instruction(k) for k in ("seg32", "seg64", "seg128")),
            "atomic_instr": at.instructions, "atomics": at.lanes, "atomic_simd_same": d.atomic_simd_same,
            "atomic_group_same": d.atomic_group_same, "atomic_shared_addresses": d.atomic_shared_addresses,
            "tg_instr": sum(t.instructions for t in d.threadgroup.values()),
            "tg_bytes": sum(t.bytes for t in tg.values()), "tg_wavefronts": sum(t.wavefronts for t in tg.values()),
            "footprint": sum(b.footprint_bytes for b in d.buffers.values() if not b.scalar),
            "barriers_per_group": d.max_barriers, "tg_memory": d.threadgroup_memory,
            "threads_per_group": d.threads_per_group, "occupancy_groups": occ["groups"],
            "occupancy_simdgroups": occ["simdgroups"], "occupancy_limit": occ["limited_by"], "moved_bytes": moved,
            "buffers": {b.name: {"moved": 32 * sum(b.sectors.values()), "requested": sum(b.bytes.values()),
                                 "footprint": b.footprint_bytes, "instructions": dict(b.instructions)}
                        for b in d.buffers.values() if not b.scalar and sum(b.instructions.values())}}


def model_rows(edges: Sequence[int], dtypes: Sequence[torch.dtype], ps: Sequence[int], features: int, batch: int,
               ops: Sequence[str] = OPS, compile_fn: Callable[[str], Any] | None = None,
               progress: Callable[[str], None] | None = None, spmms: Sequence[str] | None = None
               ) -> list[dict[str, Any]]:
    """One row per dispatch of each op, at each edge count, dtype, P and SpMM kernel (``spmms``, by default every
    one; an op without the SpMM runs once, under the first) in the host's own dispatch sequence."""
    from torch_sparse_metal.backends.mps import SPMM_KERNELS, MetalCsrLinear
    from tsm_dev.msl import compile_shader

    rows: list[dict[str, Any]] = []
    compile_fn = compile_fn or compile_shader
    spmms = tuple(SPMM_KERNELS) if spmms is None else tuple(spmms)
    for dtype in dtypes:
        for p in ps:
            for e in edges:
                topo, x, w, go = case_inputs(features, e, batch, dtype)
                for op in ops:
                    for spmm in spmms if op in SPMM_OPS else spmms[:1]:
                        metal = MetalCsrLinear(compile_fn, device_type="cpu", values_per_lane=p, spmm=spmm)
                        if progress:
                            progress(f"{DTYPE_NAMES[dtype]} P={p} edges={topo.nnz} {op} {spmm}")
                        with record() as dispatches:
                            run_op(metal, op, topo, x, w, go)
                        for d in dispatches:
                            rows.append({"edges": topo.nnz, "features": features, "batch": batch,
                                         "dtype": DTYPE_NAMES[dtype], "p": p, "op": op, "spmm": spmm,
                                         "kernel": d.kernel, **summary(d), "report": d.to_dict()})
    return rows


_SCALED = ("ld_instr", "st_instr", "atomic_instr", "atomics", "tg_instr", "tg_bytes", "tg_wavefronts", "moved_bytes")


#: Buffers whose size has no batch in it (edge values, index arrays, error words, the weight gradient): their
#: footprint is the same at any batch, and so is their traffic in a kernel of :data:`PER_BUFFER`.
BATCH_FREE_BUFFERS = frozenset({"val", "weight", "w_by_dst", "ptr", "col", "row_ptr", "dst", "perm", "index",
                                "errors", "error", "grad_w"})
#: Kernels whose traffic is partly per edge, whatever the batch: atomic_free pass 1 walks the whole batch for each
#: edge (only its operand loads grow with it), and the forward's and fused_atomic's operands kernels do a per-edge
#: job (the weight gather, the zero fill of grad_w) beside their feature-major copy (which grows).
PER_BUFFER = ("sddmm_", "forward_operands_", "fused_atomic_operands_")


def scaled(rows: list[dict[str, Any]], batch: int) -> list[dict[str, Any]]:
    """``rows`` measured at a smaller batch, extrapolated to ``batch``. Both batches must be whole chunks of 128
    columns (32 P for every P), so that every chunk repeats the same accesses. Then, with f the ratio of the
    batches: every count of a kernel that works chunk by chunk is f times (its index and value reads repeat per
    chunk); in a kernel of :data:`PER_BUFFER` only the traffic of the buffers with a batch dimension is f times
    (not that of :data:`BATCH_FREE_BUFFERS`: sddmm's index arrays and output, the gathered or zeroed edge values
    of the operands kernels; their threadgroup traffic is the feature-major copy's, f times). A buffer's
    footprint is f times unless the buffer has no batch dimension (:data:`BATCH_FREE_BUFFERS`). The per-dispatch
    report is dropped; ``extrapolated_from`` names the measured batch."""
    out = []
    for r in rows:
        if batch % 128 or r["batch"] % 128:
            raise ValueError(f"scaled() needs batches that are multiples of 128, got {r['batch']} and {batch}")
        f = batch // r["batch"]
        new = {k: v for k, v in r.items() if k not in ("report", "buffers")}
        new.update({k: r[k] * f for k in _SCALED}, batch=batch, extrapolated_from=r["batch"])
        if r["kernel"].startswith(PER_BUFFER):  # the per-edge part stays, the operands' part grows
            grow = {n: 1 if n in BATCH_FREE_BUFFERS else f for n in r["buffers"]}
            bufs = r["buffers"].items()
            new["moved_bytes"] = sum(b["moved"] * grow[n] for n, b in bufs)
            for key, op in (("ld_instr", "load"), ("st_instr", "store"), ("atomic_instr", "atomic")):
                new[key] = sum(b["instructions"][op] * grow[n] for n, b in bufs)
        new["footprint"] = sum(b["footprint"] * (1 if n in BATCH_FREE_BUFFERS else f) for n, b in r["buffers"].items())
        out.append(new)
    return out


def _stage(kernel: str) -> str:
    """``spmm_window_half_p4`` -> ``spmm`` (both SpMM kernels are one stage), ``forward_operands_float`` ->
    ``forward_operands``."""
    from torch_sparse_metal.backends.mps import SPMM_KERNELS
    from torch_sparse_metal.contract import DTYPES

    metal_types = "|".join(spec.metal for spec in DTYPES.values() if spec.metal)
    stage = re.sub(rf"_({metal_types})(_p\d+)?$", "", kernel)
    return "spmm" if stage in SPMM_KERNELS.values() else stage


def stage_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (edges, dtype, P, op, stage), device bytes moved (32-byte sectors x 32), the device footprint (distinct
    sectors: what DRAM moves at least, with ideal caches) and threadgroup bytes (loads + stores the lanes ask for)
    under each SpMM kernel, and their totals per op. The SpMM's two kernels are one stage (``spmm``)."""
    table: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        stage = _stage(r["kernel"])
        case = (r["edges"], r["dtype"], r["p"], r["op"])
        for key in ((*case, stage), (*case, "total")):
            cell = table.setdefault(key, {"edges": key[0], "dtype": key[1], "p": key[2], "op": key[3],
                                          "stage": key[4], "batch": r["batch"], "features": r["features"]})
            for what in ("moved_bytes", "footprint", "tg_bytes"):
                name = f"{r['spmm']}_{what}"
                cell[name] = cell.get(name, 0) + r[what]
    return list(table.values())


def format_stages(stages: list[dict[str, Any]]) -> list[str]:
    """Markdown: per op and stage, device moved / footprint and threadgroup bytes, direct and window, and the
    ratio direct / window of the device bytes moved."""
    out = ["| case | dtype | P | op | stage | device moved: direct / window (ratio) | device footprint: direct / "
           "window | threadgroup bytes: direct / window |", "|---|---|---|---|---|---|---|---|"]
    order = {op: i for i, op in enumerate(OPS)}
    for s in sorted(stages, key=lambda s: (s["edges"], s["batch"], s["dtype"], s["p"], order[s["op"]],
                                           s["stage"] == "total")):
        if "window_moved_bytes" not in s:  # an op without the SpMM: its kernels are the same under both
            continue
        d, w = s["direct_moved_bytes"], s["window_moved_bytes"]
        case = f"{s['features']}², {s['edges']} edges, B{s['batch']}"
        out.append(f"| {case} | {s['dtype']} | {s['p']} | {s['op']} | {s['stage']} | {_size(d)} / {_size(w)} "
                   f"({d / w if w else float('nan'):.2f}x) | {_size(s['direct_footprint'])} / "
                   f"{_size(s['window_footprint'])} | {_size(s['direct_tg_bytes'])} / {_size(s['window_tg_bytes'])} |")
    return out


def _size(n: float) -> str:
    for unit, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def _seg(v: tuple[float, float, float]) -> str:
    return "-" if not any(v) else "/".join(f"{x:.1f}" for x in v)


def format_tables(rows: list[dict[str, Any]]) -> list[str]:
    """Readable tables: one per dtype, a row per (edges, op, P, kernel); then bytes per buffer at the largest
    edge count, and per op the variant with the fewest bytes moved."""
    out: list[str] = []
    head = (f"{'edges':>6} {'op':<12} {'P':>1} {'kernel':<28} {'ld instr':>9} {'ld seg/instr':>14} "
            f"{'st instr':>8} {'st seg/instr':>13} {'atomics':>8} {'same addr':>14} {'bar':>3} {'tg mem':>6} "
            f"{'occupancy':>13} {'moved':>7}")
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        mine = [r for r in rows if r["dtype"] == dtype]
        out += ["", f"{dtype}: per SIMD-group memory instruction, segments of 32/64/128 bytes; atomics = lane "
                "atomics (same addr: lanes sharing it within a SIMD-group instruction / across SIMD-groups of a "
                "threadgroup / addresses several threadgroups update); bar = "
                "barriers per threadgroup; occupancy = threadgroups (SIMD-groups) per 32 KiB and 1024 threads; moved "
                "= 32-byte sectors x 32 bytes", head]
        for r in mine:
            occ = f"{r['occupancy_groups']} ({r['occupancy_simdgroups']}) {r['occupancy_limit'][:3]}"
            same = (f"{r['atomic_simd_same']}/{r['atomic_group_same']}/{r['atomic_shared_addresses']}"
                    if r["atomics"] else "-")
            out.append(f"{r['edges']:>6} {r['op']:<12} {r['p']:>1} {r['kernel']:<28} {r['ld_instr']:>9} "
                       f"{_seg(r['ld_seg']):>14} {r['st_instr']:>8} {_seg(r['st_seg']):>13} {r['atomics']:>8} "
                       f"{same:>14} {r['barriers_per_group']:>3} {_size(r['tg_memory']):>6} {occ:>13} "
                       f"{_size(r['moved_bytes']):>7}")
        largest = max(r["edges"] for r in mine)
        out += ["", f"{dtype}, {largest} edges: bytes per buffer, moved (32-byte sectors) / footprint (distinct "
                "sectors)"]
        for r in mine:
            if r["edges"] == largest:
                cells = ", ".join(f"{n} {_size(b['moved'])}/{_size(b['footprint'])}" for n, b in r["buffers"].items())
                out.append(f"  {r['op']:<12} P={r['p']} {r['kernel']:<28} {cells}")
        out += ["", f"{dtype}: bytes moved per op (all its dispatches), by P and SpMM kernel"]
        for e in dict.fromkeys(r["edges"] for r in mine):
            for op in dict.fromkeys(r["op"] for r in mine):
                per_p: dict[str, int] = {}
                for r in mine:
                    if r["edges"] == e and r["op"] == op:
                        key = f"P={r['p']}" + (f" {r['spmm']}" if op in SPMM_OPS else "")
                        per_p[key] = per_p.get(key, 0) + r["moved_bytes"]
                best = min(per_p, key=per_p.get)
                cells = "  ".join(f"{k}: {_size(v)}" for k, v in per_p.items())
                out.append(f"  {e:>6} {op:<12} {cells}   fewest: {best}")
    if any(r.get("spmm") == "window" for r in rows):
        out += ["", "Bytes per stage, direct SpMM against the row-window SpMM (device: 32-byte sectors x 32; "
                "threadgroup: bytes the lanes load and store)", *format_stages(stage_rows(rows))]
    return out


def format_summary(rows: list[dict[str, Any]], label: str = "") -> list[str]:
    """Markdown, one line per (edges, dtype, P): the SpMM stage's device and threadgroup bytes and the forward's and
    atomic_free's device totals, direct / window (the tables of docs/metal.md, "The row-window SpMM")."""
    stages = {(s["edges"], s["dtype"], s["p"], s["op"], s["stage"]): s for s in stage_rows(rows)}
    out = ["| case | dtype | P | SpMM stage, device: direct / window | SpMM stage, threadgroup: direct / window | "
           "forward total, device | atomic_free total, device |", "|---|---|---|---|---|---|---|"]

    def ratio(s: dict[str, Any]) -> str:
        d, w = s["direct_moved_bytes"], s["window_moved_bytes"]
        return f"{_size(d)} / {_size(w)} ({d / w:.2f}x)"

    cases = sorted({k[:3] for k in stages if k[3:] == ("forward", "spmm")}, key=lambda k: (k[1], k[0], k[2]))
    for e, dtype, p in cases:
        spmm, fwd, free = (stages[(e, dtype, p, op, st)] for op, st in (("forward", "spmm"), ("forward", "total"),
                                                                         ("atomic_free", "total")))
        out.append(f"| {spmm['features']}², {e} edges, B{spmm['batch']}{label} | {dtype} | {p} | {ratio(spmm)} | "
                   f"{_size(spmm['direct_tg_bytes'])} / {_size(spmm['window_tg_bytes'])} | {ratio(fwd)} | "
                   f"{ratio(free)} |")
    return out


def main(argv: list[str] | None = None) -> None:
    """Model one layer size, direct against window, and print the per-stage table (and JSON with ``--json``)."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m tsm_dev.traffic_model", description=main.__doc__)
    parser.add_argument("--features", type=int, default=4096)
    parser.add_argument("--density", type=float, default=0.05)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--measure-batch", type=int, default=None,
                        help="run this batch and scale the batch-proportional counts to --batch (see scaled())")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float16"], choices=list(DTYPE_NAMES.values()))
    parser.add_argument("--p", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--ops", nargs="+", default=list(SPMM_OPS), choices=OPS)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--summary", type=Path, nargs="+", default=None,
                        help="print format_summary of the rows in these JSON files (this tool's or "
                             "selfcheck --model's) and model nothing")
    args = parser.parse_args(argv)
    if args.summary:
        files = [json.loads(path.read_text()) for path in args.summary]
        rows = [r for data in files for r in data.get("rows") or data["model"]]
        label = " (from B" + str(rows[0]["extrapolated_from"]) + ")" if "extrapolated_from" in rows[0] else ""
        print("\n".join(format_summary(rows, label)))
        return
    dtypes = [d for d, n in DTYPE_NAMES.items() if n in args.dtypes]
    edges = round(args.density * args.features**2)
    run_batch = args.measure_batch or args.batch
    rows = model_rows([edges], dtypes, args.p, args.features, run_batch, args.ops,
                      progress=lambda m: print(m, flush=True))
    measured = [{k: v for k, v in r.items() if k != "report"} for r in rows]
    if args.measure_batch:
        rows = scaled(measured, args.batch)
    stages = stage_rows(rows)
    print("\n".join(format_stages(stages)))
    if args.json:
        args.json.write_text(json.dumps({"measured": measured, "rows": rows, "stages": stages}, indent=1))


if __name__ == "__main__":
    main()
