"""The commands' shared progress (torch_sparse_metal_tools.progress): a tqdm bar on a terminal; without one, plain
lines (no carriage returns), the first at the start, the last at the end, and one per interval while nothing else
happens (a long step, a long benchmark case), never more often than the interval; the training loop uses it."""

from __future__ import annotations

import io
import time

import pytest

from torch_sparse_metal_tools.progress import heartbeat, progress_bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _wait_for(stream: io.StringIO, count: int, limit_s: float = 20.0) -> list[str]:
    """The stream's lines once it holds ``count`` of them (or after ``limit_s``: a ticker that never ticks)."""
    end = time.monotonic() + limit_s
    while len(stream.getvalue().splitlines()) < count and time.monotonic() < end:
        time.sleep(0.01)
    return stream.getvalue().splitlines()


def test_without_a_terminal_a_silent_step_still_gets_a_line():
    log = io.StringIO()
    bar = progress_bar(total=10, desc="train", unit="step", file=log, interval=0.05)
    try:
        lines = _wait_for(log, 3)  # the start line, then two ticks without any update
    finally:
        bar.close()
    assert len(lines) >= 3 and all(line.startswith("train: ") and "0/10" in line for line in lines[:3])
    assert "\r" not in log.getvalue()


def test_without_a_terminal_redraws_are_held_back_to_one_per_interval():
    log = io.StringIO()
    with progress_bar(total=100, desc="train", file=log, interval=3600) as bar:
        for i in range(100):
            bar.update(1)
            bar.set_postfix({"loss": i}, refresh=True)
    lines = log.getvalue().splitlines()
    assert len(lines) == 2 and "0/100" in lines[0] and "100/100" in lines[1] and "loss=99" in lines[1]


def test_on_a_terminal_it_is_tqdms_bar():
    screen = _Terminal()
    with progress_bar(total=3, desc="train", file=screen) as bar:
        bar.update(3)
    assert "\r" in screen.getvalue() and "3/3" in screen.getvalue()


@pytest.mark.parametrize("stream", [io.StringIO, _Terminal])
def test_disabled_shows_nothing(stream):
    out = stream()
    with progress_bar(total=3, file=out, enabled=False, interval=0.01) as bar:
        bar.update(3)
        time.sleep(0.05)
    assert out.getvalue() == ""


def test_heartbeat_speaks_only_when_a_block_runs_long():
    out = io.StringIO()
    with heartbeat("case 1024x1024", interval=3600, stream=out):
        pass
    assert out.getvalue() == ""
    with heartbeat("case 1024x1024", interval=0.02, stream=out):
        lines = _wait_for(out, 2)
    assert lines[0].startswith("case 1024x1024: still running (") and lines[0].endswith(" s)")
    count = len(out.getvalue().splitlines())
    time.sleep(0.1)
    assert len(out.getvalue().splitlines()) == count  # stopped with the block


def test_training_loop_writes_plain_progress_lines_without_a_terminal(monkeypatch):
    from char_lm import CharCorpus, ModelConfig, TrainConfig, Trainer

    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)
    corpus = CharCorpus.from_splits("abcdefgh" * 200, "abcdefgh" * 20, "abcdefgh" * 20, "inline")
    cfg = ModelConfig(vocab_size=corpus.vocab.size, context=8, d_model=16, n_layers=1, n_heads=2)
    Trainer(cfg, TrainConfig(steps=4, batch_size=2, log_every=2, eval_every=4, eval_chars=64), corpus, "cpu",
            verbose=False).fit()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and len(lines) >= 2
    assert "0/4" in lines[0] and "4/4" in lines[-1] and "train_bpc=" in lines[-1]
