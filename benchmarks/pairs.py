"""Sparse-versus-dense training pairs at equal nonzeros (issue #29, item 5; results and commands in
docs/training.md, "H200: both sides graph-captured").

``rates``: the median step time of each training configuration alone on the GPU, with CUDA graphs (``Trainer``, the
training example's own step, median over its metric-read windows): what a configuration costs before spending
ten minutes on it. ``report``: runs of the training example (each alone on its GPU, one after the other, e.g. with
``benchmarks/train_device_run.sh``) paired, each sparse run with the dense twin of its width and seed, and compared
at equal training time (validation BPC interpolated between evaluations), as a table, JSON and a plot.

Run lists are ``NAME=ARGS`` (ARGS as for the training example, without the options this script sets). Every
argument, each run's included (checked as the training example checks it), and every output path is checked
before anything is measured or read: a bad one is a usage error (exit status 2) and nothing is written. A run
that fails while it is measured is recorded as not measured (null) and the others are still measured; ``--out``
is rewritten after each configuration, so an interrupted measurement keeps what it had. Example
(the CUDA device machine)::

    python benchmarks/pairs.py rates --data .data/gcide.dict.dz --out rates.json \\
        --run "dense=--dense --dtype bfloat16" --run "sparse=--dtype bfloat16 --prune-every 1000 --regrow rigl"
    python benchmarks/pairs.py report /tmp/runs/sparse /tmp/runs/dense --out pairs.json --plot pairs.png
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from torch_sparse_metal_tools.argtypes import existing_path, positive_float, positive_int
from torch_sparse_metal_tools.cli import (
    UsageError,
    check_output_file,
    check_plot_file,
    device_type,
    print_openmp_note,
    raising_errors,
    wait_passively,
)

#: Options a run list may not hold: the budget, the output, the device, the corpus and the graphs are this script's.
RESERVED = ("--steps", "--minutes", "--out", "--resume", "--eval-every", "--graphs", "--device", "--data")


@dataclass(frozen=True)
class Run:
    name: str
    args: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> Run:
        """``NAME=ARGS``; ARGS may not hold the options this script sets.

        Example:
            >>> Run.parse("dense_s1=--dense --seed 1")
            Run(name='dense_s1', args=('--dense', '--seed', '1'))
        """
        name, sep, args = text.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise argparse.ArgumentTypeError(f"--run {text!r}: expected NAME=ARGS, NAME of letters, digits, _ . -")
        try:
            words = tuple(shlex.split(args))
        except ValueError as exc:  # an unclosed quote
            raise argparse.ArgumentTypeError(f"--run {name}: {exc}") from None
        taken = [w.split("=", 1)[0] for w in words if w.split("=", 1)[0] in RESERVED]
        if taken:
            raise argparse.ArgumentTypeError(f"--run {name}: {', '.join(taken)} is set by this script")
        if {"-h", "--help"} & set(words):
            raise argparse.ArgumentTypeError(f"--run {name}: the training example's help is not a run")
        return cls(name, words)

    def config_key(self) -> str:
        """The run's arguments without its seed: runs that differ only in the seed share one solo rate."""
        words, out = list(self.args), []
        while words:
            w = words.pop(0)
            if w == "--seed":
                words.pop(0)
            elif not w.startswith("--seed="):
                out.append(w)
        return " ".join(out)


# ---------------------------------------------------------------------------------------------------- rates
def check_runs(runs: list[Run], steps: int, device, corpus) -> list[tuple[Run, argparse.Namespace]]:
    """Each run's training arguments as the training example parses and checks them (against ``device`` and
    ``corpus`` too), before any run is measured: a :class:`UsageError` names the first run refused."""
    import torch
    from char_lm import cli

    device = torch.device(device)
    graphs = ["--graphs"] if graphs_on(device.type) else []
    checked = []
    for run in runs:
        parser = cli.build_parser()
        try:
            with raising_errors(parser):
                args = parser.parse_args([*run.args, "--steps", str(steps), "--eval-every", str(10 * steps), *graphs])
                cli.check_args(parser, args, device)
                cli._check_dtype(parser, device, args.dtype, None)
                cli.check_corpus_fits(parser, corpus, args.context, args.eval_chars)
        except UsageError as exc:
            raise UsageError(f"--run {run.name}: {exc}") from None
        checked.append((run, args))
    return checked


def measure_rates(checked: list[tuple[Run, argparse.Namespace]], corpus, device: str = "cuda",
                  out: Path | None = None) -> dict[str, float | None]:
    """Median ms per step of each distinct configuration of :func:`check_runs`, alone on the device (with CUDA
    graphs on CUDA); None for one that failed (its error is printed; the others are still measured). ``out``
    is rewritten after each configuration."""
    import torch
    from char_lm import cli
    from char_lm.loop import Trainer

    device = torch.device(device)
    rates: dict[str, float | None] = {}
    for run, args in checked:
        key = run.config_key()
        if key in rates:
            continue
        try:
            model_cfg, train_cfg = cli._configs(args, corpus.vocab.size)
            trainer = Trainer(model_cfg, train_cfg, corpus, device, verbose=False, graphs=args.graphs)
            summary = trainer.fit()
        except Exception as exc:  # a configuration that fails is reported; the others are still measured
            print(f"{run.name}: failed, not measured: {type(exc).__name__}: {exc}", flush=True)
            rates[key] = None
        else:
            ms = rates[key] = summary["median_step_ms"]  # None where too few steps were timed
            rate = f"{ms:.3f} ms/step alone ({1e3 / ms:.1f} steps/s)" if ms else "no step time (give more --steps)"
            print(f"{run.name}: d_model {model_cfg.d_model}, {summary['params']:,} parameters, {rate}", flush=True)
            del trainer
        if out is not None:
            Path(out).write_text(json.dumps(rates, indent=1))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rates


def graphs_on(device_type: str) -> bool:
    """Every run is graph-captured where graphs exist (CUDA); elsewhere (a CPU trial of this script) eager."""
    return device_type == "cuda"


# ---------------------------------------------------------------------------------------------------- report
def interpolate(val: list[list[float]], t: float) -> float | None:
    """Validation BPC at training time ``t`` from ``[elapsed, step, bpc]`` rows, linear between evaluations; None
    outside them.

    Example:
        >>> interpolate([[10.0, 100, 2.0], [20.0, 200, 1.0]], 15.0)
        1.5
    """
    for (t0, _, b0), (t1, _, b1) in zip(val, val[1:]):
        if t0 <= t <= t1:
            return b0 if t1 == t0 else b0 + (b1 - b0) * (t - t0) / (t1 - t0)
    return val[0][2] if val and val[0][0] == t else None


def twin_width(model: dict) -> int:
    from char_lm.model import ModelConfig

    return ModelConfig(**model).dense_equivalent().d_model


#: What :func:`report` reads from a run's ``log.json`` (the training example's summary), by path.
LOG_FIELDS = ("model", "train.seed", "dtype", "graphs", "steps", "elapsed_s", "median_step_ms", "best_val_bpc",
              "history.val")


def load_run(folder: Path) -> dict:
    """A run folder's summary as :func:`report` compares it; a ValueError says why a folder is not a run of the
    training example (no folder, no ``log.json``, not JSON, fields missing)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder}: no such run folder")
    log = folder / "log.json"
    if not log.is_file():
        raise ValueError(f"{folder}: no log.json (not a finished run of the training example)")
    try:
        summary = json.loads(log.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{log}: not a readable JSON log ({type(exc).__name__}: {exc})") from None
    values = {}
    for field in LOG_FIELDS:
        value = summary
        for part in field.split("."):
            value = value.get(part, KeyError) if isinstance(value, dict) else KeyError
        if value is KeyError:
            raise ValueError(f"{log}: not a log of the training example (no {field})")
        values[field] = value
    val = values["history.val"]
    if not isinstance(val, list) or not all(isinstance(v, list) and len(v) == 3 and
                                            all(isinstance(x, (int, float)) for x in v) for v in val):
        raise ValueError(f"{log}: history.val is not a list of [seconds, step, BPC] rows")
    try:
        twin = twin_width(values["model"]) if values["model"]["sparse"] else None
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{log}: its model is not one of the training example ({type(exc).__name__}: {exc})") from None
    return {"name": folder.name, "model": values["model"], "twin_d_model": twin, "seed": values["train.seed"],
            "dtype": values["dtype"], "graphs": values["graphs"], "steps": values["steps"],
            "elapsed_s": values["elapsed_s"], "median_step_ms": values["median_step_ms"],
            "best_val_bpc": values["best_val_bpc"], "val": values["history.val"]}


#: The most points a report compares (``--every`` smaller than the runs' length over this is refused).
MAX_POINTS = 10_000


def compared_until(runs: list[dict]) -> float:
    """Training seconds up to which every evaluated run is compared: the earliest of their last evaluations."""
    return min((r["val"][-1][0] for r in runs if r["val"]), default=0.0)


def report(runs: list[dict], every_s: float = 30.0) -> dict:
    """Each run's validation BPC every ``every_s`` seconds of training, and each sparse run against the dense twin
    of its width and seed (``sparse - dense``, negative where sparse is lower). ``runs``: :func:`load_run`'s."""
    runs = [dict(r) for r in runs]
    end = compared_until(runs)
    marks = [round(every_s * k, 3) for k in range(1, int(end // every_s) + 1)]
    if runs and (not marks or marks[-1] < end):
        marks.append(end)
    for r in runs:
        r["val_at"] = [interpolate(r["val"], t) for t in marks]
    dense = {(r["model"]["d_model"], r["seed"]): r for r in runs if not r["model"]["sparse"]}
    pairs = []
    for r in runs:
        twin = dense.get((r["twin_d_model"], r["seed"])) if r["model"]["sparse"] else None
        if twin is not None:
            pairs.append({"sparse": r["name"], "dense": twin["name"], "seed": r["seed"],
                          "sparse_minus_dense": [None if a is None or b is None else round(a - b, 4)
                                                 for a, b in zip(r["val_at"], twin["val_at"])]})
    return {"seconds": marks, "runs": runs, "pairs": pairs}


def markdown(result: dict) -> str:
    def fmt(v, digits: int = 4):
        return "-" if v is None else f"{v:.{digits}f}"

    n = len(result["seconds"])
    marks = sorted({max(0, n // 4 - 1), max(0, n // 2 - 1), n - 1}) if n else []
    head = " | ".join(f"val BPC at {result['seconds'][k]:g} s" for k in marks)
    lines = [f"| run | d_model | block | density | steps | median ms/step | {head} |",
             "|---|---|---|---|---|---|" + "---|" * len(marks)]
    for r in result["runs"]:
        m = r["model"]
        block, density = (str(m["block"]), f"{m['density']:.6g}") if m["sparse"] else ("-", "dense")
        lines.append(f"| {r['name']} | {m['d_model']} | {block} | {density} | {r['steps']:,} | "
                     f"{fmt(r['median_step_ms'], 2)} | " + " | ".join(fmt(r["val_at"][k]) for k in marks) + " |")
    lines += ["", "| pair (sparse - dense) | seed | " + head + " |", "|---|---|" + "---|" * len(marks)]
    for p in result["pairs"]:
        lines.append(f"| {p['sparse']} - {p['dense']} | {p['seed']} | "
                     + " | ".join(fmt(p["sparse_minus_dense"][k]) for k in marks) + " |")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for i, r in enumerate(result["runs"]):
        if not r["val"]:  # a run stopped before its first evaluation has no curve
            continue
        t, bpc = zip(*[(t, b) for t, _, b in r["val"]])
        ax.plot(t, bpc, "-" if r["model"]["sparse"] else "--", color=f"C{i % 10}", label=r["name"])
    ax.set_xlabel("training seconds (evaluation excluded)")
    ax.set_ylabel("validation BPC")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="benchmarks/pairs.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("rates", help="the solo step time of each configuration")
    p.add_argument("--run", type=Run.parse, action="append", required=True, help="NAME=ARGS")
    p.add_argument("--data", type=existing_path, default=None,
                   help="the training example's --data (default: its bundled corpus)")
    p.add_argument("--device", type=device_type(), default="cuda",
                   help="cuda (graphs), or cpu for a trial of this script")
    p.add_argument("--steps", type=positive_int, default=1500, help="steps of each solo measurement")
    p.add_argument("--out", type=Path, required=True, help="JSON of the rates")
    p = sub.add_parser("report", help="pair finished runs at equal training time")
    p.add_argument("runs", nargs="+", type=Path, help="run folders of the training example (with log.json)")
    p.add_argument("--every", type=positive_float, default=30.0, help="seconds between the compared points")
    p.add_argument("--out", type=Path, required=True, help="JSON of the comparison")
    p.add_argument("--plot", type=Path, default=None, help="a plot of the runs' validation BPC")
    return parser


def main(argv: list[str] | None = None) -> None:
    """Run a subcommand; every argument and output path is checked first (usage errors, exit status 2)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_output_file(parser, args.out, "--out")
    if args.cmd == "rates":
        from char_lm import cli

        corpus = cli.load_corpus_checked(parser, args.data, allow_download=False)
        try:
            checked = check_runs(args.run, args.steps, args.device, corpus)
        except UsageError as exc:
            parser.error(str(exc))
        print_openmp_note(args.device)
        measure_rates(checked, corpus, args.device, out=args.out)
        return
    if args.plot is not None:
        check_plot_file(parser, args.plot, "--plot")
    try:
        runs = [load_run(d) for d in args.runs]
    except ValueError as exc:
        parser.error(str(exc))
    points = compared_until(runs) / args.every
    if points > MAX_POINTS:
        parser.error(f"--every {args.every:g}: {points:,.0f} points up to {compared_until(runs):g} s, more than "
                     f"{MAX_POINTS:,}; give --every {compared_until(runs) / MAX_POINTS:.3g} or more")
    result = report(runs, args.every)
    args.out.write_text(json.dumps(result, indent=1))
    print(markdown(result))
    if args.plot is not None:
        plot(result, args.plot)


if __name__ == "__main__":
    wait_passively()
    main()
