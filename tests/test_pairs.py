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
    from char_lm.model import ModelConfig

    sparse = ModelConfig(vocab_size=98, d_model=256, density=0.25).to_dict()
    twin = ModelConfig(**sparse).dense_equivalent().to_dict()
    other_twin = {**twin, "d_model": twin["d_model"] + 4}
    dirs = [_write_run(tmp_path, "dense_s0", twin, 0, [[10.0, 50, 2.0], [20.0, 100, 1.5], [31.0, 160, 1.4]]),
            _write_run(tmp_path, "sparse_s0", sparse, 0, [[15.0, 25, 1.9], [30.0, 50, 1.6]]),
            _write_run(tmp_path, "sparse_s1", sparse, 1, [[15.0, 25, 1.9], [30.5, 50, 1.6]]),
            _write_run(tmp_path, "dense_other_s1", other_twin, 1, [[10.0, 50, 2.0], [30.5, 100, 1.5]])]
    result = pairs.report([pairs.load_run(d) for d in dirs], every_s=10.0)
    assert result["seconds"] == [10.0, 20.0, 30.0]  # up to the shortest run
    assert [p["sparse"] for p in result["pairs"]] == ["sparse_s0"]  # seed 1's dense run is another width
    pair = result["pairs"][0]
    assert pair["dense"] == "dense_s0"
    # at 10 s sparse has no evaluation yet; at 20 s 1.9 - (1.9 - 1.6) * 5 / 15 = 1.8 against 1.5; at 30 s
    # 1.6 against 1.5 + (1.4 - 1.5) * 10 / 11
    assert pair["sparse_minus_dense"] == [None, 0.3, round(1.6 - (1.5 - 0.1 * 10 / 11), 4)]
    table = pairs.markdown(result)
    assert "| sparse_s0 - dense_s0 | 0 |" in table and "| dense_s0 | 132 | - | dense | 160 |" in table


def test_rates_on_tiny_cpu_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "rates.json"
    pairs.main(["rates", "--device", "cpu", "--steps", "40", "--out", str(out), "--run", f"dense_s0=--dense {TINY}",
                "--run", f"sparse_s0={TINY}", "--run", f"sparse_s1={TINY} --seed 1"])
    rates = json.loads(out.read_text())
    assert set(rates) == {f"--dense {TINY}", TINY}  # seed 1 shares seed 0's rate
    assert all(rate > 0 for rate in rates.values())


# ------------------------------------------------------------------------------------------------- usage errors
def _usage_error(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        pairs.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.splitlines()[-1]


@pytest.fixture
def no_training(monkeypatch):
    monkeypatch.setattr("char_lm.loop.Trainer",
                        lambda *a, **k: pytest.fail("a run was measured before the arguments were refused"))


@pytest.mark.parametrize(("argv", "message"), [
    (["--run", f"bad={TINY} --d-model 24 --block 16"], "--run bad: --d-model 24 must be a multiple of --block 16"),
    (["--run", f"bad={TINY} --density 0.9 --prune-every 2"], "--run bad: --prune-every 2 with --density 0.9"),
    (["--run", f"bad={TINY} --context 1000000"], "--run bad: the training split of"),
    (["--run", f"bad={TINY} --lr=-1"], "--run bad: argument --lr: must be a positive number"),
    (["--run", "bad=--help"], "--run bad: the training example's help is not a run"),
    (["--run", "bad=--seed '1"], "--run bad: No closing quotation"),
    (["--device", "bogus"], "argument --device: not a device name: 'bogus'; this machine has: cpu"),
    (["--data", "/no/such/corpus.txt"], "argument --data: no such file or directory: /no/such/corpus.txt"),
    (["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    (["--out", "{tmp}/no/rates.json"], "--out {tmp}/no/rates.json: no folder {tmp}/no to write it in"),
])
def test_rates_refuses_every_bad_argument_before_measuring(argv, message, tmp_path, capsys, no_training):
    """One bad run among good ones is refused before the good ones are measured (their measurement would be
    lost), as are a bad device, corpus, budget or output; nothing is written."""
    out = tmp_path / "rates.json"
    line = _usage_error(["rates", "--device", "cpu", "--out", str(out), "--run", f"good={TINY}",
                         *[a.format(tmp=tmp_path) for a in argv]], capsys)
    assert message.format(tmp=tmp_path) in line
    assert list(tmp_path.iterdir()) == []


class _Trainer:
    """Measures instantly: 2 ms a step; a model of width 48 fails as an out-of-memory run would."""

    def __init__(self, model_cfg, *args, **kwargs):
        if model_cfg.d_model == 48:
            raise RuntimeError("CUDA out of memory")

    def fit(self):
        return {"median_step_ms": 2.0, "params": 1000}


def test_a_run_that_fails_while_measured_is_recorded_and_the_others_kept(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("char_lm.loop.Trainer", _Trainer)
    out = tmp_path / "rates.json"
    pairs.main(["rates", "--device", "cpu", "--out", str(out), "--run", f"good={TINY}",
                "--run", f"big={TINY} --d-model 48", "--run", f"after={TINY} --seed 3 --dense"])
    assert json.loads(out.read_text()) == {TINY: 2.0, f"{TINY} --d-model 48": None, f"{TINY} --dense": 2.0}
    assert "big: failed, not measured: RuntimeError: CUDA out of memory" in capsys.readouterr().out


def _model(sparse: bool = True) -> dict:
    from char_lm.model import ModelConfig

    cfg = ModelConfig(vocab_size=98, d_model=64, density=0.25)
    return (cfg if sparse else cfg.dense_equivalent()).to_dict()


@pytest.mark.parametrize(("setup", "argv", "message"), [
    ("none", [], "{tmp}/runs/missing: no such run folder"),
    ("empty", [], "{tmp}/runs/empty: no log.json (not a finished run of the training example)"),
    ("junk", [], "{tmp}/runs/junk/log.json: not a readable JSON log (JSONDecodeError"),
    ("fieldless", [], "{tmp}/runs/fieldless/log.json: not a log of the training example (no median_step_ms)"),
    ("badval", [], "{tmp}/runs/badval/log.json: history.val is not a list of [seconds, step, BPC] rows"),
    ("ok", ["--every", "0"], "argument --every: must be a positive number, got 0"),
    ("ok", ["--every", "nan"], "argument --every: must be a positive number, got nan"),
    ("ok", ["--every", "-30"], "argument --every: must be a positive number, got -30"),
    ("ok", ["--every", "1e-9"], "--every 1e-09: 20,000,000,000 points up to 20 s, more than 10,000"),
    ("ok", ["--out", "{tmp}/no/pairs.json"], "--out {tmp}/no/pairs.json: no folder {tmp}/no to write it in"),
    ("ok", ["--out", "{tmp}/runs"], "--out {tmp}/runs: a folder; give a file name"),
    ("ok", ["--plot", "{tmp}/pairs.xyz"], "--plot {tmp}/pairs.xyz: give a file name ending in one of"),
    ("ok", ["--plot", "{tmp}/no/pairs.png"], "--plot {tmp}/no/pairs.png: no folder {tmp}/no to write it in"),
])
def test_report_refuses_runs_and_outputs_it_cannot_use(setup, argv, message, tmp_path, capsys):
    runs = tmp_path / "runs"
    good = _write_run(runs, "sparse", _model(), 0, [[10.0, 50, 2.0], [20.0, 100, 1.5]])
    folder = {"none": runs / "missing", "empty": runs / "empty", "junk": runs / "junk", "fieldless": runs / "fieldless",
              "badval": runs / "badval", "ok": good}[setup]
    if setup in ("empty", "junk", "fieldless", "badval"):
        folder.mkdir()
    if setup == "junk":
        (folder / "log.json").write_text("{")
    if setup in ("fieldless", "badval"):
        summary = json.loads((good / "log.json").read_text())
        if setup == "fieldless":
            del summary["median_step_ms"]
        else:
            summary["history"]["val"] = [[1.0, "step"]]
        (folder / "log.json").write_text(json.dumps(summary))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    line = _usage_error(["report", str(good), str(folder), "--out", str(tmp_path / "pairs.json"),
                         *[a.format(tmp=tmp_path) for a in argv]], capsys)
    assert message.format(tmp=tmp_path) in line
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_report_writes_json_and_plot(tmp_path, capsys):
    runs = tmp_path / "runs"
    dirs = [_write_run(runs, "sparse", _model(), 0, [[10.0, 50, 2.0], [20.0, 100, 1.5]]),
            _write_run(runs, "dense", _model(sparse=False), 0, [[10.0, 80, 2.1], [25.0, 160, 1.4]])]
    summary = json.loads((dirs[1] / "log.json").read_text())
    summary["history"]["val"], summary["median_step_ms"] = [], None  # stopped before its first evaluation
    summary["train"]["seed"] = 1
    _write_run(runs, "short", _model(sparse=False), 1, [[0.0, 0, 0.0]])
    (runs / "short" / "log.json").write_text(json.dumps(summary))
    pairs.main(["report", *map(str, dirs), str(runs / "short"), "--every", "10", "--out", str(tmp_path / "p.json"),
                "--plot", str(tmp_path / "p.png")])
    result = json.loads((tmp_path / "p.json").read_text())
    assert result["seconds"] == [10.0, 20.0] and result["pairs"][0]["sparse_minus_dense"] == [-0.1, -0.1333]
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    assert "| short | " in capsys.readouterr().out
