"""One line per profiled kernel from the text output of ``ncu --metrics ...`` (benchmarks/metal_cuda_device_run.sh
ncu): time, registers, active warps, global load requests and sectors per request, reduction (atomic) requests.

Example:
    python benchmarks/ncu_summary.py benchmarks/results/metal_h200_2026-12-01/final_ncu.txt
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

#: ncu prints a duration in the unit that suits it; the table is in µs.
_TO_MICROSECONDS = {"ns": 1e-3, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3, "s": 1e6, "second": 1e6}


def summary(text: str) -> list[str]:
    """Markdown rows, one per kernel launch in ``text``; translated kernels are named by their Metal host name."""
    names = dict(re.findall(r"^(tsm_entry_\d+) = (\S+)$", text, flags=re.M))
    rows = ["| kernel | grid x block | µs | regs | active warps % | ld requests | sectors / ld request "
            "| atomic (red) requests | sectors / red request |", "|---|---|---|---|---|---|---|---|---|"]
    for block in re.split(r"\n  (?=\S)", text):
        head = block.splitlines()[0]
        if "Context" not in head:
            continue
        m = re.search(r"csr_tile_kernel<([^>]*)>|transpose_pad_kernel|(tsm_entry_\d+)", head)
        if m is None:
            continue
        name = (f"CUDA csr_tile<{m.group(1)}>" if m.group(1) else
                names.get(m.group(2), m.group(2)) if m.group(2) else "CUDA transpose_pad")
        shape = re.search(r"\((\d+, \d+, \d+)\)x\((\d+, \d+, \d+)\)", head)
        vals = {}
        for key, unit, value in re.findall(r"\n\s+(\S+)\s+(\S*)\s+([\d,.]+)\s*(?=\n|$)", block):
            vals[key] = float(value.replace(",", "")) * _TO_MICROSECONDS.get(unit, 1.0)

        ld_req = vals.get("l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum", 0.0)
        red_req = vals.get("l1tex__t_requests_pipe_lsu_mem_global_op_red.sum", 0.0)
        ld_per = vals.get("l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum", 0.0) / ld_req if ld_req else 0.0
        red_per = vals.get("l1tex__t_sectors_pipe_lsu_mem_global_op_red.sum", 0.0) / red_req if red_req else 0.0
        cells = [name, f"({shape.group(1)}) x ({shape.group(2)})", f"{vals.get('gpu__time_duration.sum', 0):.1f}",
                 f"{vals.get('launch__registers_per_thread', 0):.0f}",
                 f"{vals.get('sm__warps_active.avg.pct_of_peak_sustained_active', 0):.0f}", f"{ld_req:,.0f}",
                 f"{ld_per:.1f}", f"{red_req:,.0f}", f"{red_per:.1f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return rows


if __name__ == "__main__":
    print("\n".join(summary(Path(sys.argv[1]).read_text())))
