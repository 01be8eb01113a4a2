"""Write benchmarks/results/INDEX.md: every result file the docs cite, with its date, hardware, command and who
cites it. ``tests/test_results_index.py`` fails when the index is stale, when a result file is cited by nothing,
or when a page cites a result path that does not exist.

    python benchmarks/results_index.py          # rewrite the index
    python benchmarks/results_index.py --check  # exit 1 if it is not up to date

Date, hardware and command come from ``SOURCES`` below (the runs' own notes) where given, else from the file:
a date in its path, the ``device``/``gpu``/``cpu`` and ``torch`` fields and a ``command`` of a JSON result.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
INDEX = RESULTS / "INDEX.md"
PREFIX = "benchmarks/results/"
NOT_RESULTS = {"INDEX.md"}
#: Where citations are looked for: the user docs, and code that names a result file (tests, scripts' usage lines).
CITING = ["README.md", "docs/**/*.md", "tests/*.py", "benchmarks/*.py", "benchmarks/*.sh", "torch_sparse_metal/**/*.py",
          "torch_sparse_metal_tools/**/*.py", "examples/**/*.py", "tsm_dev/**/*.py"]

H200 = "NVIDIA H200, torch 2.11, CUDA 13.0"
EPYC = "2-vCPU AMD EPYC (Zen 3, KVM), torch 2.13 CPU"
#: Per result file or folder (the longest matching prefix wins): what the run's notes say (date, hardware, command,
#: and a note on how the command was run).
SOURCES: dict[str, dict[str, str]] = {
    "cpu.json": {"date": "2026-11-29", "hardware": EPYC,
                 "command": "python -m torch_sparse_metal_tools.bench --device cpu"},
    "cpu_threads_under_load": {"date": "2026-12-01", "hardware": EPYC,
                               "command": "python benchmarks/cpu_threads_under_load.py"},
    "cpu_validation_2026-12-01": {"hardware": "2 x86-64 cores, torch 2.13 CPU",
                                  "command": "python benchmarks/cpu_validation_cost.py",
                                  "note": "a build with the index checks and one without"},
    "crossover_h200": {"date": "2026-12-02", "hardware": H200,
                       "command": "bash benchmarks/crossover_device_run.sh build run",
                       "note": "16384² and the --blocks 16,32,8 rows from further runs, merged with "
                               "benchmarks/crossover.py --from-json"},
    "decoupled_h200_2026-12-01": {"hardware": H200, "command": "bash benchmarks/decoupled_device_run.sh 1.5"},
    "finetune_quality_cpu_2026-12-07": {"hardware": "Intel Xeon (2 shared vCPUs; 1 thread), torch 2.13 CPU, "
                                                    "peft 0.21.2",
                                        "command": "python benchmarks/finetune_quality.py --out "
                                                   "benchmarks/results/finetune_quality_cpu_2026-12-07"},
    "h200.json": {"date": "2026-11-29", "hardware": H200,
                  "command": "python -m torch_sparse_metal_tools.bench --device cuda --cases all"},
    "metal_h200_2026-12-01": {"hardware": H200 + " (the Metal kernels compiled as CUDA)",
                              "command": "python -m tsm_dev.metal_bench --device cuda --graphs"},
    "pairs_h200_2026-12-02": {"hardware": H200,
                              "command": "python examples/train_wikitext103.py --graphs --dtype bfloat16 "
                                         "--minutes 3.5 ...",
                              "note": "sparse with RigL, and --dense; compared by benchmarks/pairs.py report"},
    "recipes_bpc_cpu_2026-12-07": {"hardware": "Intel Xeon (2 shared vCPUs; each run on 1 thread), torch 2.13 CPU",
                                   "command": "OMP_NUM_THREADS=1 python benchmarks/recipes_bpc.py --out "
                                              "benchmarks/results/recipes_bpc_cpu_2026-12-07 --steps 1200 "
                                              "--seeds 0 1 2",
                                   "note": "the bundled offline corpus; 75 runs one after the other, seeds 0 and 1 "
                                           "first, seed 2 added with --resume"},
    "seed_spread_h200_2min": {"date": "2026-11-29", "hardware": H200 + " (six runs sharing one GPU)",
                              "command": "bash benchmarks/seed_spread_h200.sh 2 0 1 2"},
    "timer_h200_2026-12-01": {"hardware": H200,
                              "command": "BENCH_REPS=30 bash benchmarks/dtype_cuda_device_run.sh bench",
                              "note": "three runs, tree c8d3d38"},
    "topology_cpu.json": {"date": "2026-11-29", "command": "python benchmarks/topology_update.py --device cpu"},
    "train_h200_bf16_10min_2026-12-01": {"hardware": H200 + " (two GPUs of one host, one run each)",
                                         "command": "python examples/train_wikitext103.py --minutes 10 --d-model 256 "
                                                    "--density 0.25 --dtype bfloat16 ...",
                                         "note": "sparse with RigL, and --dense"},
    "train_h200_rigl_10min_2026-11-29": {"hardware": H200.replace("CUDA 13.0", "CUDA 13"),
                                         "command": "python examples/train_wikitext103.py --minutes 10 --d-model 256 "
                                                    "--density 0.25 --prune-every 1000 --regrow rigl",
                                         "note": "and its --dense twin"},
    "train_step_profile_h200_2026-12-01.json": {"hardware": H200,
                                                "command": "python benchmarks/train_step_profile.py --out FILE"},
    "transformer_shapes_h100_2026-12-08/grad_w_tiles": {
        "hardware": "NVIDIA H100 80GB HBM3, torch 2.11.0+cu130",
        "command": 'TEST_TIMEOUT=240 AB_ARGS="--tokens 8192 --layouts 16,32" bash benchmarks/ab_device_run.sh test'},
    "vector_cpu": {"hardware": EPYC, "command": "python benchmarks/vector_cpu_bench.py --n 1024 --density 0.05 "
                                                "--blocks 8,16,32 --reps 21 --batch B --out ..."},
    "vector_quality_h200_2026-12-02": {"hardware": H200 + " (twelve runs sharing one GPU)",
                                       "command": "STEPS=2000 bash benchmarks/vector_quality_device_run.sh 0 1"},
}

#: This script and its test name result paths as examples, not as citations.
SELF = {"benchmarks/results_index.py", "tests/test_results_index.py"}
#: The pages a reader follows a result path from: each such path must exist (scripts' usage lines name outputs).
PAGES = ("README.md", "docs/")
DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def result_files() -> list[str]:
    return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*")
                  if p.is_file() and p.relative_to(RESULTS).as_posix() not in NOT_RESULTS)


def _source(rel: str) -> dict[str, str]:
    keys = [k for k in SOURCES if rel == k or rel.startswith(k.rstrip("/") + "/") or rel.startswith(k + ".")
            or (rel.startswith(k) and "/" not in rel)]
    return dict(SOURCES[max(keys, key=len)]) if keys else {}


def _from_json(path: Path) -> dict[str, str]:
    """The hardware and command a JSON result records about itself."""
    if path.suffix != ".json":
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    records = [data.get("meta", data)] if isinstance(data, dict) else [r for r in data if isinstance(r, dict)]
    found: dict[str, set[str]] = {"device": set(), "torch": set(), "command": set()}
    for record in records:
        if not isinstance(record, dict):
            continue
        for key in ("device", "gpu", "cpu"):
            if isinstance(record.get(key), str):
                found["device"].add(record[key])
        if isinstance(record.get("torch"), str):
            found["torch"].add(record["torch"])
        if isinstance(record.get("command"), str):
            found["command"].add(record["command"])
    out = {}
    if found["device"] or found["torch"]:
        out["hardware"] = ", ".join(sorted(found["device"]) + [f"torch {t}" for t in sorted(found["torch"])])
    if len(found["command"]) == 1:
        out["command"] = found["command"].pop()
    return out


def describe(rel: str) -> dict[str, str]:
    info = _from_json(RESULTS / rel)
    info.update(_source(rel))  # the notes win: they name the CPU model and the CUDA version too
    if "date" not in info:
        match = DATE.search(rel)
        info["date"] = match.group(0) if match else ""
    return info


def _citing_texts(root: Path = REPO) -> dict[str, str]:
    texts = {}
    for pattern in CITING:
        for path in sorted(root.glob(pattern)):
            rel = path.relative_to(root).as_posix()
            if path.is_file() and not rel.startswith(PREFIX) and rel not in SELF:
                texts[rel] = path.read_text(encoding="utf-8", errors="replace")
    return texts


def citations(rel: str, texts: dict[str, str]) -> list[str]:
    """The pages and files that name this result: its path, its top folder, or (top-level files) its stem with
    another extension (``crossover_h200.{json,md,png}``)."""
    top = rel.split("/")[0]
    patterns = [re.escape(PREFIX + rel) + r"(?![\w-])"]
    if "/" in rel:
        patterns.append(re.escape(PREFIX + top) + r"(?![\w-])")
    else:  # the same stem with another extension, or with a brace or glob pattern
        patterns.append(re.escape(PREFIX + rel.rsplit(".", 1)[0]) + r"\.(?:[\w{*])")
    return [name for name, text in texts.items() if any(re.search(p, text) for p in patterns)]


def cited_paths(texts: dict[str, str]) -> dict[str, list[str]]:
    """{a benchmarks/results/... path as the README or a docs page writes it: those pages} (brace and glob
    patterns cut off at their first special character)."""
    out: dict[str, list[str]] = {}
    for name, text in texts.items():
        if not name.startswith(PAGES):
            continue
        for match in re.finditer(re.escape(PREFIX) + r"[\w./*{},-]*", text):
            path = re.split(r"[*{]", match.group(0))[0].rstrip(".,")
            if path.rstrip("/") != PREFIX.rstrip("/"):
                out.setdefault(path, []).append(name)
    return out


def render() -> str:
    texts = _citing_texts()
    lines = ["# Benchmark results", "",
             "Every measurement file that the README, the guide (docs/) or the code cites. Generated by "
             "`python benchmarks/results_index.py`; do not edit by hand. Times depend on the machine and its load: "
             "compare ratios measured in one run.", "",
             "| file | date | hardware | command | cited by |", "|---|---|---|---|---|"]
    for rel in result_files():
        info = describe(rel)
        cited = ", ".join(citations(rel, texts)) or "nothing"
        command = f"`{info['command']}`" if info.get("command") else ""
        if info.get("note"):
            command = f"{command} ({info['note']})" if command else info["note"]
        lines.append(f"| `{rel}` | {info.get('date', '')} | {info.get('hardware', '')} | {command} | {cited} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if benchmarks/results/INDEX.md is not current")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = INDEX.read_text() if INDEX.exists() else ""
        if current != text:
            print("benchmarks/results/INDEX.md is out of date: run python benchmarks/results_index.py")
            return 1
        return 0
    INDEX.write_text(text)
    print(f"wrote {INDEX.relative_to(REPO)} ({len(result_files())} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
