"""benchmarks/recipes_bpc.py: the grid's command lines are ones the training example accepts and mean each recipe,
the seed statistics and table are right, and an interrupted grid keeps and resumes what it had. The trainings
themselves are replaced by a fake here (one real refused run checks the failure path)."""

from __future__ import annotations

import importlib.util
import json
import random
import statistics
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("recipes_bpc", REPO / "benchmarks" / "recipes_bpc.py")
recipes_bpc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipes_bpc)

sys.path.insert(0, str(REPO / "examples"))
from char_lm.cli import build_parser, check_args  # noqa: E402


def _parsed(options: list[str]):
    parser = build_parser()
    args = parser.parse_args(options)
    check_args(parser, args, torch.device("cpu"))  # a refused combination exits (SystemExit) here
    return args


def test_every_grid_point_is_a_valid_command_of_its_recipe():
    parser_args = recipes_bpc.build_parser().parse_args(["--out", "x", "--steps", "400"])
    shared = recipes_bpc.model_options(parser_args)
    points = recipes_bpc.grid(["0.1", "0.01"], [0, 3])
    assert len(points) == 2 * (1 + 2 * len(recipes_bpc.METHODS) * len(recipes_bpc.DISTRIBUTIONS))
    assert len({recipes_bpc.run_key(p) for p in points}) == len(points)
    for point in points:
        args = _parsed(shared + ["--seed", str(point["seed"])] + recipes_bpc.recipe_options(
            point["method"], point["density"], point["distribution"], 50))
        assert (args.steps, args.seed, args.d_model, args.offline) == (400, point["seed"], 64, True)
        method = point["method"]
        assert args.dense == (method == "dense")
        assert args.prune_every == (None if method in ("dense", "static") else 50)
        if method == "gmp":
            assert (args.density, args.prune_to) == (1.0, float(point["density"]))
        elif method != "dense":
            assert (args.density, args.prune_to) == (float(point["density"]), None)
        if method in ("set", "rigl"):
            assert args.regrow == method
        if method != "dense":
            assert args.distribution == point["distribution"]


def test_summary_and_table_give_each_cells_median_and_range():
    rng = random.Random(7)
    points = recipes_bpc.grid(["0.1", "0.05"], [0, 1, 2])
    runs = [{**p, "val_bpc": rng.uniform(2, 5)} for p in points]
    rows = recipes_bpc.summarise(runs)
    assert len(rows) == 1 + 2 * len(recipes_bpc.METHODS) * len(recipes_bpc.DISTRIBUTIONS)
    for row in rows:
        values = [r["val_bpc"] for r in runs if (r["method"], r["distribution"], r["density"])
                  == (row["method"], row["distribution"], row["density"])]
        assert row["seeds"] == 3 and len(values) == 3
        assert (row["median"], row["min"], row["max"]) == (statistics.median(values), min(values), max(values))
    table = recipes_bpc.markdown_table(rows, ["0.1", "0.05"])
    rigl_erk = next(r for r in rows if (r["method"], r["distribution"], r["density"]) == ("rigl", "erk", "0.05"))
    line = next(t for t in table.splitlines() if t.startswith("| RigL | erk |"))
    expected = f"{rigl_erk['median']:.3f} ({rigl_erk['min']:.3f}-{rigl_erk['max']:.3f})"
    assert line.split(" | ")[-1].rstrip(" |") == expected
    assert "90% sparse" in table and "95% sparse" in table and "not run" not in table


def test_an_interrupted_grid_keeps_its_runs_and_resume_skips_them(tmp_path, monkeypatch):
    calls, fail_at = [], [4]

    def fake_train(options, out, log_file):
        calls.append(options)
        if len(calls) in fail_at:
            raise RuntimeError("exit status 2: a refused run")
        return {"val_bpc": 3.0 + len(calls) / 100, "best_val_bpc": 3.0, "train_bpc": 3.1, "edges": 10, "params": 20,
                "steps": 5, "elapsed_s": 1.0, "history": {"val": [[1.0, 5, 3.0]]}}

    monkeypatch.setattr(recipes_bpc, "train", fake_train)
    argv = ["--out", str(tmp_path), "--steps", "5", "--seeds", "0", "--densities", "0.5"]
    with pytest.raises(RuntimeError, match="refused"):
        recipes_bpc.main(argv)
    kept = json.loads((tmp_path / recipes_bpc.JSON_NAME).read_text())
    assert [r["method"] for r in kept["runs"]] == ["dense", "static", "static"]
    assert [r["val_bpc"] for r in kept["runs"]] == [3.01, 3.02, 3.03]
    calls.clear()
    fail_at.clear()
    assert recipes_bpc.main(argv + ["--resume"]) == 0
    assert len(calls) == len(recipes_bpc.grid(["0.5"], [0])) - 3
    final = json.loads((tmp_path / recipes_bpc.JSON_NAME).read_text())
    assert [r["val_bpc"] for r in final["runs"][:3]] == [3.01, 3.02, 3.03]
    assert "not run" not in (tmp_path / recipes_bpc.TABLE_NAME).read_text()


def test_a_refused_training_run_raises_with_its_command(tmp_path):
    with pytest.raises(RuntimeError, match=r"(?s)exit status 2: .*--prune-to 0\.5.*above --density"):
        recipes_bpc.train(["--offline", "--device", "cpu", "--steps", "5", "--density", "0.1", "--prune-to", "0.5",
                           "--prune-every", "2"], tmp_path / "run", tmp_path / "run.txt")
    assert not (tmp_path / "run").exists()


def test_bad_densities_are_usage_errors(tmp_path):
    for bad in ("1", "0", "x"):
        with pytest.raises(SystemExit):
            recipes_bpc.main(["--out", str(tmp_path / "o"), "--densities", bad])
    assert not (tmp_path / "o").exists()
