"""Markdown table of the Metal designs (through the CUDA translation) against our CUDA kernels, from the JSON of
one or more ``python -m torch_sparse_metal.bench --device cuda --metal-designs`` runs: per case and stage, the
median over runs of each time, and the median and range of the per-run ratio Metal / CUDA (ratios are taken
within a run, where both were timed side by side).

Example:
    python benchmarks/metal_table.py benchmarks/results/metal_h200_2026-12-01/final_graphs_rep*.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

STAGES = (("forward", "fused_atomic", "fwd_ms"), ("fused_atomic bwd", "fused_atomic", "bwd_ms"),
          ("atomic_free bwd", "atomic_free", "bwd_ms"))


def table(runs: list[list[dict]]) -> str:
    """The markdown table; ``runs`` are the row lists of several bench runs over the same cases."""
    labels = sorted({r["method"].split("/", 1)[1] for r in runs[0] if "/metal" in r["method"]})
    header = "| case | stage | our CUDA ms | " + " | ".join(f"{lab} ms | {lab} / CUDA" for lab in labels) + " |"
    lines = [header, "|" + "---|" * (3 + 2 * len(labels))]
    cases = sorted({(r["in_features"], r["density"], r["batch"]) for r in runs[0]}, key=lambda k: (k[0], k[2], k[1]))
    for n, density, batch in cases:
        for stage, strategy, field in STAGES:
            def value(run: list[dict], method: str) -> float:
                return next(r[field] for r in run if r["method"] == method and
                            (r["in_features"], r["density"], r["batch"]) == (n, density, batch))

            base = [value(run, strategy) for run in runs]
            cells = [f"{statistics.median(base):.4f}"]
            for lab in labels:
                times = [value(run, f"{strategy}/{lab}") for run in runs]
                ratios = [t / b for t, b in zip(times, base)]
                spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
                cells += [f"{statistics.median(times):.4f}", f"{statistics.median(ratios):.2f}{spread}"]
            lines.append(f"| {n}², {density * 100:.2g}%, B{batch} | {stage} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", type=Path)
    args = parser.parse_args()
    print(table([json.loads(p.read_text()) for p in args.json]))


if __name__ == "__main__":
    main()
