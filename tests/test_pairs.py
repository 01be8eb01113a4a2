"""benchmarks/pairs.py on the CPU: run lists, the solo rates of tiny configurations, and the report's pairing and
interpolation at equal training time. Timings are not checked (they are this machine's)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("pairs", REPO / "benchmarks" / "pairs.py")
pairs = sys.modules.setdefault("pairs", importlib.util.module_from_spec(_spec))  # dataclasses look it up
_spec.loader.exec_module(pairs)

TINY = ("--size small --d-model 32 --layers 1 --heads 2 --context 32 --batch-size 4 --eval-chars 2048 "
        "--log-every 10")


def test_run_lists_refuse_the_options_the_script_sets():
    assert pairs.Run.parse("a=--dense --seed 3").args == ("--dense", "--seed", "3")
    for bad in ("no_equals_sign", "a b=--dense", "=--dense"):
        with pytest.raises(argparse.ArgumentTypeError, match="NAME=ARGS"):
            pairs.Run.parse(bad)
    for option in ("--steps 5", "--minutes=2", "--out x", "--graphs", "--device cpu", "--data f", "--eval-every 9"):
        with pytest.raises(argparse.ArgumentTypeError, match="set by this script"):
            pairs.Run.parse(f"a=--dense {option}")


def test_runs_differing_only_in_seed_share_a_rate():
    keys = {pairs.Run.parse(t).config_key() for t in ("a=--dense --seed 0", "b=--dense --seed=7", "c=--seed 1 --dense")}
    assert keys == {"--dense"}
    assert pairs.Run.parse("d=--dense --block 16").config_key() != "--dense"


def _write_run(runs_dir: Path, name: str, model: dict, seed: int, val: list) -> Path:
    run = runs_dir / name
    run.mkdir(parents=True)
    summary = {"model": model, "train": {"seed": seed}, "dtype": "bfloat16", "graphs": None, "steps": val[-1][1],
               "elapsed_s": val[-1][0], "median_step_ms": 2.0, "best_val_bpc": min(v[2] for v in val),
               "history": {"val": val}}
    (run / "log.json").write_text(json.dumps(summary))
    return run


def test_interpolation_between_evaluations():
    val = [[10.0, 100, 2.0], [20.0, 200, 1.0], [40.0, 300, 0.8]]
    assert pairs.interpolate(val, 15.0) == 1.5
    assert pairs.interpolate(val, 30.0) == pytest.approx(0.9)
    assert pairs.interpolate(val, 5.0) is None and pairs.interpolate(val, 41.0) is None


def test_report_pairs_each_sparse_run_with_the_twin_of_its_width_and_seed(tmp_path):
    from torch_sparse_metal.train.model import ModelConfig

    sparse = ModelConfig(vocab_size=98, d_model=256, density=0.25).to_dict()
    twin = ModelConfig(**sparse).dense_equivalent().to_dict()
    other_twin = {**twin, "d_model": twin["d_model"] + 4}
    dirs = [_write_run(tmp_path, "dense_s0", twin, 0, [[10.0, 50, 2.0], [20.0, 100, 1.5], [31.0, 160, 1.4]]),
            _write_run(tmp_path, "sparse_s0", sparse, 0, [[15.0, 25, 1.9], [30.0, 50, 1.6]]),
            _write_run(tmp_path, "sparse_s1", sparse, 1, [[15.0, 25, 1.9], [30.5, 50, 1.6]]),
            _write_run(tmp_path, "dense_other_s1", other_twin, 1, [[10.0, 50, 2.0], [30.5, 100, 1.5]])]
    result = pairs.report(dirs, every_s=10.0)
    assert result["seconds"] == [10.0, 20.0, 30.0]  # up to the shortest run
    assert [p["sparse"] for p in result["pairs"]] == ["sparse_s0"]  # seed 1's dense run is another width
    pair = result["pairs"][0]
    assert pair["dense"] == "dense_s0"
    # at 10 s sparse has no evaluation yet; at 20 s 1.9 - (1.9 - 1.6) * 5 / 15 = 1.8 against 1.5; at 30 s
    # 1.6 against 1.5 + (1.4 - 1.5) * 10 / 11
    assert pair["sparse_minus_dense"] == [None, 0.3, round(1.6 - (1.5 - 0.1 * 10 / 11), 4)]
    table = pairs.markdown(result)
    assert "| sparse_s0 - dense_s0 | 0 |" in table and "| dense_s0 | 132 | - | dense | 160 |" in table


def test_rates_on_tiny_cpu_runs(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    runs = [pairs.Run.parse(f"dense_s0=--dense {TINY}"), pairs.Run.parse(f"sparse_s0={TINY}"),
            pairs.Run.parse(f"sparse_s1={TINY} --seed 1"), pairs.Run.parse(f"bad={TINY} --d-model 24 --block 16")]
    rates = pairs.measure_rates(runs, None, steps=40, device="cpu")
    good = {r.config_key() for r in runs[:2]}
    assert set(rates) == good | {runs[3].config_key()}  # seed 1 shares seed 0's rate
    assert all(rates[k] > 0 for k in good)
    assert rates[runs[3].config_key()] is None  # a configuration that fails is reported, the others measured
