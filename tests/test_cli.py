"""The command lines' usage errors: ``python -m torch_sparse_metal_tools.tune``, ``examples/sparsify_model.py`` and the
training CLI refuse bad values up front, as argparse does (exit status 2, one ``error:`` line naming the option),
before anything is trained, tuned, cleared or overwritten."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from char_lm.cli import main as train_main

from torch_sparse_metal import contract, tuning
from torch_sparse_metal_tools.tune import main as tune_main

ROOT = Path(__file__).resolve().parents[1]
#: A script's environment: the package of this checkout (a script's own folder leads sys.path, not the checkout).
SCRIPT_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def usage_error(main, argv: list[str], capsys) -> str:
    """The one error line of a usage error (status 2), after the usage lines."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def cache(monkeypatch, tmp_path):
    """A cache of its own in tmp_path holding one decision (tuning stays off: the command turns it on)."""
    monkeypatch.setenv("TORCH_SPARSE_METAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_memory", None)
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"a machine": {"a bucket": {"strategy": "fused_atomic"}}}))
    return path


# ------------------------------------------------------------------------------------------------- tune
@pytest.mark.parametrize(("argv", "message"), [
    ([], "nothing to do: give --layer IN,OUT,DENSITY, --show or --clear"),
    (["--layer", "64,32,2"], "argument --layer: '64,32,2': density must be in [0, 1], got 2.0"),
    (["--layer", "64,32,-0.5"], "argument --layer: '64,32,-0.5': density must be in [0, 1]"),
    (["--layer", "64,-32,0.1"], "argument --layer: IN and OUT must be positive"),
    (["--layer", "0,32,0.1"], "argument --layer: IN and OUT must be positive"),
    (["--layer", "10,10,0.001"], "density 0.001 leaves no edge in 10x10; give DENSITY 0.01 or more"),
    (["--layer", "64x32"], "argument --layer: expected IN,OUT,DENSITY"),
    (["--layer", "64,32,0.1", "--batch", "-1"], "argument --batch: must be a positive integer, got -1"),
    (["--layer", "64,32,0.1", "--batch", "0"], "argument --batch: must be a positive integer, got 0"),
    (["--show", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--show", "--device", "tpu"], "argument --device: not a device name: 'tpu'"),
    (["--show", "--device", "meta"], "argument --device: meta: no csr_linear kernels on meta"),
    (["--show", "--device", "cpu:1"], "argument --device: cpu:1: cpu has one device"),
])
def test_tune_refuses_bad_values(argv, message, capsys, cache):
    before = cache.read_text()
    assert message in usage_error(tune_main, argv, capsys)
    assert cache.read_text() == before  # nothing tuned or written


@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has a CUDA device")
def test_tune_refuses_a_missing_cuda_device(capsys, cache):
    assert "argument --device: cuda: this torch has no usable CUDA device" in usage_error(
        tune_main, ["--device", "cuda", "--layer", "64,32,0.1"], capsys)


def test_tune_offers_the_contracts_dtypes_and_checks_them_on_the_device(capsys, cache, monkeypatch):
    help_text = subprocess.run([sys.executable, "-m", "torch_sparse_metal_tools.tune", "--help"], capture_output=True,
                               text=True, timeout=120, check=True).stdout
    names = [str(d).removeprefix("torch.") for d in contract.DTYPES]
    assert "{" + ",".join(names) + "}" in " ".join(help_text.split())
    assert {"bfloat16", "float16"} <= set(names)
    # a device whose kernels lack float64 (as MPS's do): refused before anything is cleared
    monkeypatch.setattr("torch_sparse_metal_tools.tune.supported_dtypes", lambda device_type: (torch.float32,))
    line = usage_error(tune_main, ["--device", "cpu", "--dtype", "float64", "--clear"], capsys)
    assert "--dtype float64: no csr_linear kernels for it on cpu; there: float32" in line
    assert cache.exists()


def test_tune_runs_a_16_bit_dtype(capsys, cache):
    assert tune_main(["--device", "cpu", "--dtype", "bfloat16", "--layer", "64,32,0.1", "--batch", "8"]) == 0
    assert "64x32, density 0.1, batch 8 on cpu: " in capsys.readouterr().out


def test_tune_refusal_clears_nothing(capsys, cache):
    line = usage_error(tune_main, ["--clear", "--layer", "64,32,2"], capsys)
    assert "density must be in [0, 1]" in line and cache.exists()


def test_tune_tunes_with_tuning_off_and_leaves_it_off(capsys, cache):
    """The command is the opt-in: it tunes whatever the switch says, and gives the caller's setting back."""
    assert not tuning.enabled()
    assert tune_main(["--device", "cpu", "--layer", "64,32,0.1", "--batch", "8"]) == 0
    assert "64x32, density 0.1, batch 8 on cpu: backward fused_atomic (the static rule)" in capsys.readouterr().out
    assert not tuning.enabled()


def test_tune_usage_error_through_the_module(cache):
    out = subprocess.run([sys.executable, "-m", "torch_sparse_metal_tools.tune", "--layer", "64,32,2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.splitlines()[-1].endswith("argument --layer: '64,32,2': density must be in [0, 1], got 2.0")


# ------------------------------------------------------------------------------------------------- sparsify example
@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("sparsify_model_cli", ROOT / "examples" / "sparsify_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("argv", "message"), [
    (["--density", "2"], "argument --density: must be in (0, 1]"),
    (["--density", "0"], "argument --density: must be in (0, 1]"),
    (["--density", "nan"], "argument --density: must be in (0, 1]"),
    (["--data", "/no/such/corpus.txt"], "argument --data: no such file or directory: /no/such/corpus.txt"),
    (["--steps", "-1"], "argument --steps: must be a positive integer, got -1"),
    (["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    (["--finetune-steps", "-1"], "argument --finetune-steps: must be >= 0, got -1"),
    (["--batch-size", "0"], "argument --batch-size: must be a positive integer"),
    (["--eval-chars", "-5"], "argument --eval-chars: must be a positive integer"),
    (["--seed", "-1"], "argument --seed: must be >= 0"),
    (["--d-model", "33"], "--d-model 33 must be a multiple of the model's 2 heads"),
    (["--d-model", "4", "--density", "0.01"], "--density 0.01 leaves the 4x4 matrices of --d-model 4 without"),
    (["--device", "meta"], "argument --device: meta: no csr_linear kernels on meta"),
    (["--context", "100000"], "one training window of --context 100000 needs 100,002"),
    (["--context", "64", "--eval-chars", "10"], "--eval-chars 10 is smaller than --context 64"),
])
def test_sparsify_example_refuses_bad_values_before_training(example, monkeypatch, capsys, argv, message):
    monkeypatch.setattr(example, "train", lambda *a, **k: pytest.fail("trained before the arguments were checked"))
    assert message in usage_error(example.main, argv, capsys)


def test_sparsify_example_unreadable_data_is_a_usage_error(example, tmp_path, capsys):
    (tmp_path / "wiki.train.raw").write_text("a folder without its other splits " * 50)
    line = usage_error(example.main, ["--data", str(tmp_path)], capsys)
    assert f"--data {tmp_path}" in line and "wiki.valid.raw" in line


def test_sparsify_example_usage_error_as_a_script():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "sparsify_model.py"), "--density", "2"],
                         capture_output=True, text=True, timeout=120, env=SCRIPT_ENV)
    assert out.returncode == 2 and "Traceback" not in out.stderr and out.stdout == ""
    assert out.stderr.splitlines()[-1].endswith("argument --density: must be in (0, 1] (the fraction of connections "
                                                "kept), got 2")


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_sparsify_example_shows_progress_on_a_terminal_and_in_a_log(example, monkeypatch, tty):
    """A bar on a terminal; elsewhere plain lines (the first at the start, the last at the end: at least one every
    30 s in between, tests/test_progress.py), never a silent run; nothing with --no-progress."""
    from char_lm import CharCorpus, CharTransformer, ModelConfig, WindowSampler

    stream = _Terminal() if tty else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    corpus = CharCorpus.from_splits("abcdefgh" * 100, "abcdefgh" * 10, "abcdefgh" * 10, "inline")
    model = CharTransformer(ModelConfig(vocab_size=corpus.vocab.size, context=8, d_model=16, n_layers=1, n_heads=2,
                                        sparse=False))
    example.train(model, WindowSampler(corpus.train, 8, 2, seed=0), 3, lr=1e-3, desc="dense training")
    shown = stream.getvalue()
    assert "dense training" in shown and "3/3" in shown
    if not tty:
        lines = shown.splitlines()
        assert "\r" not in shown and len(lines) >= 2 and lines[0].startswith("dense training: ")
        assert "0/3" in lines[0] and "3/3" in lines[-1]
    stream = _Terminal()
    monkeypatch.setattr(sys, "stderr", stream)
    example.train(model, WindowSampler(corpus.train, 8, 2, seed=0), 2, lr=1e-3, progress=False)
    assert stream.getvalue() == ""  # --no-progress


# ------------------------------------------------------------------------------------------------- training CLI
def _tiny(out: Path) -> list[str]:
    return ["--device", "cpu", "--offline", "--d-model", "32", "--layers", "1", "--heads", "2", "--context", "32",
            "--batch-size", "4", "--eval-chars", "512", "--log-every", "2", "--no-progress", "--out", str(out)]


@pytest.mark.parametrize(("argv", "message"), [
    (["--grow-until", "0"], "argument --grow-until: must be in (0, 1], got 0"),
    (["--prune-stop", "1.5"], "argument --prune-stop: must be in (0, 1], got 1.5"),
    (["--drop-fraction", "-1"], "argument --drop-fraction: must be in (0, 1], got -1"),
    (["--dist-timeout", "-1"], "argument --dist-timeout: must be a positive number"),
    (["--device", "cpu", "--offline", "--data", "/dev/null"], "--data /dev/null: neither a text file nor a WikiText"),
    (["--density", "-0.1"], "argument --density: must be in (0, 1]"),
    (["--density", "1.5"], "argument --density: must be in (0, 1]"),
    (["--density", "lots"], "argument --density: expected a number"),
    (["--minutes", "1", "--steps", "10"], "argument --steps: not allowed with argument --minutes"),
    (["--backward", "magic"], "argument --backward: invalid choice: 'magic'"),
    (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
    (["--data", "/no/such/corpus.txt"], "argument --data: no such file or directory: /no/such/corpus.txt"),
    (["--steps", "0"], "argument --steps: must be a positive integer"),
    (["--d-model", "30", "--heads", "4"], "--d-model 30 must be a multiple of --heads 4"),
    (["--dense", "--prune-every", "10"], "cannot be combined with --dense"),
    (["--grow", "0.5"], "--grow needs --prune-every"),
    (["--density", "0.3", "--grow", "0.2", "--prune-every", "5"], "--grow 0.2 is below --density 0.3"),
    (["--prune-every", "0"], "argument --prune-every: must be a positive integer"),
    (["--prune-to", "0.1"], "--prune-to (gradual pruning) needs --prune-every"),
    (["--prune-to", "0.1", "--prune-every", "5", "--regrow", "rigl"], "takes neither --grow nor --regrow"),
    (["--density", "0.3", "--prune-to", "0.5", "--prune-every", "5"], "--prune-to 0.5 is above --density 0.3"),
    (["--density", "1", "--prune-to", "0.1", "--prune-every", "5", "--minutes", "1"], "--prune-to needs a --steps"),
    (["--distribution", "global"], "argument --distribution: invalid choice: 'global'"),
    (["--drop-fraction", "2"], "argument --drop-fraction: must be in (0, 1]"),
    (["--dropout", "1"], "argument --dropout: must be in [0, 1)"),
    (["--warmup-steps", "-5"], "argument --warmup-steps: must be >= 0, got -5"),
    (["--seed", "-1"], "argument --seed: must be >= 0"),
    (["--seed", str(2**64)], "argument --seed: must be below 2**63"),
    (["--device", "meta", "--offline"], "argument --device: meta: no csr_linear kernels on meta"),
    (["--device", "cpu", "--offline", "--context", "100000"], "one training window of --context 100000 needs 100,002"),
    (["--device", "cpu", "--offline", "--eval-chars", "5"], "--eval-chars 5 is smaller than --context"),
    (["--device", "cpu", "--offline", "--out", "/proc/no/such/dir"], "--out /proc/no/such/dir: cannot write there"),
])
def test_train_cli_messages_name_the_option(argv, message, capsys):
    line = usage_error(train_main, argv, capsys)
    assert message in line and line.count("--data") <= 1


#: A value other than the default for each option that configures sparse layers only.
_SPARSE_ONLY_VALUES = {"backward": "atomic_free", "prune_every": "10", "grow": "0.5", "grow_until": "0.3",
                       "drop_fraction": "0.2", "prune_stop": "0.5", "regrow": "rigl", "prune_to": "0.05",
                       "min_salient": "2"}


def test_the_sparse_only_options_are_the_evolving_group_and_backward():
    """SPARSE_ONLY, which --dense refuses, names every option of the evolving-topology group and --backward: an option
    added to the group without being listed would be ignored by --dense runs."""
    from char_lm.cli import SPARSE_ONLY, build_parser

    group = next(g for g in build_parser()._action_groups if g.title.startswith("evolving topology"))
    assert set(SPARSE_ONLY) == {a.dest for a in group._group_actions} | {"backward"} == set(_SPARSE_ONLY_VALUES)


@pytest.mark.parametrize("dest", list(_SPARSE_ONLY_VALUES))
def test_dense_refuses_each_sparse_only_option(tmp_path, dest, capsys):
    """--dense builds nn.Linear layers: an option that would change the sparse ones is refused, named, before
    anything runs (nothing is written), as --prune-every is."""
    option = "--" + dest.replace("_", "-")
    out = tmp_path / "run"
    line = usage_error(train_main, ["--steps", "2", *_tiny(out), "--dense", option, _SPARSE_ONLY_VALUES[dest]], capsys)
    assert f"error: {option} configures sparse layers only" in line, line
    assert "cannot be combined with --dense" in line and not out.exists()


def test_dense_accepts_the_sparse_only_options_at_their_defaults(tmp_path, capsys):
    """Written with its default value an option changes nothing, so --dense takes it (a dense run trains)."""
    out = tmp_path / "run"
    assert train_main(["--steps", "1", *_tiny(out), "--dense", "--backward", "auto", "--regrow", "set"]) == 0
    assert "model: dense" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "message"), [
    (["--decoupled", "2:1"], "one forward worker is supported"),
    (["--decoupled", "1:0"], "at least one backward worker"),
    (["--decoupled", "x"], "expected F:B"),
    (["--max-in-flight", "2"], "give --decoupled F:B with it"),
    (["--straggler-ms", "5"], "give --decoupled F:B with it"),
    (["--decoupled", "--max-in-flight", "0"], "must be a positive integer"),
    (["--decoupled", "--straggler-ms", "-1"], "must be a number >= 0"),
    (["--decoupled", "--prune-every", "10"], "not supported with --decoupled"),
    (["--decoupled", "--dtype", "float16"], "use --dtype bfloat16 or float32"),
])
def test_train_cli_refuses_bad_decoupled_arguments(tmp_path, argv, message, capsys):
    assert message in usage_error(train_main, ["--steps", "2", *_tiny(tmp_path / "run"), *argv], capsys)
    assert not (tmp_path / "run").exists()  # refused before any work


def test_train_cli_new_run_does_not_replace_another_runs_files(tmp_path, capsys):
    assert train_main(["--steps", "2", *_tiny(tmp_path)]) == 0
    files = {name: (tmp_path / name).read_bytes() for name in ("checkpoint.pt", "log.json", "bpc.png")}
    capsys.readouterr()
    line = usage_error(train_main, ["--steps", "2", "--seed", "1", *_tiny(tmp_path)], capsys)
    assert f"--out {tmp_path} holds another run's checkpoint.pt, log.json, bpc.png" in line
    assert f"--resume {tmp_path}" in line and "--overwrite" in line
    assert {name: (tmp_path / name).read_bytes() for name in files} == files
    # its own folder is where a resumed run writes; --overwrite lets a new run replace the files
    assert train_main(["--resume", str(tmp_path), "--steps", "4", "--offline", "--no-progress"]) == 0
    assert train_main(["--steps", "2", "--seed", "1", "--overwrite", *_tiny(tmp_path)]) == 0
    assert json.loads((tmp_path / "log.json").read_text())["train"]["seed"] == 1


def test_train_cli_resume_into_another_runs_folder_is_refused(tmp_path, capsys):
    assert train_main(["--steps", "2", *_tiny(tmp_path / "a")]) == 0
    assert train_main(["--steps", "2", *_tiny(tmp_path / "b")]) == 0
    capsys.readouterr()
    before = (tmp_path / "b" / "checkpoint.pt").read_bytes()
    line = usage_error(train_main, ["--resume", str(tmp_path / "a"), "--steps", "4", *_tiny(tmp_path / "b")], capsys)
    assert "holds another run's checkpoint.pt" in line
    assert (tmp_path / "b" / "checkpoint.pt").read_bytes() == before


# ------------------------------------------------------------------------------------------- report (compare runs)
def test_report_compares_two_runs(tmp_path, capsys):
    from char_lm.report import main as report_main

    for name in ("a", "b"):
        assert train_main(["--steps", "2", *_tiny(tmp_path / name)]) == 0
    capsys.readouterr()
    assert report_main([str(tmp_path / "a"), str(tmp_path / "b" / "log.json"), "--out", str(tmp_path / "c.png")]) == 0
    out = capsys.readouterr().out
    assert "| Steps completed | 2 |" in out and "(b)" in out and f"plot: {tmp_path / 'c.png'}" in out
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(("content", "out", "message"), [
    ("{", "c.png", "not a readable JSON log (JSONDecodeError"),
    ('{"a": 1}', "c.png", "not a training log of this program (no name, history)"),
    ('{"name": "x", "history": {"train": 3}}', "c.png", "not a training log of this program (no history.train/val)"),
    ("[1, 2]", "c.png", "not a training log of this program (no name, history)"),
    ('{"name": "x", "history": {"train": [], "val": []}}', "c.txt", "--out {dir}/c.txt: give a file name ending in"),
    ('{"name": "x", "history": {"train": [], "val": []}}', "no/c.png", "no folder {dir}/no to write it in"),
])
def test_report_refuses_logs_and_outputs_it_cannot_use(tmp_path, capsys, content, out, message):
    from char_lm.report import main as report_main

    (tmp_path / "log.json").write_text(content)
    line = usage_error(report_main, [str(tmp_path / "log.json"), "--out", str(tmp_path / out)], capsys)
    assert message.format(dir=tmp_path) in line
    assert not (tmp_path / out).exists()


# ------------------------------------------------------------------------------------------- training CLI: layout
def _no_work(monkeypatch) -> None:
    """Loading the corpus is the first work a run does: a test that expects a refusal before it fails there."""
    monkeypatch.setattr("char_lm.data.load_corpus",
                        lambda *a, **k: pytest.fail("the corpus was loaded before the arguments were refused"))


@pytest.mark.parametrize(("argv", "message"), [
    # one connection (1.02 edges) but no whole vector of 8 (0.13 vectors) in the 32x32 matrices
    (["--d-model", "32", "--block", "8", "--density", "0.001"],
     "--density 0.001 leaves the 32x32 matrices of --d-model 32 without a vector (--block 8: 8 connections): give "
     "--density 0.00781 or more"),
    (["--d-model", "64", "--block", "32", "--density", "0.003"],
     "--density 0.003 leaves the 64x64 matrices of --d-model 64 without a vector (--block 32: 32 connections)"),
    (["--d-model", "40", "--heads", "2", "--block", "16", "--dense"], "--d-model 40 must be a multiple of --block 16"),
])
def test_train_cli_counts_vectors_not_edges(tmp_path, monkeypatch, capsys, argv, message):
    _no_work(monkeypatch)
    out = tmp_path / "run"
    assert message in usage_error(train_main, [*_tiny(out), "--steps", "2", *argv], capsys)
    assert not out.exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--density", "0.9", "--prune-every", "2", "--steps", "100"],
     "--prune-every 2 with --density 0.9 and --drop-fraction 0.3, in the 32x32 matrices: DynamicSparsity cannot "
     "keep the edge count"),
    (["--density", "0.8", "--prune-every", "2", "--minutes", "1"], "without total_steps updates follow the progress"),
    (["--density", "0.9", "--prune-every", "2", "--steps", "100", "--block", "8", "--regrow", "rigl"],
     "counted in whole vectors of 8"),
    (["--density", "0.5", "--grow", "1", "--prune-every", "2", "--steps", "100"],
     "--density 0.5, --grow 1 and --drop-fraction 0.3, in the 32x32 matrices: DynamicSparsity cannot keep"),
    # constant fan-in
    (["--constant-fan-in", "--grow", "0.5", "--prune-every", "5", "--steps", "10"],
     "--grow does not apply with --constant-fan-in"),
    (["--min-salient", "2", "--prune-every", "5", "--steps", "10"], "--min-salient (SRigL's neuron ablation) needs "
     "--constant-fan-in"),
    (["--constant-fan-in", "--min-salient", "2", "--steps", "10"], "--min-salient needs --prune-every without "
     "--prune-to"),
    (["--constant-fan-in", "--min-salient", "2", "--density", "1", "--prune-to", "0.1", "--prune-every", "5",
      "--steps", "10"], "--min-salient needs --prune-every without --prune-to"),
    (["--min-salient", "0"], "argument --min-salient: must be a positive integer"),
    (["--constant-fan-in", "--density", "0.01", "--steps", "10"],
     "--density 0.01 with --constant-fan-in gives the outputs of the 32x32 matrices of --d-model 32 round(0.01 * 32) "
     "= 0 inputs each: give --density 0.0312 or more"),
    (["--constant-fan-in", "--density", "0.9", "--prune-every", "2", "--steps", "100"],
     "--prune-every 2 with --density 0.9 and --drop-fraction 0.3, in the 32x32 matrices: DynamicSparsity cannot keep "
     "the fan-in"),
    (["--constant-fan-in", "--block", "8", "--density", "0.9", "--prune-every", "2", "--steps", "100"],
     "DynamicSparsity cannot keep the fan-in"),
])
def test_train_cli_refuses_a_schedule_that_cannot_work_before_any_work(tmp_path, monkeypatch, capsys, argv, message):
    _no_work(monkeypatch)
    out = tmp_path / "run"
    assert message in usage_error(train_main, [*_tiny(out), *argv], capsys)
    assert not out.exists()


def test_train_cli_refuses_ablation_under_torchrun_before_any_work(tmp_path, monkeypatch, capsys):
    _no_work(monkeypatch)
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    argv = [*_tiny(out), "--steps", "10", "--constant-fan-in", "--prune-every", "5", "--min-salient", "2"]
    assert "--min-salient is not available under torchrun" in usage_error(train_main, argv, capsys)
    assert not out.exists()


def _in_degrees(state: dict, prefix: str, out_features: int) -> torch.Tensor:
    """Each output's in-degree, counted from a checkpoint's saved edges (dst, by source)."""
    return torch.bincount(state[prefix + "dst"].long(), minlength=out_features)


@pytest.mark.parametrize("block", [1, 8])
def test_train_cli_constant_fan_in_trains_keeps_the_property_and_resumes(tmp_path, capsys, block):
    """--constant-fan-in with RigL updates and neuron ablation: every sparse matrix of the saved model has one
    in-degree for all its connected outputs (counted from the saved edges), the layers know it, and a resumed run
    keeps it."""
    from char_lm.loop import Trainer

    out = tmp_path / "run"
    argv = [*_tiny(out), "--steps", "6", "--constant-fan-in", "--density", "0.25", "--block", str(block),
            "--prune-every", "2", "--regrow", "rigl", "--drop-fraction", "0.5", "--min-salient", "3"]
    assert train_main(argv) == 0
    assert "constant fan-in" in capsys.readouterr().out
    for steps in (6, 8):
        _, state = Trainer.read_checkpoint(out)
        assert state["model_config"]["constant_fan_in"] and state["train_config"]["min_salient"] == 3
        model = state["model"]
        prefixes = [key[: -len("dst")] for key in model if key.endswith("dst")]
        assert len(prefixes) == 4
        for prefix in prefixes:
            extra = model[prefix + "_extra_state"].tolist()
            assert extra[0] == 3 and extra[3] == block and extra[4] == 1  # saved as constant fan-in
            fan = _in_degrees(model, prefix, extra[2])
            assert len(set(fan[fan > 0].tolist())) == 1, prefix
            groups = fan.view(-1, block)
            assert bool((groups == groups[:, :1]).all()), prefix  # a group's outputs share their vectors
        if steps == 6:
            # log.json reports each update's fan-ins; the last one's are the saved model's
            history = json.loads((out / "log.json").read_text())["fan_in_history"]
            assert history and all(len(h["layers"]) == 4 for h in history)
            assert [h["step"] for h in history] == sorted({h["step"] for h in history})
            saved = sorted(int(_in_degrees(model, p, model[p + "_extra_state"].tolist()[2]).max()) for p in prefixes)
            assert sorted(r["fan_in"] for r in history[-1]["layers"].values()) == saved
            assert train_main(["--resume", str(out), "--steps", "8", "--offline", "--no-progress"]) == 0
    capsys.readouterr()


def test_constant_fan_in_model_counts_its_weights_as_built():
    """The configuration's count (which --dense matches) is the built model's, constant fan-in rounding included."""
    from char_lm.model import CharTransformer, ModelConfig

    for block in (1, 8):
        cfg = ModelConfig(vocab_size=30, context=16, d_model=40, n_layers=1, n_heads=2, density=0.13, block=block,
                          constant_fan_in=True, distribution="erk")
        model = CharTransformer(cfg, generator=torch.Generator().manual_seed(0))
        assert cfg.n_params() == model.n_params() and cfg.block_weights() == model.block_weights()
        assert all(m.constant_fan_in for m in model.modules() if hasattr(m, "constant_fan_in"))
        dense = cfg.dense_equivalent()
        assert not dense.sparse and not dense.constant_fan_in


def test_train_cli_turns_a_schedule_refused_when_built_into_a_usage_error(tmp_path, monkeypatch, capsys):
    """Whatever the schedule itself refuses when it is built (beyond what the CLI's own check knows) is a usage
    error before training, with nothing written."""
    class Refusing:
        def __init__(self, *args, **kwargs):
            raise ValueError("the schedule cannot keep its edge count")

    monkeypatch.setattr("char_lm.loop.DynamicSparsity", Refusing)
    out = tmp_path / "run"
    line = usage_error(train_main, [*_tiny(out), "--steps", "2", "--prune-every", "1"], capsys)
    assert line.endswith("error: the schedule cannot keep its edge count")
    assert not out.exists()


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="the machine has MPS")
@pytest.mark.parametrize("main_name", ["train", "tune", "bench", "sparsify"])
def test_device_refusals_offer_only_this_machines_devices(main_name, example, capsys, tmp_path, monkeypatch):
    from torch_sparse_metal_tools import bench

    monkeypatch.setenv("TORCH_SPARSE_METAL_CACHE_DIR", str(tmp_path))
    mains = {"train": train_main, "tune": tune_main, "bench": bench.main, "sparsify": example.main}
    line = usage_error(mains[main_name], ["--device", "mps", "--out", str(tmp_path / "x")]
                       if main_name in ("train", "bench") else ["--device", "mps"], capsys)
    assert "argument --device: mps: MPS is not available on this machine; this machine has: " in line
    offered = line.split("this machine has: ")[1]
    assert "mps" not in offered and "cpu" in offered and ("cuda" in offered) == torch.cuda.is_available()


# ------------------------------------------------------------------------------------------- shared output checks
def test_output_file_check_changes_nothing(tmp_path):
    """The probe leaves an existing file as it was (content and time) and a missing one missing."""
    import argparse

    from torch_sparse_metal_tools.cli import check_output_file

    parser = argparse.ArgumentParser()
    existing = tmp_path / "earlier.json"
    existing.write_text("earlier results")
    os.utime(existing, (1_000_000, 1_000_000))
    check_output_file(parser, existing, "--out")
    assert existing.read_text() == "earlier results" and existing.stat().st_mtime == 1_000_000
    check_output_file(parser, tmp_path / "new.json", "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier.json"]


# ------------------------------------------------------------------------------------------- OpenMP's wait policy
def test_openmp_note_only_where_threads_would_spin(monkeypatch):
    from torch_sparse_metal_tools.cli import CHOSEN_BY_COMMAND, openmp_note

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv(CHOSEN_BY_COMMAND, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    note = openmp_note("cpu")
    assert note.startswith("note: OpenMP threads spin while they wait") and "OMP_WAIT_POLICY=passive" in note
    assert openmp_note("meta") is None  # not the CPU's threads
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert openmp_note("cpu") is None  # nothing to spin
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")  # the user's choice stands, unremarked
    assert openmp_note("cpu") is None
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")
    assert openmp_note("cpu") is None
    monkeypatch.setenv(CHOSEN_BY_COMMAND, "1")  # the command's own choice is said, with how to choose otherwise
    note = openmp_note("cpu")
    assert "set by this command" in note and "OMP_WAIT_POLICY=active" in note


#: A program that reports, as JSON on its last line, how its process ended up: the wait policy in its environment,
#: its arguments, and how many times it started (what libgomp read at each start, OMP_DISPLAY_ENV, is on stderr).
_RELAUNCHED = """
import json, os, sys
import torch
from torch_sparse_metal_tools.cli import wait_passively

with open(sys.argv[1], "a") as f:
    f.write("started\\n")
if __name__ == "__main__":
    wait_passively()
print(json.dumps({"policy": os.environ.get("OMP_WAIT_POLICY"), "args": sys.argv[2:], "pid": os.getpid(),
                  "starts": open(sys.argv[1]).read().count("started")}))
"""


def _run_relaunching(tmp_path, env_changes: dict[str, str | None], how: str = "script") -> tuple[dict, str]:
    """Runs :data:`_RELAUNCHED` (as a script, with -m, or inside another program through runpy) in a fresh
    interpreter; returns its JSON and its stderr."""
    (tmp_path / "relaunched.py").write_text(_RELAUNCHED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)]), "OMP_DISPLAY_ENV": "VERBOSE"}
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "OMP_NUM_THREADS"):
        env.pop(name, None)
    for name, value in env_changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    log, args = str(tmp_path / "starts.log"), ["--x", "1 2"]
    command = {"script": [str(tmp_path / "relaunched.py"), log, *args], "module": ["-m", "relaunched", log, *args],
               "runpy": ["-c", "import runpy, sys; sys.argv = [*sys.argv[1:3], '--inside']; "
                               "runpy.run_path(sys.argv[0], run_name='__main__')",
                         str(tmp_path / "relaunched.py"), log, *args]}[how]
    r = subprocess.run([sys.executable, "-X", "utf8", *command], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), r.stderr


def _libgomp_spin_counts(stderr: str) -> list[int]:
    """The spin counts libgomp reported at start-up (OMP_DISPLAY_ENV=VERBOSE), one per process start: how many
    times an idle thread spins before it sleeps (0: passive)."""
    return [int(n) for n in re.findall(r"GOMP_SPINCOUNT = '(\d+)'", stderr)]


@pytest.mark.parametrize("how", ["script", "module"])
def test_a_command_starts_again_with_sleeping_openmp_threads(tmp_path, how):
    out, err = _run_relaunching(tmp_path, {}, how)
    assert out["policy"] == "passive" and out["args"] == ["--x", "1 2"] and out["starts"] == 2
    spins = _libgomp_spin_counts(err)
    if not spins:
        pytest.skip("this torch's OpenMP runtime does not report its settings (not libgomp)")
    assert len(spins) == 2 and spins[0] > 0 and spins[1] == 0  # the first start spun; the one that runs does not


@pytest.mark.parametrize("env_changes", [{"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "1000"},
                                         {"OMP_NUM_THREADS": "1"}])
def test_a_users_choice_of_openmp_waits_stands(tmp_path, env_changes):
    out, err = _run_relaunching(tmp_path, env_changes)
    assert out["starts"] == 1 and out["policy"] == env_changes.get("OMP_WAIT_POLICY")
    spins = _libgomp_spin_counts(err)
    assert len(spins) <= 1 and all(n > 0 for n in spins)  # still spinning, as chosen (1 thread: nothing waits)


def test_a_command_run_inside_another_program_is_not_started_again(tmp_path):
    out, err = _run_relaunching(tmp_path, {}, "runpy")  # the driver's own command line would not run it again
    # it spins, and its start-up line says so
    assert out["args"] == ["--inside"] and out["starts"] == 1 and out["policy"] is None
    assert len(_libgomp_spin_counts(err)) <= 1


@pytest.mark.parametrize("policy", [None, "passive"])
def test_cpu_commands_say_how_to_stop_spinning_at_start(policy, tmp_path, monkeypatch, capsys, example):
    from torch_sparse_metal_tools import bench

    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(bench, "cases", lambda names: [bench.Case(40, 20, 0.2, 3, "tiny")])
    monkeypatch.setattr(example, "train", lambda *a, **k: None)
    runs = [lambda: train_main(["--steps", "1", *_tiny(tmp_path / "run")]),
            lambda: bench.main(["--device", "cpu", "--reps", "1", "--out", str(tmp_path / "bench")]),
            lambda: example.main(["--d-model", "16", "--context", "16", "--eval-chars", "64", "--no-progress"])]
    for run in runs:
        run()
        notes = [line for line in capsys.readouterr().err.splitlines() if "OMP_WAIT_POLICY" in line]
        assert len(notes) == (1 if policy is None else 0)
