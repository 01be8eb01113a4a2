"""Sparse-versus-dense training pairs at equal nonzeros (issue #29, item 5; results and commands in
docs/training.md, "H200: both sides graph-captured").

``rates``: the median step time of each training configuration alone on the GPU, with CUDA graphs (``Trainer``, the
training example's own step, median over its metric-read windows): what a configuration costs before spending
ten minutes on it. ``report``: runs of the training example (each alone on its GPU, one after the other, e.g. with
``benchmarks/train_device_run.sh``) paired, each sparse run with the dense twin of its width and seed, and compared
at equal training time (validation BPC interpolated between evaluations), as a table, JSON and a plot.

Run lists are ``NAME=ARGS`` (ARGS as for the training example, without the options this script sets). Example
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
        words = tuple(shlex.split(args))
        taken = [w.split("=", 1)[0] for w in words if w.split("=", 1)[0] in RESERVED]
        if taken:
            raise argparse.ArgumentTypeError(f"--run {name}: {', '.join(taken)} is set by this script")
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
def measure_rates(runs: list[Run], data: str | None, steps: int, device: str = "cuda") -> dict[str, float | None]:
    """Median ms per step of each distinct configuration, alone on the device (with CUDA graphs on CUDA); None for
    one that failed (its error is printed)."""
    import torch

    from torch_sparse_metal.train import cli
    from torch_sparse_metal.train.data import load_corpus
    from torch_sparse_metal.train.loop import Trainer

    corpus = load_corpus(Path(data) if data else None, allow_download=False)
    rates: dict[str, float | None] = {}
    for run in runs:
        key = run.config_key()
        if key in rates:
            continue
        args = cli.build_parser().parse_args([*run.args, "--steps", str(steps), "--eval-every", str(10 * steps)])
        cli._fill_size_defaults(args, torch.device(device).type)
        try:
            model_cfg, train_cfg = cli._configs(args, corpus.vocab.size)
            trainer = Trainer(model_cfg, train_cfg, corpus, torch.device(device), progress=False, verbose=False,
                              graphs=graphs_on(device))
            summary = trainer.fit()
        except Exception as exc:  # a configuration that fails is reported; the others are still measured
            print(f"{run.name}: failed, not measured: {type(exc).__name__}: {exc}", flush=True)
            rates[key] = None
            continue
        rates[key] = summary["median_step_ms"]
        print(f"{run.name}: d_model {model_cfg.d_model}, {summary['params']:,} parameters, "
              f"{summary['median_step_ms']:.3f} ms/step alone ({1e3 / summary['median_step_ms']:.1f} steps/s)",
              flush=True)
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rates


def graphs_on(device: str) -> bool:
    """Every run is graph-captured where graphs exist (CUDA); elsewhere (a CPU trial of this script) eager."""
    return device.startswith("cuda")


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
    from torch_sparse_metal.train.model import ModelConfig

    return ModelConfig(**model).dense_equivalent().d_model


def report(run_dirs: list[Path], every_s: float = 30.0) -> dict:
    """Each run's validation BPC every ``every_s`` seconds of training, and each sparse run against the dense twin
    of its width and seed (``sparse - dense``, negative where sparse is lower)."""
    runs = []
    for d in run_dirs:
        summary = json.loads((Path(d) / "log.json").read_text())
        runs.append({"name": Path(d).name, "model": summary["model"], "seed": summary["train"]["seed"],
                     "dtype": summary["dtype"], "graphs": summary.get("graphs"), "steps": summary["steps"],
                     "elapsed_s": summary["elapsed_s"], "median_step_ms": summary["median_step_ms"],
                     "best_val_bpc": summary["best_val_bpc"], "val": summary["history"]["val"]})
    end = min(r["val"][-1][0] for r in runs if r["val"]) if any(r["val"] for r in runs) else 0.0  # the last evaluation
    marks = [round(every_s * k, 3) for k in range(1, int(end // every_s) + 1)]
    if runs and (not marks or marks[-1] < end):
        marks.append(end)
    for r in runs:
        r["val_at"] = [interpolate(r["val"], t) for t in marks]
    dense = {(r["model"]["d_model"], r["seed"]): r for r in runs if not r["model"]["sparse"]}
    pairs = []
    for r in runs:
        twin = dense.get((twin_width(r["model"]), r["seed"])) if r["model"]["sparse"] else None
        if twin is not None:
            pairs.append({"sparse": r["name"], "dense": twin["name"], "seed": r["seed"],
                          "sparse_minus_dense": [None if a is None or b is None else round(a - b, 4)
                                                 for a, b in zip(r["val_at"], twin["val_at"])]})
    return {"seconds": marks, "runs": runs, "pairs": pairs}


def markdown(result: dict) -> str:
    def fmt(v):
        return "-" if v is None else f"{v:.4f}"

    n = len(result["seconds"])
    marks = sorted({max(0, n // 4 - 1), max(0, n // 2 - 1), n - 1}) if n else []
    head = " | ".join(f"val BPC at {result['seconds'][k]:g} s" for k in marks)
    lines = [f"| run | d_model | block | density | steps | median ms/step | {head} |",
             "|---|---|---|---|---|---|" + "---|" * len(marks)]
    for r in result["runs"]:
        m = r["model"]
        block, density = (str(m["block"]), f"{m['density']:.6g}") if m["sparse"] else ("-", "dense")
        lines.append(f"| {r['name']} | {m['d_model']} | {block} | {density} | {r['steps']:,} | "
                     f"{r['median_step_ms']:.2f} | " + " | ".join(fmt(r["val_at"][k]) for k in marks) + " |")
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
        t, bpc = zip(*[(t, b) for t, _, b in r["val"]])
        ax.plot(t, bpc, "-" if r["model"]["sparse"] else "--", color=f"C{i % 10}", label=r["name"])
    ax.set_xlabel("training seconds (evaluation excluded)")
    ax.set_ylabel("validation BPC")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("rates")
    p.add_argument("--run", type=Run.parse, action="append", required=True, help="NAME=ARGS")
    p.add_argument("--data", default=None)
    p.add_argument("--device", default="cuda", help="cuda (graphs), or cpu for a trial of this script")
    p.add_argument("--steps", type=int, default=1500, help="steps of each solo measurement")
    p.add_argument("--out", required=True)
    p = sub.add_parser("report")
    p.add_argument("runs", nargs="+", type=Path, help="run folders of the training example (with log.json)")
    p.add_argument("--every", type=float, default=30.0, help="seconds between the compared points")
    p.add_argument("--out", required=True)
    p.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    if args.cmd == "rates":
        rates = measure_rates(args.run, args.data, args.steps, args.device)
        Path(args.out).write_text(json.dumps(rates, indent=1))
    else:
        result = report(args.runs, args.every)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(markdown(result))
        if args.plot:
            plot(result, args.plot)


if __name__ == "__main__":
    main()
