"""benchmarks/pairs.py on the CPU: run lists, budgets, the monitor's reading of tqdm and its stop rule, and the report's
pairing and fractions; then the whole sequence (rates, launch, monitor, report) on two tiny runs of the training
example. Timings are not checked (they are this machine's)."""

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
    for option in ("--steps 5", "--minutes=2", "--out x", "--graphs", "--device cpu", "--data f"):
        with pytest.raises(argparse.ArgumentTypeError, match="set by this script"):
            pairs.Run.parse(f"a=--dense {option}")


def test_runs_differing_only_in_seed_share_a_rate():
    keys = {pairs.Run.parse(t).config_key() for t in ("a=--dense --seed 0", "b=--dense --seed=7", "c=--seed 1 --dense")}
    assert keys == {"--dense"}
    assert pairs.Run.parse("d=--dense --block 16").config_key() != "--dense"


def test_budget_is_the_steps_a_run_alone_makes():
    assert pairs.budget_steps(2.0, 10) == 300_000
    assert pairs.budget_steps(3.0, 0.5) == 10_000
    assert pairs.budget_steps(1e9, 1) == 1  # at least one step


def test_progress_is_read_from_tqdm_lines():
    text = ("model: dense\n\r  0%|   | 0/900 [00:00<?, ?step/s]\r  1%|   | 10/900 [00:15<25:09,  2.50s/step, a=1]"
            "\r  2%|   | 250/900 [00:16<00:10,  61.25step/s, train_bpc=5.1]")
    assert pairs.parse_progress(text) == (250, 61.25)
    assert pairs.parse_progress(text[:text.rindex("\r")]) == (10, 0.4)
    assert pairs.parse_progress("model: dense\n\r  0%|   | 0/900 [00:00<?, ?step/s]") == (0, None)


def _rows(*left):
    return [{"name": f"r{i}", "running": s is not None, "left_s": s or 0} for i, s in enumerate(left)]


def test_the_monitor_stops_the_lowest_priority_runs_until_the_work_fits():
    # 3 x 300 solo seconds left, the GPU does 1.5 solo seconds per second, 400 s left: 600 fit, so one stops.
    assert pairs.runs_to_stop(_rows(300, 300, 300), 1.5, 400) == ["r2"]
    assert pairs.runs_to_stop(_rows(300, 300, 300), 1.0, 200) == ["r2", "r1"]  # never the last one running
    assert pairs.runs_to_stop(_rows(300, None, 300), 1.0, 350) == ["r2"]  # an ended run is not counted
    assert pairs.runs_to_stop(_rows(100, 100), 1.0, 400) == []


def test_bpc_at_fractions_takes_the_evaluations_at_each_fraction():
    val = [[1.0, 25, 3.0], [2.0, 50, 2.5], [3.0, 75, 2.2], [4.0, 100, 2.0]]
    assert pairs.at_fractions(val, 100, 4) == [3.0, 2.5, 2.2, 2.0]
    assert pairs.at_fractions(val[:2], 100, 4) == [3.0, 2.5, None, None]  # stopped at half
    assert pairs.at_fractions([[1.0, 33, 3.0], [2.0, 66, 2.5], [3.0, 99, 2.2], [3.1, 101, 2.1]], 101, 3) == \
        [3.0, 2.5, 2.1]  # the last point is the final step, not the last multiple


def _write_run(runs_dir: Path, name: str, model: dict, val: list, finished: bool = True) -> None:
    run = runs_dir / name
    run.mkdir(parents=True)
    if finished:
        (run / "log.json").write_text(json.dumps({"model": model, "history": {"val": val}}))
    else:
        import torch

        torch.save({"model_config": model, "history": {"val": val}}, run / "checkpoint.pt")


def test_report_pairs_each_sparse_run_with_the_twin_of_its_width_and_seed(tmp_path):
    from torch_sparse_metal.train.model import ModelConfig

    sparse = ModelConfig(vocab_size=98, d_model=256, density=0.25).to_dict()
    twin = ModelConfig(**sparse).dense_equivalent().to_dict()
    other_twin = {**twin, "d_model": twin["d_model"] + 4}
    plan = {"minutes": 10, "evals": 2, "runs": [
        {"name": "dense_s0", "args": ["--dense"], "ms_per_step_alone": 2.0, "steps": 100},
        {"name": "sparse_s0", "args": [], "ms_per_step_alone": 4.0, "steps": 50},
        {"name": "sparse_s1", "args": ["--seed", "1"], "ms_per_step_alone": 4.0, "steps": 50},
        {"name": "dense_other_s1", "args": ["--seed", "1"], "ms_per_step_alone": 2.0, "steps": 100}],
        "stopped": {"sparse_s1": {"step": 30}}}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    _write_run(tmp_path, "dense_s0", twin, [[1, 50, 2.0], [2, 100, 1.5]])
    _write_run(tmp_path, "sparse_s0", sparse, [[1, 25, 1.9], [2, 50, 1.6]])
    _write_run(tmp_path, "sparse_s1", sparse, [[1, 25, 1.95]], finished=False)
    _write_run(tmp_path, "dense_other_s1", other_twin, [[1, 50, 2.0], [2, 100, 1.5]])
    result = pairs.report(tmp_path)
    assert result["solo_minutes"] == [5.0, 10.0]
    assert [p["sparse"] for p in result["pairs"]] == ["sparse_s0"]  # seed 1's dense run is another width
    assert result["pairs"][0]["dense"] == "dense_s0"
    assert result["pairs"][0]["sparse_minus_dense"] == [-0.1, 0.1]
    stopped = next(r for r in result["runs"] if r["name"] == "sparse_s1")
    assert not stopped["finished"] and stopped["stopped_at_step"] == 30 and stopped["val_at"] == [1.95, None]
    table = pairs.markdown(result)
    assert "| sparse_s0 - dense_s0 | 0 | -0.1000 | 0.1000 |" in table
    assert "50 (stopped at 30)" in table


def test_the_whole_sequence_on_two_tiny_cpu_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    runs = [pairs.Run.parse(f"dense_s0=--dense {TINY}"), pairs.Run.parse(f"sparse_s0={TINY}")]
    rates = pairs.measure_rates(runs, None, steps=40, device="cpu")
    assert set(rates) == {r.config_key() for r in runs} and all(ms > 0 for ms in rates.values())
    rates = {key: 1e3 for key in rates}  # one step a second: 30 steps for half a minute, whatever this CPU does
    plan = pairs.launch(runs, rates, minutes=0.5, evals=3, runs_dir=tmp_path, data=None, end_in_minutes=3,
                        device="cpu")
    assert [r["steps"] for r in plan["runs"]] == [30, 30]
    pairs.monitor(tmp_path, seconds=170, interval=2, grace=600)
    result = pairs.report(tmp_path)
    assert all(r["finished"] for r in result["runs"]), [p.read_text()[-400:] for p in tmp_path.glob("*.log")]
    assert all(all(v is not None for v in r["val_at"]) for r in result["runs"])
    assert [p["sparse"] for p in result["pairs"]] == ["sparse_s0"]
