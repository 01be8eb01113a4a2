"""Run outputs: the JSON log, a PNG of bits per character against training time, and the results table.

Comparing runs: ``python examples/char_lm/report.py runs/sparse/log.json runs/dense/log.json --out cmp.png``
draws their curves on one plot and prints their tables.

Example:
    >>> print(format_table({"steps": 10, "elapsed_s": 1.5, "best_val_bpc": 3.2}).splitlines()[2])
    | Run duration | 1.5 s |
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
from pathlib import Path

__all__ = ["edge_series", "format_table", "main", "plot_bpc", "write_report"]

_ROWS = (
    ("Run duration", "elapsed_s", "{:.1f} s"),
    ("Steps completed", "steps", "{:,}"),
    ("Best val BPC", "best_val_bpc", "{:.4f}"),
    ("Final val BPC", "val_bpc", "{:.4f}"),
    ("Final train BPC", "train_bpc", "{:.4f}"),
    ("Steps per second", "steps_per_s", "{:.2f}"),
    ("Median step time", "median_step_ms", "{:.2f} ms"),
    ("Staleness, mean (PD-ASGD)", "staleness_mean", "{:.3f} updates"),
    ("Staleness, max (PD-ASGD)", "staleness_max", "{} updates"),
    ("Forward time (sampled steps)", "fwd_ms", "{:.2f} ms"),
    ("Backward time (sampled steps)", "bwd_ms", "{:.2f} ms"),
    ("Optimizer time (sampled steps)", "opt_ms", "{:.2f} ms"),
    ("Edges (block weights)", "edges", "{:,}"),
    ("Parameters (nonzero)", "params", "{:,}"),
    ("Device", "device", "{}"),
    ("Processes (torchrun)", "processes", "{}"),
    ("Precision", "dtype", "{}"),
)


def format_table(summary: dict) -> str:
    """The results table (Markdown) for one run (the published figures' columns, docs/training.md); rows whose
    value is missing are left out."""
    lines = ["| Metric | Value |", "|---|---|"]
    for label, key, fmt in _ROWS:
        if summary.get(key) is not None:
            lines.append(f"| {label} | {fmt.format(summary[key])} |")
    return "\n".join(lines)


def edge_series(points: list[list[int]]) -> tuple[list[int], list[int], list[int] | None]:
    """Steps, edge counts and the running total of regrown edges from a log's ``edges_history`` rows
    ``[step, edges, regrown by that update]`` (None for logs written before the third column existed).

    Example:
        >>> edge_series([[0, 100, 0], [10, 100, 30], [20, 110, 25]])
        ([0, 10, 20], [100, 100, 110], [0, 30, 55])
    """
    steps, edges = [p[0] for p in points], [p[1] for p in points]
    if not all(len(p) > 2 for p in points):
        return steps, edges, None
    return steps, edges, list(itertools.accumulate(p[2] for p in points))


def plot_bpc(path: str | os.PathLike, runs: dict[str, dict]) -> None:
    """Train (thin) and validation (thick) BPC against training time for one or more runs' summaries."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    evolving = {label: s["edges_history"] for label, s in runs.items() if len(s.get("edges_history") or []) > 1}
    if evolving:  # a second panel: edge counts of evolving topologies
        fig, (ax, ax_edges) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=120)
        for label, points in evolving.items():
            color = f"C{list(runs).index(label)}"  # the colour of the run's BPC curves
            steps, edges, regrown = edge_series(points)
            ax_edges.step(steps, edges, where="post", color=color, label=f"{label} edges")
            if regrown is not None:
                ax_edges.step(steps, regrown, where="post", color=color, ls="--", label=f"{label} regrown, total")
        ax_edges.set_xlabel("step")
        ax_edges.set_ylabel("edges (sparse layers)")
        ax_edges.grid(alpha=0.3)
        ax_edges.legend()
    else:
        fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for i, (label, summary) in enumerate(runs.items()):
        color = f"C{i}"
        train, val = summary["history"]["train"], summary["history"]["val"]
        if train:
            ax.plot([t for t, _, _ in train], [b for _, _, b in train], color=color, alpha=0.35, lw=1,
                    label=f"{label} train")
        if val:
            ax.plot([t for t, _, _ in val], [b for _, _, b in val], color=color, lw=2, marker="o", ms=3,
                    label=f"{label} val")
    firsts = [s["history"]["val"][0][2] for s in runs.values() if s["history"]["val"]]
    firsts = [b for b in firsts if math.isfinite(b)]
    lows = [b for s in runs.values() for key in ("train", "val") for _, _, b in s["history"][key] if math.isfinite(b)]
    if firsts and lows:  # the first minutes fall from ~log2(vocab) bits: keep the axis on what can be compared
        ax.set_ylim(min(lows) - 0.02, max(firsts) + 0.1)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("bits per character")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_report(out_dir: str | os.PathLike, summary: dict) -> None:
    """Write ``log.json`` and ``bpc.png`` into ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "log.json").write_text(json.dumps(summary, indent=1))
    plot_bpc(out_dir / "bpc.png", {summary["name"]: summary})


#: What a run's ``log.json`` needs for the table and the plot.
_LOG_KEYS = {"name": str, "history": dict}


def _read_log(parser: argparse.ArgumentParser, path: Path) -> dict:
    """A run's summary from its ``log.json`` (a usage error naming the file when it is not one)."""
    try:
        summary = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        parser.error(f"{path}: not a readable JSON log ({type(exc).__name__}: {exc})")
    bad = [key for key, kind in _LOG_KEYS.items() if not isinstance(summary, dict) or
           not isinstance(summary.get(key), kind)]
    history = summary.get("history") if isinstance(summary, dict) else None
    if not bad and not all(isinstance(history.get(k), list) for k in ("train", "val")):
        bad.append("history.train/val")
    if bad:
        parser.error(f"{path}: not a training log of this program (no {', '.join(bad)})")
    return summary


def _check_plot_path(parser: argparse.ArgumentParser, out: Path) -> None:
    """The plot can be written there, in a format matplotlib knows from the suffix (checked before reading)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    formats = Figure().canvas.get_supported_filetypes()
    if out.suffix.lstrip(".").lower() not in formats:
        parser.error(f"--out {out}: give a file name ending in one of {', '.join('.' + f for f in sorted(formats))}")
    if out.is_dir() or not out.parent.is_dir():
        parser.error(f"--out {out}: " + ("a folder; give a file name" if out.is_dir() else
                                         f"no folder {out.parent} to write it in"))


def main(argv: list[str] | None = None) -> int:
    """Plot several runs' ``log.json`` on one figure and print their tables; logs that are missing or not this
    program's, and an --out that cannot be written, are usage errors (exit status 2) before anything is drawn."""
    parser = argparse.ArgumentParser(prog="python examples/char_lm/report.py",
                                     description="Compare training runs: one BPC plot, one table per run.")
    parser.add_argument("logs", nargs="+", type=Path, help="log.json files (or run folders holding one)")
    parser.add_argument("--out", type=Path, default=Path("bpc_compare.png"), help="PNG to write")
    args = parser.parse_args(argv)
    _check_plot_path(parser, args.out)
    runs, tables = {}, []
    for path in args.logs:
        path = path / "log.json" if path.is_dir() else path
        if not path.is_file():
            parser.error(f"no log.json at {path}")
        summary = _read_log(parser, path)
        label = summary["name"] if summary["name"] not in runs else f"{summary['name']} ({path.parent.name})"
        runs[label] = summary
        tables.append(f"\n{label} ({path})\n{format_table(summary)}")
    print("\n".join(tables))
    plot_bpc(args.out, runs)
    print(f"\nplot: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
