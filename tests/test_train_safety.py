"""The training command never writes a bad checkpoint and refuses bad input before any work.

Covers: a run whose loss, validation BPC or state stops being finite stops at the next read with exit status 1
and leaves the last good checkpoint byte for byte; arguments, the device, the output folder and the corpus size
are checked before training (and before any folder is left behind); a --resume file that is not a training
checkpoint of this program says so.
"""

from __future__ import annotations

import math
import pickle
from pathlib import Path

import pytest
import torch
from char_lm import CharCorpus, ModelConfig, TrainConfig, Trainer
from char_lm.cli import main
from char_lm.data import check_eval_fits, fallback_text, split_text
from char_lm.loop import TrainingDiverged, pick_device
from char_lm.report import plot_bpc

QUIET = {"progress": False, "verbose": False}
TEXT = "the quick brown fox jumps over the lazy dog. " * 200


def tiny(out: Path | None = None, context: int = 16) -> list[str]:
    """A model and a budget that train in well under a second on two CPU cores."""
    argv = ["--device", "cpu", "--offline", "--no-progress", "--d-model", "16", "--layers", "1", "--heads", "2",
            "--context", str(context), "--batch-size", "2", "--eval-chars", "64", "--log-every", "2"]
    return argv + (["--out", str(out)] if out is not None else [])


def usage_error(argv: list[str], capsys) -> str:
    """Run the CLI expecting a usage error (exit status 2); returns stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.fixture(scope="module")
def corpus() -> CharCorpus:
    return CharCorpus.from_splits(*split_text(fallback_text()), source="fallback")


def tiny_model(corpus: CharCorpus) -> ModelConfig:
    return ModelConfig(vocab_size=corpus.vocab.size, context=16, d_model=16, n_layers=1, n_heads=2)


# ------------------------------------------------------------------------------------------------- divergence
def _poison(trainer: Trainer, target: str) -> None:
    with torch.no_grad():
        if target == "parameter":
            trainer.params[0].fill_(math.nan)
        else:  # an AdamW second moment: the weights stay finite (the update divides by it), the state does not
            state = trainer.optimizer.state[trainer.params[0]]
            state["exp_avg_sq"].fill_(math.inf)


@pytest.mark.parametrize(("poison_after", "target", "what"), [
    (3, "parameter", "the training loss"),  # step 4's loss is NaN: the log read of step 4 stops the run
    (4, "parameter", "the validation BPC"),  # step 4's loss was finite: the evaluation of step 4 stops it
    (4, "optimizer", "1 of "),  # loss and BPC finite, an AdamW moment inf: the state check before the save
], ids=["loss", "val-bpc", "optimizer-state"])
def test_divergence_stops_with_exit_1_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys,
                                                                         poison_after, target, what):
    good: dict[str, bytes] = {}
    train_step = Trainer.train_step

    def step_then_poison(self, *args, **kwargs):
        train_step(self, *args, **kwargs)
        if self.step == poison_after:
            good["bytes"] = (tmp_path / "checkpoint.pt").read_bytes()  # written by the evaluation of step 2
            _poison(self, target)

    monkeypatch.setattr(Trainer, "train_step", step_then_poison)
    assert main(["--steps", "8", "--eval-every", "2", *tiny(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"training diverged at step 4: {what}" in err and "stopped being finite" in err
    assert f"the checkpoint of step 2 in {tmp_path / 'checkpoint.pt'} is kept unchanged" in err
    assert "lower --lr (now 0.002) or raise --warmup-steps (now 200)" in err
    assert (tmp_path / "checkpoint.pt").read_bytes() == good["bytes"]
    assert not (tmp_path / "log.json").exists() and not (tmp_path / "bpc.png").exists()  # no plot of a bad run
    if target == "optimizer":
        assert "(exp_avg_sq)" in err


def test_huge_learning_rate_stops_without_a_checkpoint(tmp_path, capsys):
    assert main(["--steps", "8", "--lr", "1e6", "--eval-every", "4", *tiny(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "training diverged at step" in err and "no checkpoint was written" in err and "lower --lr (now 1e+06)" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_interrupted_run_checks_before_its_checkpoint(corpus, tmp_path):
    trainer = Trainer(tiny_model(corpus), TrainConfig(steps=8, batch_size=2, log_every=100, eval_every=100,
                                                      eval_chars=64), corpus, "cpu", out_dir=tmp_path, **QUIET)
    trainer.fit(stop_step=2)
    good = (tmp_path / "checkpoint.pt").read_bytes()
    _poison(trainer, "optimizer")
    with pytest.raises(TrainingDiverged, match="the checkpoint of step 2 in .* is kept unchanged"):
        trainer.fit(stop_step=4)
    assert (tmp_path / "checkpoint.pt").read_bytes() == good


def test_resumed_run_names_the_checkpoint_it_keeps(corpus, tmp_path):
    cfg = TrainConfig(steps=8, batch_size=2, log_every=100, eval_every=100, eval_chars=64)
    Trainer(tiny_model(corpus), cfg, corpus, "cpu", out_dir=tmp_path, **QUIET).fit(stop_step=3)
    good = (tmp_path / "checkpoint.pt").read_bytes()
    resumed = Trainer.resume(tmp_path, corpus, "cpu", **QUIET)
    _poison(resumed, "parameter")
    with pytest.raises(TrainingDiverged, match="at step 8: the training loss .*the checkpoint of step 3 in"):
        resumed.fit()
    assert (tmp_path / "checkpoint.pt").read_bytes() == good


def test_plot_of_non_finite_points_does_not_raise(tmp_path):
    history = {"train": [[1.0, 2, 3.0], [2.0, 4, math.nan], [3.0, 6, math.inf]], "val": [[1.0, 2, math.nan]]}
    plot_bpc(tmp_path / "bpc.png", {"run": {"history": history, "edges_history": []}})
    assert (tmp_path / "bpc.png").stat().st_size > 1000


# ------------------------------------------------------------------------------------------------- arguments
@pytest.mark.parametrize(("argv", "message"), [
    (["--warmup-steps", "-5"], "argument --warmup-steps: must be >= 0, got -5"),
    (["--seed", str(2**63)], "argument --seed: must be below 2**63"),
    (["--seed", "-3"], "argument --seed: must be >= 0, got -3"),
    (["--lr", "nan"], "argument --lr: must be a positive number"),
    (["--lr", "inf"], "argument --lr: must be a positive number"),
    (["--minutes", "1e308"], "argument --minutes: must be at most 1e+07"),
    (["--eval-chars", "0"], "argument --eval-chars: must be a positive integer"),
    (["--density", "1e-9", "--steps", "1"], "--density 1e-09 leaves the 16x16 matrices of --d-model 16 without a "
                                            "connection: give --density 0.00391 or more"),
    (["--device", "meta"], "argument --device: meta: no csr_linear kernels on meta; this machine has: auto, cpu"),
    (["--device", "gpu"], "argument --device: not a device name: 'gpu'; this machine has: auto, cpu"),
    (["--device", "cpu:1"], "argument --device: cpu:1: cpu has one device, cpu; this machine has: auto, cpu"),
])
def test_bad_values_are_usage_errors_before_any_work(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    err = usage_error([*tiny(out), *argv], capsys)  # a later --device wins over tiny()'s
    assert message in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize(("name", "available", "count", "message"), [
    ("cuda:3", True, 2, "--device cuda:3: this machine has 2 CUDA devices, cuda:0 to cuda:1"),
    ("cuda", False, 0, "--device cuda: this torch has no usable CUDA device; use auto, cpu or mps"),
])
def test_cuda_device_is_checked_to_exist(monkeypatch, name, available, count, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    with pytest.raises(RuntimeError) as exc:
        pick_device(name)
    assert str(exc.value) == message


def test_largest_seed_trains(corpus):
    cfg = TrainConfig(steps=1, batch_size=2, eval_chars=64, seed=2**63 - 1)
    assert Trainer(tiny_model(corpus), cfg, corpus, "cpu", **QUIET).fit()["steps"] == 1


@pytest.mark.parametrize(("field", "value", "message"), [
    ("warmup_steps", -5, "warmup_steps must be >= 0"),
    ("lr", 0.0, "lr must be a positive number"),
    ("lr", math.inf, "lr must be a positive number"),
    ("seed", 2**63, r"seed must be in \[0, 2\*\*63\)"),
    ("eval_chars", 0, "eval_chars must be positive"),
])
def test_train_config_rejects_bad_values(field, value, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(steps=1, **{field: value})


# ------------------------------------------------------------------------------------------------- output folder
@pytest.mark.parametrize("where", ["under-a-file", "a-file", "proc"])
def test_unwritable_out_is_refused_before_training(tmp_path, capsys, where):
    (tmp_path / "file").write_text("")
    out = {"under-a-file": tmp_path / "file" / "run", "a-file": tmp_path / "file", "proc": Path("/proc/no/run")}[where]
    err = usage_error(["--steps", "2", *tiny(out)], capsys)
    assert f"--out {out}: cannot write there" in err
    assert "corpus" not in err  # refused before the corpus was loaded


def test_default_out_is_checked_too(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").write_text("")  # runs/<name> cannot be created
    err = usage_error(["--steps", "2", *tiny()], capsys)
    assert "the default output folder runs/sparse-" in err and "(give --out): cannot write there" in err


def test_out_check_leaves_no_folder_behind(tmp_path, capsys):
    out = tmp_path / "a" / "b"
    usage_error(["--steps", "2", *tiny(out, context=100_000)], capsys)  # refused after the --out check
    assert not (tmp_path / "a").exists()


# ------------------------------------------------------------------------------------------------- corpus size
def _wikitext(folder: Path, valid: str) -> Path:
    folder.mkdir(exist_ok=True)
    for name, text in (("wiki.train.raw", TEXT), ("wiki.valid.raw", valid), ("wiki.test.raw", "x")):
        (folder / name).write_text(text)
    return folder


@pytest.mark.parametrize(("case", "message"), [
    ("train", "the training split of file:{data} (90/5/5) has 2,700 characters; one training window of --context "
              "4000 needs 4,002: give a larger --data or a smaller --context (at most 2698)"),
    ("valid", "the validation split of wikitext-dir:{data} has 10 characters; one validation window of --context "
              "16 needs 17: give a larger --data or a smaller --context (at most 9)"),
    ("eval-chars", "--eval-chars 8 is smaller than --context 16: an evaluation needs at least one window; give "
                   "--eval-chars 16 or more"),
])
def test_corpus_too_small_is_refused_before_training(tmp_path, capsys, case, message):
    if case == "valid":
        data = _wikitext(tmp_path / "wiki", "0123456789")
    else:
        data = tmp_path / "corpus.txt"
        data.write_text(TEXT[:3000])
    extra = {"train": ["--context", "4000"], "eval-chars": ["--eval-chars", "8"]}.get(case, [])
    out = tmp_path / "run"
    err = usage_error(["--steps", "2", "--data", str(data), *tiny(out), *extra], capsys)
    assert message.format(data=data) in err
    assert not out.exists()


def test_resume_checks_the_corpus_against_the_checkpoint(tmp_path, capsys):
    data = _wikitext(tmp_path / "wiki", TEXT[:500])
    run = tmp_path / "run"
    assert main(["--steps", "2", "--data", str(data), *tiny(run)]) == 0
    good = (run / "checkpoint.pt").read_bytes()
    (data / "wiki.valid.raw").write_text("the fox")  # the same vocabulary, too short to evaluate on
    err = usage_error(["--resume", str(run), "--steps", "4", "--no-progress"], capsys)
    assert "the validation split of wikitext-dir:" in err and "has 7 characters; one validation window of the " \
        "checkpoint's --context 16 needs 17: give a larger --data" in err
    assert (run / "checkpoint.pt").read_bytes() == good


def test_trainer_checks_the_validation_split_when_built(corpus):
    small = CharCorpus.from_splits(TEXT, "the fox", "", "inline")
    with pytest.raises(ValueError, match="the validation split of inline has 7 characters; one evaluation window "
                                         "of context 16 needs 17"):
        Trainer(tiny_model(small), TrainConfig(steps=1, batch_size=2), small, "cpu", **QUIET)
    with pytest.raises(ValueError, match="eval_chars 8 is smaller than context 16"):
        check_eval_fits(corpus, 16, 8)


# ------------------------------------------------------------------------------------------------- --resume files
class Foreign:
    """A class of another program: a pickle of it is no checkpoint, and weights_only refuses to load it."""


@pytest.fixture(scope="module")
def checkpoint(corpus, tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint.pt"
    Trainer(tiny_model(corpus), TrainConfig(steps=1, batch_size=2), corpus, "cpu", **QUIET).save(path)
    return {"path": path, "state": torch.load(path, weights_only=True)}


def _bad_checkpoint(kind: str, checkpoint: dict, path: Path) -> str:
    """Write a bad --resume file of ``kind``; returns what the message must say after the common part."""
    state = dict(checkpoint["state"])
    good = checkpoint["path"].read_bytes()
    if kind == "garbage":
        path.write_bytes(b"definitely not a checkpoint\n")
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif kind == "plain-pickle":
        path.write_bytes(pickle.dumps({"format": 1}, protocol=2))
    elif kind == "foreign-class":
        torch.save({"format": 1, "x": Foreign()}, path)
    else:
        torch.save(_foreign_state(kind, state), path)
    return {"list": "it holds a list", "no-format": "it has format None, this program writes 1",
            "format-99": "it has format 99", "missing-entries": "it is a dict without model, optimizer",
            "bad-entry": "it is a dict with a bad step", "bad-settings": "its settings describe no run",
            "wrong-weights": "its contents do not load (RuntimeError: Error(s) in loading state_dict",
            "wrong-optimizer": "its contents do not load (ValueError"}.get(kind, "it cannot be read as a torch file")


def _foreign_state(kind: str, state: dict) -> object:
    if kind == "list":
        return [1, 2, 3]
    if kind == "no-format":
        return {"model": {}}
    if kind == "format-99":
        return {**state, "format": 99}
    if kind == "missing-entries":
        return {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    if kind == "bad-entry":
        return {**state, "step": "three"}
    if kind == "bad-settings":
        return {**state, "model_config": {**state["model_config"], "bogus": 1}}
    if kind == "wrong-weights":
        return {**state, "model": dict(list(state["model"].items())[1:])}
    assert kind == "wrong-optimizer"
    return {**state, "optimizer": {**state["optimizer"], "param_groups": state["optimizer"]["param_groups"][:1]}}


@pytest.mark.parametrize("kind", ["garbage", "empty", "truncated", "plain-pickle", "foreign-class", "list",
                                  "no-format", "format-99", "missing-entries", "bad-entry", "bad-settings",
                                  "wrong-weights", "wrong-optimizer"])
def test_resume_of_a_file_that_is_not_a_checkpoint_says_so(tmp_path, capsys, checkpoint, kind):
    path = tmp_path / "checkpoint.pt"
    detail = _bad_checkpoint(kind, checkpoint, path)
    before = path.read_bytes()
    err = usage_error(["--resume", str(path), *tiny()[:4]], capsys)
    assert f"--resume {path} is not a training checkpoint of this program: {detail}" in err
    assert "weights_only" not in err and "Traceback" not in err
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
