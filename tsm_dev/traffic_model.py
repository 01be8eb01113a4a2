"""The shipped Metal kernels through the executor's traffic model, per op, kernel, variant P and dtype.

``python -m torch_sparse_metal.selfcheck --model`` prints these tables at the published M1 Pro figures' sizes;
``benchmarks/traffic_validate.py`` sets them beside Nsight Compute's counters of the CUDA translation. Inputs are
built by :func:`case_inputs` from a seed per edge count, so every target sees the same topology.

Example:
    >>> rows = model_rows([300], [torch.float32], [4], features=64, batch=40, ops=["forward"])
    >>> [r["kernel"] for r in rows]
    ['gather_float', 'feature_major_float', 'spmm_float_p4']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tsm_dev.msl.traffic import DispatchTraffic, record

__all__ = ["OPS", "case_inputs", "format_tables", "model_rows", "run_op", "summary"]

OPS = ("forward", "fused_atomic", "atomic_free")
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
    occ = d.occupancy()
    return {"ld_instr": ld.instructions, "ld_seg": tuple(ld.per_instruction(k) for k in ("seg32", "seg64", "seg128")),
            "st_instr": st.instructions, "st_seg": tuple(st.per_instruction(k) for k in ("seg32", "seg64", "seg128")),
            "atomic_instr": at.instructions, "atomics": at.lanes, "atomic_simd_same": d.atomic_simd_same,
            "atomic_group_same": d.atomic_group_same, "atomic_shared_addresses": d.atomic_shared_addresses,
            "tg_instr": sum(t.instructions for t in d.threadgroup.values()),
            "barriers_per_group": d.max_barriers, "tg_memory": d.threadgroup_memory,
            "threads_per_group": d.threads_per_group, "occupancy_groups": occ["groups"],
            "occupancy_simdgroups": occ["simdgroups"], "occupancy_limit": occ["limited_by"], "moved_bytes": moved,
            "buffers": {b.name: {"moved": 32 * sum(b.sectors.values()), "requested": sum(b.bytes.values()),
                                 "footprint": b.footprint_bytes}
                        for b in d.buffers.values() if not b.scalar and sum(b.instructions.values())}}


def model_rows(edges: Sequence[int], dtypes: Sequence[torch.dtype], ps: Sequence[int], features: int, batch: int,
               ops: Sequence[str] = OPS, compile_fn: Callable[[str], Any] | None = None,
               progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """One row per dispatch of each op, at each edge count, dtype and P (the host's own dispatch sequence)."""
    from torch_sparse_metal.backends.mps import MetalCsrLinear
    from tsm_dev.msl import compile_shader

    rows: list[dict[str, Any]] = []
    compile_fn = compile_fn or compile_shader
    for dtype in dtypes:
        for p in ps:
            metal = MetalCsrLinear(compile_fn, device_type="cpu", values_per_lane=p)
            for e in edges:
                topo, x, w, go = case_inputs(features, e, batch, dtype)
                for op in ops:
                    if progress:
                        progress(f"{DTYPE_NAMES[dtype]} P={p} edges={topo.nnz} {op}")
                    with record() as dispatches:
                        run_op(metal, op, topo, x, w, go)
                    for d in dispatches:
                        rows.append({"edges": topo.nnz, "features": features, "batch": batch,
                                     "dtype": DTYPE_NAMES[dtype], "p": p, "op": op, "kernel": d.kernel,
                                     **summary(d), "report": d.to_dict()})
    return rows


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
        out += ["", f"{dtype}: bytes moved per op (all its dispatches), by P"]
        for e in dict.fromkeys(r["edges"] for r in mine):
            for op in dict.fromkeys(r["op"] for r in mine):
                per_p = {}
                for r in mine:
                    if r["edges"] == e and r["op"] == op:
                        per_p[r["p"]] = per_p.get(r["p"], 0) + r["moved_bytes"]
                best = min(per_p, key=per_p.get)
                cells = "  ".join(f"P={p}: {_size(v)}" for p, v in per_p.items())
                out.append(f"  {e:>6} {op:<12} {cells}   fewest: P={best}")
    return out
