"""Summarise the vector-layout quality runs (benchmarks/vector_quality_device_run.sh): final and best validation
bits per character of each (topology schedule, block) over its seeds, and the cost of vectors against block 1
with the same schedule and seed.

Example:
    python benchmarks/vector_quality.py runs/*-b*-s*.json --out vector_quality   # writes .json and .md
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

NAME = re.compile(r"(?P<schedule>[a-z]+)-b(?P<block>\d+)-s(?P<seed>\d+)\.json$")


def load(paths: list[Path]) -> list[dict]:
    """One row per run: schedule, block, seed, steps, final and best val BPC, edges, steps/s."""
    rows = []
    for path in paths:
        match = NAME.search(path.name)
        if match is None:
            raise SystemExit(f"{path}: not a <schedule>-b<block>-s<seed>.json run log")
        log = json.loads(path.read_text())
        rows.append({"schedule": match["schedule"], "block": int(match["block"]), "seed": int(match["seed"]),
                     "steps": log["steps"], "val_bpc": log["val_bpc"], "best_val_bpc": log["best_val_bpc"],
                     "edges": log["edges"], "steps_per_s": log["steps_per_s"], "device": log["device"]})
    return sorted(rows, key=lambda r: (r["schedule"], r["block"], r["seed"]))


def summarise(rows: list[dict]) -> list[dict]:
    """Per (schedule, block): mean and range of the final val BPC, and the paired difference to block 1."""
    base = {(r["schedule"], r["seed"]): r["val_bpc"] for r in rows if r["block"] == 1}
    out = []
    for key in sorted({(r["schedule"], r["block"]) for r in rows}):
        group = [r for r in rows if (r["schedule"], r["block"]) == key]
        bpc = [r["val_bpc"] for r in group]
        paired = [r["val_bpc"] - base[(r["schedule"], r["seed"])] for r in group if (r["schedule"], r["seed"]) in base]
        out.append({"schedule": key[0], "block": key[1], "seeds": len(group), "mean_val_bpc": statistics.fmean(bpc),
                    "min_val_bpc": min(bpc), "max_val_bpc": max(bpc),
                    "cost_vs_block1": statistics.fmean(paired) if paired else None,
                    "cost_range": [min(paired), max(paired)] if paired else None,
                    "edges": group[0]["edges"], "steps": group[0]["steps"]})
    return out


def markdown(summary: list[dict], rows: list[dict]) -> str:
    lines = [f"Device: {rows[0]['device']}; {rows[0]['steps']} steps per run.", "",
             "| schedule | block | seeds | val BPC (mean) | range | vs block 1 (paired mean) | paired range | edges |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summary:
        cost = "" if s["cost_vs_block1"] is None else f"{s['cost_vs_block1']:+.4f}"
        span = "" if s["cost_range"] is None else f"{s['cost_range'][0]:+.4f} .. {s['cost_range'][1]:+.4f}"
        lines.append(f"| {s['schedule']} | {s['block']} | {s['seeds']} | {s['mean_val_bpc']:.4f} | "
                     f"{s['min_val_bpc']:.4f} .. {s['max_val_bpc']:.4f} | {cost} | {span} | {s['edges']:,} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="output stem: writes STEM.json and STEM.md")
    args = parser.parse_args()
    rows = load(args.logs)
    summary = summarise(rows)
    args.out.with_suffix(".json").write_text(json.dumps({"runs": rows, "summary": summary}, indent=1))
    table = markdown(summary, rows)
    args.out.with_suffix(".md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
