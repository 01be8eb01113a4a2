"""Final validation BPC of the sparse-training recipes on the char-LM (issue #44, item 6; docs/topology.md,
"Recipes compared").

Runs the training example (``examples/train_wikitext103.py``) once per grid point and seed, one run at a time,
all with the same options and step budget: the dense model (``--dense --density 1``), and at each sparsity static
sparse, SET and RigL (``--prune-every``, ``--regrow set|rigl``) and gradual magnitude pruning from dense
(``--density 1 --prune-to D``), each with ``--distribution uniform`` and ``erk``. Each run's final validation BPC is
read from its ``log.json``. Writes ``OUT/recipes_bpc.json`` (the settings, the machine, every run's command and
result), rewritten after each run so that an interrupted grid keeps what it had and ``--resume`` skips the runs it
holds, and ``OUT/recipes_bpc.md`` (median and min-max over the seeds). A run that fails stops the grid with its
command and output: a refused or broken flag combination is a finding, not a point to skip. Example::

    OMP_NUM_THREADS=1 python benchmarks/recipes_bpc.py --out benchmarks/results/recipes_bpc_cpu_2026-12-07 \\
        --steps 1200 --seeds 0 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
TRAINER = REPO / "examples" / "train_wikitext103.py"
JSON_NAME, TABLE_NAME = "recipes_bpc.json", "recipes_bpc.md"
METHODS = ("static", "set", "rigl", "gmp")
DISTRIBUTIONS = ("uniform", "erk")
LABELS = {"dense": "dense", "static": "static sparse", "set": "SET", "rigl": "RigL", "gmp": "gradual pruning"}


def model_options(args: argparse.Namespace) -> list[str]:
    """The options every run shares: the model, the data, the budget, the evaluation."""
    return ["--offline", "--device", "cpu", "--no-progress", "--overwrite",
            "--d-model", str(args.d_model), "--layers", str(args.layers), "--heads", str(args.heads),
            "--context", str(args.context), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
            "--eval-every", str(args.eval_every)]


def recipe_options(method: str, density: str, distribution: str, prune_every: int) -> list[str]:
    """The options of one recipe at one density (given as the command line writes it)."""
    if method == "dense":
        return ["--dense", "--density", "1"]
    shared = ["--distribution", distribution]
    if method == "static":
        return ["--density", density, *shared]
    if method in ("set", "rigl"):
        return ["--density", density, "--prune-every", str(prune_every), "--regrow", method, *shared]
    if method == "gmp":  # dense to the target density, each layer to its --distribution share of it
        return ["--density", "1", "--prune-to", density, "--prune-every", str(prune_every), *shared]
    raise ValueError(f"unknown method {method!r}")


def grid(densities: list[str], seeds: list[int]) -> list[dict]:
    """Every run, seed-major (a grid cut short holds whole seeds): dense, then each density x method x
    distribution."""
    runs = []
    for seed in seeds:
        runs.append({"method": "dense", "density": "1", "distribution": None, "seed": seed})
        for density in densities:
            for method in METHODS:
                for distribution in DISTRIBUTIONS:
                    runs.append({"method": method, "density": density, "distribution": distribution, "seed": seed})
    return runs


def run_key(run: dict) -> tuple:
    return run["method"], run["density"], run["distribution"], run["seed"]


def summarise(runs: list[dict]) -> list[dict]:
    """One row per (method, distribution, density): the final validation BPC's median, min and max over the seeds
    that ran."""
    groups: dict[tuple, list[float]] = {}
    for run in runs:
        groups.setdefault((run["method"], run["distribution"], run["density"]), []).append(run["val_bpc"])
    return [{"method": m, "distribution": dist, "density": d, "seeds": len(v), "median": statistics.median(v),
             "min": min(v), "max": max(v)} for (m, dist, d), v in groups.items()]


def markdown_table(rows: list[dict], densities: list[str]) -> str:
    """Rows: recipe and distribution; columns: sparsity. Cells: median BPC (min-max over the seeds)."""
    cells = {(r["method"], r["distribution"], r["density"]): r for r in rows}

    def cell(row: dict | None) -> str:
        if row is None:
            return "not run"
        if row["seeds"] == 1:
            return f"{row['median']:.3f} (1 seed)"
        return f"{row['median']:.3f} ({row['min']:.3f}-{row['max']:.3f})"

    sparsities = [f"{round(100 * (1 - float(d)), 6):g}% sparse" for d in densities]
    lines = ["| recipe | distribution | " + " | ".join(sparsities) + " |", "|---|---|" + "---|" * len(densities)]
    dense = next((r for r in rows if r["method"] == "dense"), None)
    lines.append("| dense | - | " + " | ".join([cell(dense)] + ["same"] * (len(densities) - 1)) + " |")
    for method in METHODS:
        for distribution in DISTRIBUTIONS:
            lines.append(f"| {LABELS[method]} | {distribution} | "
                         + " | ".join(cell(cells.get((method, distribution, d))) for d in densities) + " |")
    return "\n".join(lines) + "\n"


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": os.environ.get("OMP_NUM_THREADS", "unset"),
            "torch": torch.__version__, "python": platform.python_version()}


def train(options: list[str], out: Path, log_file: Path) -> dict:
    """One run of the training example; its log.json. A failed run raises with its command and output."""
    command = [sys.executable, str(TRAINER), *options, "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "examples"),
                                                        os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    log_file.write_text(result.stdout + result.stderr)
    if result.returncode != 0:
        raise RuntimeError(f"exit status {result.returncode}: {shlex.join(command)}\n{result.stdout}{result.stderr}")
    return json.loads((out / "log.json").read_text())


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="folder for recipes_bpc.json and recipes_bpc.md")
    p.add_argument("--steps", type=int, default=1200, help="steps of every run (default %(default)s)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="seeds (default 0 1)")
    p.add_argument("--densities", nargs="+", default=["0.1", "0.05", "0.01"],
                   help="densities of the sparse recipes (default: 90, 95 and 99%% sparsity)")
    p.add_argument("--prune-every", type=int, default=50, help="topology update interval (default %(default)s)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=300)
    p.add_argument("--resume", action="store_true", help="keep the runs already in OUT/recipes_bpc.json")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("steps", "prune_every", "eval_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    for density in args.densities:
        try:
            ok = 0 < float(density) < 1
        except ValueError:
            ok = False
        if not ok:
            parser.error(f"--densities: {density!r} is not a density in (0, 1)")
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / JSON_NAME
    shared = model_options(args)
    meta = {"command": "python benchmarks/recipes_bpc.py " + shlex.join(sys.argv[1:] if argv is None else argv),
            "trainer_options": shlex.join(shared), "steps": args.steps, "seeds": args.seeds,
            "densities": args.densities, "prune_every": args.prune_every,
            "defaults": "the training example's: AdamW lr 2e-3, 200 warm-up steps, --drop-fraction 0.3, "
                        "--prune-stop 0.75 (SET/RigL updates and the pruning schedule end at 75% of the run)",
            "corpus": "the bundled offline corpus (examples/char_lm fallback_corpus.txt)", **machine()}
    done: dict[tuple, dict] = {}
    if args.resume and json_path.exists():
        done = {run_key(r): r for r in json.loads(json_path.read_text())["runs"]}
    todo = grid(args.densities, args.seeds)
    with tempfile.TemporaryDirectory(prefix="recipes_bpc_") as tmp:
        for i, point in enumerate(todo):
            if run_key(point) in done:
                continue
            options = shared + ["--seed", str(point["seed"])] + recipe_options(
                point["method"], point["density"], point["distribution"], args.prune_every)
            out = Path(tmp) / f"run{i}"
            log = train(options, out, Path(tmp) / f"run{i}.txt")
            done[run_key(point)] = {**point, "options": shlex.join(options), "val_bpc": log["val_bpc"],
                                    "best_val_bpc": log["best_val_bpc"], "train_bpc": log["train_bpc"],
                                    "edges": log["edges"], "params": log["params"], "steps": log["steps"],
                                    "elapsed_s": log["elapsed_s"], "val_history": log["history"]["val"]}
            print(f"[{i + 1}/{len(todo)}] {point['method']} {point['distribution'] or '-'} density "
                  f"{point['density']} seed {point['seed']}: val BPC {log['val_bpc']:.4f}, {log['edges']:,} edges, "
                  f"{log['elapsed_s']:.0f} s", flush=True)
            runs = [done[k] for k in map(run_key, todo) if k in done]
            json_path.write_text(json.dumps({"meta": meta, "runs": runs, "summary": summarise(runs)}, indent=1) + "\n")
    runs = [done[k] for k in map(run_key, todo) if k in done]
    rows = summarise(runs)
    json_path.write_text(json.dumps({"meta": meta, "runs": runs, "summary": rows}, indent=1) + "\n")
    header = (f"Final validation BPC, median (min-max) over seeds {', '.join(map(str, args.seeds))}; "
              f"{args.steps} steps each. Command: `{meta['command']}`; every run: `train_wikitext103.py "
              f"{meta['trainer_options']} --seed S ...`. Machine: {meta['cpu']}, {meta['threads']} thread(s), "
              f"torch {meta['torch']}.\n\n")
    (args.out / TABLE_NAME).write_text(header + markdown_table(rows, args.densities))
    print((args.out / TABLE_NAME).read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
