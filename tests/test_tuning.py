"""backward="auto" tuned on the machine: timed once per size bucket on real tensors, cached on disk, reused;
off with TORCH_SPARSE_METAL_TUNE=0; never while tracing or under create_graph."""

from __future__ import annotations

import json

import pytest
import torch

from torch_sparse_metal import SparseLinear, tuning
from torch_sparse_metal.strategy import resolve_strategy, static_strategy
from torch_sparse_metal.tune import main as tune_main


@pytest.fixture
def tuned(monkeypatch, tmp_path):
    """Tuning on, with a fresh cache in tmp_path; timings replaced by a fixed table (atomic_free faster), and
    every timed candidate counted."""
    monkeypatch.setenv("TORCH_SPARSE_METAL_TUNE", "1")
    monkeypatch.setenv("TORCH_SPARSE_METAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_memory", None)
    timed: list[str] = []

    def fake_time(run, device):
        result = run()  # the candidate really runs: it must work on these tensors
        assert isinstance(result, tuple) and len(result) == 2
        strategy = "atomic_free" if len(timed) % 2 else "fused_atomic"  # candidates come in CONCRETE order
        timed.append(strategy)
        return {"fused_atomic": 2.0, "atomic_free": 1.0}[strategy]

    monkeypatch.setattr(tuning, "_time_ms", fake_time)
    return timed


def _backward(layer: SparseLinear, batch: int = 16) -> None:
    x = torch.randn(batch, layer.in_features, requires_grad=True)
    layer(x).square().sum().backward()


def test_first_backward_tunes_then_the_cache_decides(tuned, tmp_path):
    layer = SparseLinear(100, 60, density=0.2)
    _backward(layer)
    assert tuned == ["fused_atomic", "atomic_free"]
    cache = json.loads((tmp_path / "tuning.json").read_text())
    (machine,) = cache.values()
    (decision,) = machine.values()
    assert decision == {"strategy": "atomic_free", "ms": {"fused_atomic": 2.0, "atomic_free": 1.0}}
    _backward(layer)
    _backward(SparseLinear(110, 64, density=0.19), batch=15)  # the same bucket: no new timing
    assert len(tuned) == 2
    assert resolve_strategy("auto", torch.device("cpu"), 100, 60, layer.nnz, 16) == "atomic_free"
    assert resolve_strategy("fused_atomic", torch.device("cpu"), 100, 60, layer.nnz, 16) == "fused_atomic"


def test_decisions_survive_the_process(tuned, monkeypatch):
    _backward(SparseLinear(50, 40, density=0.3))
    monkeypatch.setattr(tuning, "_memory", None)  # a new process reads the file
    assert tuning.choose(torch.device("cpu"), tuning.bucket_key(torch.float32, 50, 40, 600, 16),
                         ("fused_atomic", "atomic_free")) == "atomic_free"


def test_tuning_off_follows_the_static_rule(tuned, monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_SPARSE_METAL_TUNE", "0")
    _backward(SparseLinear(100, 60, density=0.2))
    assert tuned == [] and not (tmp_path / "tuning.json").exists()
    assert resolve_strategy("auto", torch.device("cpu"), 100, 60, 1200, 16) == static_strategy(
        torch.device("cpu"), 100, 60, 1200, 16)


def test_no_tuning_in_a_create_graph_backward_or_under_compile(tuned):
    layer = SparseLinear(30, 20, density=0.3)
    x = torch.randn(4, 30, requires_grad=True)
    torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
    torch.compile(layer, fullgraph=True, backend="aot_eager")(torch.randn(4, 30)).sum().backward()
    assert tuned == []


def test_unwritable_cache_warns_and_tunes_in_memory(tuned, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TORCH_SPARSE_METAL_CACHE_DIR", str(blocker / "sub"))  # a folder inside a file
    with pytest.warns(UserWarning, match="cannot write the tuning cache"):
        _backward(SparseLinear(100, 60, density=0.2))
    assert resolve_strategy("auto", torch.device("cpu"), 100, 60, 1200, 16) == "atomic_free"


def test_real_timing_picks_one_of_the_strategies(monkeypatch, tmp_path, capsys):
    """Without the fake timer: the CLI tunes a layer on this CPU and prints the decision and the cache."""
    monkeypatch.setenv("TORCH_SPARSE_METAL_TUNE", "1")
    monkeypatch.setenv("TORCH_SPARSE_METAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_memory", None)
    assert tune_main(["--device", "cpu", "--layer", "128,96,0.1", "--batch", "32"]) == 0
    out = capsys.readouterr().out
    assert "128x96, density 0.1, batch 32 on cpu: " in out
    cache = json.loads((tmp_path / "tuning.json").read_text())
    (decision,) = next(iter(cache.values())).values()
    assert decision["strategy"] in ("fused_atomic", "atomic_free") and set(decision["ms"]) == {"fused_atomic",
                                                                                                "atomic_free"}
    assert tune_main(["--clear"]) == 0 and not (tmp_path / "tuning.json").exists()
