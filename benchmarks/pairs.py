"""Sparse-versus-dense training pairs at equal nonzeros on one GPU, each run given the steps it makes in a budget of
solo GPU time (issue #29, item 5; results and commands in docs/training.md, "The pairs that count").

One GPU cannot give every run of a set of pairs ten minutes of its own within one device session, so the runs share
it, and what each run is given is counted in steps, not in the wall time it happens to get while sharing:

1. ``rates``: every distinct configuration runs alone for a while (``Trainer`` with CUDA graphs, the training
   example's own step), and its median step time over the metric-read windows is recorded.
2. ``launch``: each run starts as ``examples/train_wikitext103.py ARGS --graphs --steps N`` in its own process
   session (it outlives the device call), N = the budget / its solo step time, so a run ends where a run alone
   would have ended after the budget; ``--eval-every N / EVALS`` puts every run's evaluations at the same
   fractions of its budget.
3. ``monitor``: follows the runs (tqdm's progress lines in each log) and, when the solo work left exceeds what the
   GPU does in the time left (assuming the GPU's throughput stays as measured), stops the runs of lowest priority
   (the last listed) first, so the first-listed runs finish.
4. ``report``: validation BPC at the same fractions of the budget (solo-equivalent minutes), the pairs (each sparse
   run with the dense twin of its width and seed), their differences, a plot, and JSON.

Run lists are ``NAME=ARGS`` (ARGS as for the training example, without ``--steps``/``--minutes``/``--out``), in
priority order. Example (the CUDA device machine; ``benchmarks/pairs_device_run.sh`` has the session's set)::

    python benchmarks/pairs.py rates --data .data/gcide.dict.dz --out /tmp/runs/rates.json \\
        --run "dense_s0=--dense --dtype bfloat16" --run "sparse_s0=--dtype bfloat16"
    python benchmarks/pairs.py launch --rates /tmp/runs/rates.json --minutes 10 --end-in 18 --runs-dir /tmp/runs \\
        --data .data/gcide.dict.dz --run "dense_s0=--dense --dtype bfloat16" --run "sparse_s0=--dtype bfloat16"
    python benchmarks/pairs.py monitor --runs-dir /tmp/runs --for 500
    python benchmarks/pairs.py report --runs-dir /tmp/runs --out pairs.json --plot pairs.png
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "train_wikitext103.py"
#: Options a run list may not hold: the budget, the output, the device, the corpus and the graphs are this script's.
RESERVED = ("--steps", "--minutes", "--out", "--resume", "--eval-every", "--graphs", "--no-progress", "--device",
            "--data")
#: tqdm's progress in a run's log: "1234/56789 [00:10<01:05,  95.1step/s, ..." (or "1.51s/step" when slow).
_PROGRESS = re.compile(r"(\d+)/\d+ \[[^,\]]*, +([\d.]+)(step/s|s/step)")


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
        model_cfg, train_cfg = cli._configs(args, corpus.vocab.size)
        try:
            trainer = Trainer(model_cfg, train_cfg, corpus, torch.device(device), progress=False, verbose=False,
                              graphs=graphs_on(device))
            summary = trainer.fit()
        except Exception as exc:  # one configuration that fails leaves the others to be measured and run
            print(f"{run.name}: failed, not run: {type(exc).__name__}: {exc}", flush=True)
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


# ---------------------------------------------------------------------------------------------------- launch
def budget_steps(ms_per_step: float, minutes: float) -> int:
    """Steps a run alone makes in ``minutes`` of training at ``ms_per_step``.

    Example:
        >>> budget_steps(2.0, 10)
        300000
    """
    return max(1, round(minutes * 60e3 / ms_per_step))


def launch(runs: list[Run], rates: dict[str, float], minutes: float, evals: int, runs_dir: Path,
           data: str | None, end_in_minutes: float, device: str = "cuda") -> dict:
    runs_dir.mkdir(parents=True, exist_ok=True)
    plan = {"minutes": minutes, "evals": evals, "end_by": time.time() + end_in_minutes * 60, "device": device,
            "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), "runs": []}
    for run in runs:
        ms = rates.get(run.config_key())
        if ms is None:
            print(f"{run.name}: no solo rate (its measurement failed), not started", flush=True)
            continue
        steps = budget_steps(ms, minutes)
        command = [sys.executable, str(TRAIN), *run.args, "--device", device, "--steps", str(steps),
                   "--eval-every", str(max(1, steps // evals)), "--out", str(runs_dir / run.name), "--overwrite"]
        command += ["--graphs"] if graphs_on(device) else []
        command += ["--data", data] if data else ["--offline"]
        with open(runs_dir / f"{run.name}.log", "w") as log:
            proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        plan["runs"].append({"name": run.name, "args": list(run.args), "ms_per_step_alone": ms, "steps": steps,
                             "pid": proc.pid, "command": shlex.join(command)})
        print(f"started {run.name} (pid {proc.pid}): {steps:,} steps", flush=True)
    (runs_dir / "plan.json").write_text(json.dumps(plan, indent=1))
    return plan


# ---------------------------------------------------------------------------------------------------- monitor
def parse_progress(text: str) -> tuple[int, float | None]:
    """The last step tqdm reported in a run's log and its speed then (steps per wall second, as tqdm smooths it);
    ``(0, None)`` before the first report.

    Example:
        >>> parse_progress("\\r 10/1009 [00:15<25:09,  1.51s/step]\\r 20/1009 [00:16<13:46,  4.00step/s, x=1]")
        (20, 4.0)
    """
    found = _PROGRESS.findall(text)
    if not found:
        return 0, None
    step, speed, unit = found[-1]
    return int(step), float(speed) if unit == "step/s" else 1.0 / float(speed)


def progress_of(log: Path) -> tuple[int, float | None]:
    try:
        return parse_progress(log.read_text(errors="replace"))
    except FileNotFoundError:
        return 0, None


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a finished child of this process stays a zombie until reaped
        return os.waitpid(pid, os.WNOHANG) == (0, 0)
    except ChildProcessError:
        return True


def runs_to_stop(rows: list[dict], throughput: float, seconds_left: float) -> list[str]:
    """The lowest-priority running runs to stop so that the solo work left fits: ``rows`` in priority order with
    ``running``, ``left_s`` (solo seconds of work left); ``throughput`` solo seconds done per wall second by all.

    Example:
        >>> rows = [{"name": "a", "running": True, "left_s": 300}, {"name": "b", "running": True, "left_s": 300}]
        >>> runs_to_stop(rows, throughput=1.0, seconds_left=400)
        ['b']
    """
    running = [r for r in rows if r["running"]]
    stop: list[str] = []
    while running and sum(r["left_s"] for r in running) > throughput * seconds_left and len(running) > 1:
        stop.append(running.pop()["name"])
    return stop


def monitor(runs_dir: Path, seconds: float, interval: float = 30.0, grace: float = 90.0) -> None:
    """Follow the runs for ``seconds`` (or until none runs); stop runs as the module docstring says. ``grace``:
    seconds after a start or a stop before the next decision, while the rates settle."""
    plan = json.loads((runs_dir / "plan.json").read_text())
    stopped = plan.setdefault("stopped", {})
    until = min(time.time() + seconds, plan["end_by"] + 30)
    pids = {r["name"]: r["pid"] for r in plan["runs"]}

    def stop(row: dict, why: str) -> None:
        try:
            os.killpg(pids[row["name"]], signal.SIGTERM)
        except ProcessLookupError:
            return
        stopped[row["name"]] = {"at": time.time(), "step": row["step"], "why": why}
        print(f"stopped {row['name']} at step {row['step']}: {why}", flush=True)

    quiet_until = time.time() + grace  # after a start or a stop the rates settle before the next decision
    while True:
        now = time.time()
        rows, done_per_s, unknown = [], 0.0, False
        for r in plan["runs"]:
            step, speed = progress_of(runs_dir / f"{r['name']}.log")
            running = r["name"] not in stopped and alive(r["pid"])
            if running and speed is None:
                unknown = True  # not training yet: no decision until every run reports its speed
            elif running:
                done_per_s += speed * r["ms_per_step_alone"] / 1e3
            rows.append({"name": r["name"], "running": running, "step": step, "steps": r["steps"],
                         "left_s": (r["steps"] - step) * r["ms_per_step_alone"] / 1e3})
        left = plan["end_by"] - now
        print(time.strftime("%H:%M:%S"), f"{left / 60:5.1f} min left, solo-work rate {done_per_s:.2f}:",
              ", ".join(f"{r['name']} {r['step']}/{r['steps']}" + ("" if r["running"] else " (ended)") for r in rows),
              flush=True)
        if not any(r["running"] for r in rows) or now >= until:
            break
        if now >= plan["end_by"]:  # out of time: what is still running stops at its last evaluation
            for r in rows:
                if r["running"]:
                    stop(r, "the session's time for the runs is over")
            (runs_dir / "plan.json").write_text(json.dumps(plan, indent=1))
            break
        if now >= quiet_until and not unknown and done_per_s > 0:
            for name in runs_to_stop(rows, done_per_s, left):
                stop(next(r for r in rows if r["name"] == name), "the solo work left does not fit in the time left")
                quiet_until = now + grace
            (runs_dir / "plan.json").write_text(json.dumps(plan, indent=1))
        time.sleep(min(interval, max(1.0, until - time.time())))


# ---------------------------------------------------------------------------------------------------- report
def history_of(run_dir: Path) -> tuple[dict, list[list[float]], bool]:
    """(model config, validation history ``[elapsed, step, bpc]``, finished) from a run's log.json, or from its
    last checkpoint when the run was stopped before writing one."""
    log = run_dir / "log.json"
    if log.exists():
        summary = json.loads(log.read_text())
        return summary["model"], summary["history"]["val"], True
    ckpt = run_dir / "checkpoint.pt"
    if not ckpt.exists():
        return {}, [], False
    import torch

    state = torch.load(ckpt, map_location="cpu", weights_only=False)  # this program's own checkpoint
    return state["model_config"], state["history"]["val"], False


def at_fractions(val: list[list[float]], steps: int, evals: int) -> list[float | None]:
    """Validation BPC at k/evals of the budget (k = 1..evals): the evaluation at that step, None if not reached.

    Example:
        >>> at_fractions([[1.0, 50, 2.0], [2.0, 100, 1.5]], steps=100, evals=2)
        [2.0, 1.5]
    """
    by_step = {int(s): bpc for _, s, bpc in val}
    every = max(1, steps // evals)
    points = [by_step.get(k * every) for k in range(1, evals)]
    return [*points, by_step.get(steps)]


def twin_width(model: dict) -> int:
    from torch_sparse_metal.train.model import ModelConfig

    return ModelConfig(**model).dense_equivalent().d_model


def seed_of(args: list[str]) -> int:
    return int(args[args.index("--seed") + 1]) if "--seed" in args else 0


def report(runs_dir: Path) -> dict:
    plan = json.loads((runs_dir / "plan.json").read_text())
    evals, minutes = plan["evals"], plan["minutes"]
    rows = []
    for r in plan["runs"]:
        model, val, finished = history_of(runs_dir / r["name"])
        rows.append({"name": r["name"], "args": r["args"], "seed": seed_of(r["args"]), "model": model,
                     "ms_per_step_alone": r["ms_per_step_alone"], "steps": r["steps"], "finished": finished,
                     "stopped_at_step": plan.get("stopped", {}).get(r["name"], {}).get("step"),
                     "val_at": at_fractions(val, r["steps"], evals) if val else [None] * evals})
    dense = {(r["model"]["d_model"], r["seed"]): r for r in rows if r["model"] and not r["model"]["sparse"]}
    pairs = []
    for r in rows:
        if not r["model"] or not r["model"]["sparse"]:
            continue
        twin = dense.get((twin_width(r["model"]), r["seed"]))
        if twin is None:
            continue
        diff = [None if a is None or b is None else round(a - b, 4) for a, b in zip(r["val_at"], twin["val_at"])]
        pairs.append({"sparse": r["name"], "dense": twin["name"], "seed": r["seed"], "sparse_minus_dense": diff})
    return {"minutes": minutes, "evals": evals, "solo_minutes": [round(minutes * k / evals, 3)
                                                                   for k in range(1, evals + 1)],
            "runs": rows, "pairs": pairs}


def markdown(result: dict) -> str:
    def fmt(v):
        return "-" if v is None else f"{v:.4f}"

    n = len(result["solo_minutes"])
    marks = sorted({0, max(0, n // 2 - 1), n - 1})  # the first, the middle and the last evaluation
    head = " | ".join(f"val BPC at {result['solo_minutes'][k]:g} min" for k in marks)
    lines = [f"| run | d_model | block | density | ms/step alone | steps | {head} |",
             "|---|---|---|---|---|---|" + "---|" * len(marks)]
    for r in result["runs"]:
        m = r["model"] or {}
        if not m:
            block = density = "-"
        elif m["sparse"]:
            block, density = str(m["block"]), f"{m['density']:.6g}"
        else:
            block, density = "-", "dense"
        steps = f"{r['steps']:,}" + ("" if r["finished"] else f" (stopped at {r['stopped_at_step'] or '?'})")
        lines.append(f"| {r['name']} | {m.get('d_model', '-')} | {block} | {density} | "
                     f"{r['ms_per_step_alone']:.3f} | {steps} | " + " | ".join(fmt(r["val_at"][k]) for k in marks)
                     + " |")
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
        pts = [(t, v) for t, v in zip(result["solo_minutes"], r["val_at"]) if v is not None]
        if pts:
            m = r["model"]
            style = "-" if m.get("sparse") else "--"
            ax.plot(*zip(*pts), style, marker="o", ms=3, color=f"C{i % 10}", label=r["name"])
    ax.set_xlabel("solo-equivalent training minutes (steps x step time alone)")
    ax.set_ylabel("validation BPC")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("rates", "launch"):
        p = sub.add_parser(name)
        p.add_argument("--run", type=Run.parse, action="append", required=True, help="NAME=ARGS, in priority order")
        p.add_argument("--data", default=None)
        p.add_argument("--device", default="cuda", help="cuda (graphs), or cpu for a trial of this script")
    sub.choices["rates"].add_argument("--steps", type=int, default=1500, help="steps of each solo measurement")
    sub.choices["rates"].add_argument("--out", required=True)
    p = sub.choices["launch"]
    p.add_argument("--rates", required=True)
    p.add_argument("--minutes", type=float, default=10.0, help="solo training minutes each run is given")
    p.add_argument("--evals", type=int, default=10, help="evaluations per run, at equal fractions of its budget")
    p.add_argument("--end-in", type=float, required=True, help="wall minutes from now by which runs must end")
    p.add_argument("--runs-dir", type=Path, required=True)
    p = sub.add_parser("monitor")
    p.add_argument("--runs-dir", type=Path, required=True)
    p.add_argument("--for", dest="seconds", type=float, required=True, help="seconds to follow the runs")
    p.add_argument("--interval", type=float, default=30.0, help="seconds between looks")
    p.add_argument("--grace", type=float, default=90.0, help="seconds after a start or stop before deciding")
    p = sub.add_parser("report")
    p.add_argument("--runs-dir", type=Path, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    if args.cmd == "rates":
        rates = measure_rates(args.run, args.data, args.steps, args.device)
        Path(args.out).write_text(json.dumps(rates, indent=1))
    elif args.cmd == "launch":
        rates = json.loads(Path(args.rates).read_text())
        launch(args.run, rates, args.minutes, args.evals, args.runs_dir, args.data, args.end_in, args.device)
    elif args.cmd == "monitor":
        monitor(args.runs_dir, args.seconds, args.interval, args.grace)
    else:
        result = report(args.runs_dir)
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(markdown(result))
        if args.plot:
            plot(result, args.plot)


if __name__ == "__main__":
    main()
