"""Tests of the decoupled (PD-ASGD) training mode: correctness of layer-wise updates, staleness, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from char_lm import CharCorpus, ModelConfig, TrainConfig, Trainer
from char_lm.cli import main
from char_lm.data import fallback_text, split_text
from char_lm.decoupled import DecoupledConfig, DecoupledTrainer

from torch_sparse_metal import SparseLinear
from torch_sparse_metal_tools.testing import axes

QUIET = {"progress": False, "verbose": False}


@pytest.fixture(scope="module")
def corpus() -> CharCorpus:
    return CharCorpus.from_splits(*split_text(fallback_text()), source="fallback")


def tiny(corpus: CharCorpus, **kw) -> ModelConfig:
    return ModelConfig(vocab_size=corpus.vocab.size, context=32, d_model=32, n_layers=1, n_heads=2, density=0.25,
                       **kw)


def config(steps: int = 12, **kw) -> TrainConfig:
    base = dict(steps=steps, batch_size=4, log_every=4, eval_every=steps, eval_chars=256, warmup_steps=2)
    return TrainConfig(**{**base, **kw})


def decoupled(corpus, cfg: TrainConfig, backward: int, device: str = "cpu", model: ModelConfig | None = None,
              **kw) -> DecoupledTrainer:
    return DecoupledTrainer(model or tiny(corpus), cfg, corpus, device, decoupled=DecoupledConfig(1, backward, **kw),
                            **QUIET)


def test_inplace_update_of_a_parameter_saved_by_a_pending_graph_fails():
    """Why forwards read snapshots: the live parameters cannot be updated under a pending graph."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(SparseLinear(16, 16, density=0.5), torch.nn.GELU(), torch.nn.Linear(16, 4))
    x = torch.randn(8, 16)
    first, second = net(x).square().sum(), net(x).square().sum()
    first.backward()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(p.grad, alpha=-0.1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        second.backward()


@pytest.mark.parametrize("device", axes.DEVICES)
def test_one_to_one_with_one_in_flight_equals_synchronous_training(corpus, device):
    # atomic_free: fused_atomic's grad_w sums run in a thread-dependent order on a many-core CPU and on GPUs, and
    # AdamW's first steps magnify such rounding differences far beyond any useful tolerance.
    model = tiny(corpus, backward="atomic_free")
    sync = Trainer(model, config(grad_clip=0.0), corpus, device, **QUIET)
    sync_summary = sync.fit()
    pd = decoupled(corpus, config(grad_clip=0.0), 1, device, model=model, max_in_flight=1)
    summary = pd.fit()
    for (name, a), b in zip(sync.model.named_parameters(), pd.model.parameters()):
        if device == "cpu":
            assert torch.equal(a, b), name
        else:  # other streams may pick other GPU library kernels
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)
    for (_, _, a), (_, _, b) in zip(sync_summary["history"]["train"], summary["history"]["train"]):
        assert a == pytest.approx(b, rel=1e-5)
    assert summary["staleness_mean"] == 0 and summary["staleness_max"] == 0
    assert [row[2:] for row in summary["history"]["staleness"]] == [[0.0, 0]] * len(summary["history"]["staleness"])
    assert len(summary["history"]["staleness"]) >= 3


def test_one_to_one_reduces_the_loss(corpus):
    summary = decoupled(corpus, config(steps=40, log_every=10, lr=3e-3), 1).fit()
    train = [bpc for _, _, bpc in summary["history"]["train"]]
    assert train[-1] < train[0] - 0.5
    assert summary["decoupled"]["in_flight"] == 2 and summary["staleness_max"] <= 1


@pytest.mark.parametrize("device", axes.DEVICES)
@pytest.mark.parametrize("in_flight", [None, 5])
def test_two_backward_workers_lose_no_update(corpus, device, in_flight):
    trainer = decoupled(corpus, config(steps=16), 2, device, max_in_flight=in_flight)
    summary = trainer.fit()
    n = len(trainer.params)
    assert summary["decoupled"]["items"] == 16 and summary["decoupled"]["updates"] == 16 * n
    assert sum(summary["decoupled"]["staleness_histogram"].values()) == 16 * n
    assert all(slot.version == 16 for slot in trainer._slots)
    assert all(int(state["step"]) == 16 for state in trainer.optimizer.state.values())
    assert sum(w["items"] for w in summary["decoupled"]["workers"]) == 16


def test_straggler_makes_staleness_and_it_stays_below_the_in_flight_bound(corpus):
    summary = decoupled(corpus, config(steps=8), 1, max_in_flight=3, straggler_ms=40.0).fit()
    # One worker applies items in order, so an update is at most in_flight - 1 versions behind.
    assert 1 <= summary["staleness_max"] <= 2
    assert summary["decoupled"]["straggler_ms"] == 40.0
    assert all(row[3] <= 2 for row in summary["history"]["staleness"])


@pytest.mark.parametrize("device", axes.DEVICES)
def test_bfloat16_runs_decoupled(corpus, device):
    summary = decoupled(corpus, config(steps=4, dtype="bfloat16"), 2, device).fit()
    assert summary["dtype"] == "bfloat16" and summary["decoupled"]["items"] == 4


def test_a_failing_backward_worker_stops_the_run_with_its_error(corpus, monkeypatch):
    def broken(self, i, leaf, item):
        raise ValueError("boom")

    monkeypatch.setattr(DecoupledTrainer, "_update", broken)
    with pytest.raises(RuntimeError, match="a backward worker failed: ValueError: boom"):
        decoupled(corpus, config(steps=50), 2).fit()


@pytest.mark.parametrize(("kw", "message"), [
    ({"dtype": "float16"}, "float16 needs a loss scaler"),
    ({"prune_every": 5}, "evolving topology"),
])
def test_refused_configurations(corpus, kw, message):
    with pytest.raises(ValueError, match=message):
        decoupled(corpus, config(**kw), 2)


def test_refused_under_torch_distributed(corpus, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="runs on one device"):
        decoupled(corpus, config(), 2)


@pytest.mark.parametrize("text", ["2:2", "1:0", "1", "1:2:3", "a:b", "1:-1"])
def test_ratio_is_validated(text):
    with pytest.raises(ValueError):
        DecoupledConfig.parse(text)


COMMON = ["--device", "cpu", "--offline", "--d-model", "32", "--layers", "1", "--heads", "2", "--context", "32",
          "--batch-size", "4", "--eval-chars", "512", "--log-every", "2", "--no-progress"]


def test_cli_decoupled_run_logs_staleness_and_rate(tmp_path, capsys):
    assert main(["--steps", "6", *COMMON, "--out", str(tmp_path), "--decoupled", "--straggler-ms", "1"]) == 0
    out = capsys.readouterr().out
    assert "2 backward workers, at most 3 items in flight" in out and "| Staleness, max (PD-ASGD) |" in out
    log = json.loads((tmp_path / "log.json").read_text())
    assert log["steps"] == 6 and log["steps_per_s"] > 0 and log["name"].endswith("-pdasgd1:2")
    assert log["decoupled"]["backward"] == 2 and log["decoupled"]["updates"] == 6 * log["decoupled"]["parameters"]
    assert log["history"]["staleness"] and log["history"]["train"] and log["history"]["val"]
    # its checkpoint is an ordinary one: a synchronous run resumes from it
    assert main(["--resume", str(tmp_path), "--steps", "8", *COMMON]) == 0
    assert json.loads((tmp_path / "log.json").read_text())["steps"] == 8
