"""Adversarial table for the training command: every bad argument is a usage error (exit status 2, no traceback,
no output folder), and a damaged --resume file is refused with a message that says it is not a checkpoint, the
file left as it was."""

from __future__ import annotations

import pytest
import torch
from char_lm import CharCorpus, ModelConfig, TrainConfig, Trainer
from char_lm.cli import main
from char_lm.data import fallback_text, split_text

TINY = ["--device", "cpu", "--offline", "--no-progress", "--d-model", "16", "--layers", "1", "--heads", "2",
        "--context", "16", "--batch-size", "2", "--eval-chars", "64", "--steps", "2"]

BAD_ARGUMENTS = {  # argv, what stderr must say
    "steps 0": (["--steps", "0"], "argument --steps: must be a positive integer, got 0"),
    "steps negative": (["--steps", "-3"], "argument --steps: must be a positive integer"),
    "steps a word": (["--steps", "many"], "argument --steps: expected a positive integer, got 'many'"),
    "steps float": (["--steps", "2.5"], "argument --steps: expected a positive integer"),
    "minutes negative": (["--steps", "1", "--minutes", "-1"], "--minutes"),
    "density 0": (["--density", "0"], "argument --density: must be in (0, 1]"),
    "density above 1": (["--density", "1.5"], "argument --density: must be in (0, 1]"),
    "density NaN": (["--density", "nan"], "argument --density: must be in (0, 1]"),
    "density a word": (["--density", "half"], "argument --density: expected a number in (0, 1]"),
    "d-model 0": (["--d-model", "0"], "argument --d-model: must be a positive integer"),
    "layers negative": (["--layers", "-1"], "argument --layers: must be a positive integer"),
    "heads 0": (["--heads", "0"], "argument --heads: must be a positive integer"),
    "context 0": (["--context", "0"], "argument --context: must be a positive integer"),
    "batch-size 0": (["--batch-size", "0"], "argument --batch-size: must be a positive integer"),
    "dropout 1": (["--dropout", "1"], "argument --dropout: must be in [0, 1)"),
    "dropout negative": (["--dropout", "-0.1"], "argument --dropout: must be in [0, 1)"),
    "lr negative": (["--lr", "-1"], "argument --lr: must be a positive number"),
    "lr 0": (["--lr", "0"], "argument --lr: must be a positive number"),
    "warmup a word": (["--warmup-steps", "x"], "argument --warmup-steps: expected an integer >= 0"),
    "log-every 0": (["--log-every", "0"], "argument --log-every: must be a positive integer"),
    "eval-every 0": (["--eval-every", "0"], "argument --eval-every: must be a positive integer"),
    "prune-every 0": (["--prune-every", "0"], "argument --prune-every: must be a positive integer"),
    "grow 0": (["--grow", "0"], "argument --grow: must be in (0, 1]"),
    "drop-fraction 2": (["--drop-fraction", "2"], "argument --drop-fraction: must be in (0, 1]"),
    "prune-stop NaN": (["--prune-stop", "nan"], "argument --prune-stop: must be in (0, 1]"),
    "dtype int8": (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    "backward unknown": (["--backward", "fast"], "argument --backward: invalid choice: 'fast'"),
    "regrow unknown": (["--regrow", "grad"], "argument --regrow: invalid choice: 'grad'"),
    "size unknown": (["--size", "huge"], "argument --size: invalid choice: 'huge'"),
    "device empty": (["--device", ""], "--device"),
    "device cuda:-1": (["--device", "cuda:-1"], "argument --device: not a device name: 'cuda:-1'"),
    "data missing": (["--data", "/no/such/corpus.txt"], "--data"),
    "resume missing": (["--resume", "/no/such/run"], "--resume"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_argument_is_a_usage_error_before_any_work(tmp_path, capsys, case):
    argv, message = BAD_ARGUMENTS[case]
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main([*TINY, "--out", str(out), *argv])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and message in err and "Traceback" not in err, err
    assert not out.exists()


@pytest.fixture(scope="module")
def checkpoint_bytes(tmp_path_factory) -> bytes:
    corpus = CharCorpus.from_splits(*split_text(fallback_text()), source="fallback")
    model = ModelConfig(vocab_size=corpus.vocab.size, context=16, d_model=16, n_layers=1, n_heads=2)
    path = tmp_path_factory.mktemp("ckpt") / "checkpoint.pt"
    Trainer(model, TrainConfig(steps=1, batch_size=2), corpus, "cpu", progress=False, verbose=False).save(path)
    return path.read_bytes()


def _damage(data: bytes, kind: str) -> bytes:
    n = len(data)
    return {
        "truncated to 10%": data[: n // 10], "truncated to 90%": data[: n * 9 // 10], "last byte cut": data[:-1],
        "header zeroed": bytes(64) + data[64:], "directory zeroed": data[:-200] + bytes(200),
        "directory flipped": data[:-22] + bytes(b ^ 0xFF for b in data[-22:]),
        "random bytes": bytes(torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(0)).tolist()),
        "pickle only": b"\x80\x02}q\x00.",  # an empty dict, pickled: no torch file
    }[kind]


@pytest.mark.parametrize("kind", ["truncated to 10%", "truncated to 90%", "last byte cut", "header zeroed",
                                  "directory zeroed", "directory flipped", "random bytes", "pickle only"])
def test_damaged_resume_file_is_refused(tmp_path, capsys, checkpoint_bytes, kind):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(_damage(checkpoint_bytes, kind))
    before = path.read_bytes()
    with pytest.raises(SystemExit) as exc:
        main(["--resume", str(path), "--device", "cpu", "--offline", "--no-progress"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"--resume {path} is not a training checkpoint of this program" in err, err
    assert "Traceback" not in err and "weights_only" not in err
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]
