"""``auto`` tuned on the machine where a backend declares something to tune, once tuning is on (opt-in: off by
default, ``TORCH_SPARSE_METAL_TUNE=1`` at import or ``tuning.enable()``): timed once per size bucket on real tensors,
cached on disk, reused; never while tracing or under create_graph. With tuning off an op loads neither the tuner
nor the timer and touches no file.
As shipped, no backend tunes the strategies and the CPU and CUDA tune nothing (docs/strategies.md): the tests of
the strategy tuner declare the CPU a backend that tunes them. The Metal backend's kernel variant (values_per_lane
P) is tuned through the MSL-on-CPU executor, the dispatched kernels showing which P ran."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from torch_sparse_metal import CSRTopology, SparseLinear, _autotune, devices, timing, tuning
from torch_sparse_metal.backends.mps import VALUES_PER_LANE, MetalCsrLinear, values_per_lane
from torch_sparse_metal.strategy import CONCRETE, STATIC, Strategy, resolve_strategy, static_strategy, tuned_strategies
from torch_sparse_metal_tools import selfcheck
from torch_sparse_metal_tools.testing.reference import reference_outputs
from torch_sparse_metal_tools.tune import main as tune_main
from tsm_dev.msl import compile_shader

STRATEGIES = tuple(s.value for s in CONCRETE)
CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]


def new_process(monkeypatch) -> None:
    """What a new process knows: nothing until it reads the cache file."""
    monkeypatch.setattr(tuning, "_memory", None)
    monkeypatch.setattr(tuning, "_session", {})


def one_round(monkeypatch) -> None:
    """One timed round: each candidate timed once, in candidate order (tests of the rounds are below)."""
    monkeypatch.setattr(tuning, "REPS", 1)


def strategies_tuned_on_the_cpu(monkeypatch) -> None:
    """The CPU declared a backend whose strategies measurably differ (none is, as shipped)."""
    monkeypatch.setitem(devices.BACKENDS, "cpu", dataclasses.replace(devices.get("cpu"), tunes_strategy=True))


def fake_rounds(monkeypatch, time_of: Callable[[str, Callable[[], object]], float]) -> None:
    """The timer's rounds with fake times: each candidate still runs in the timer's order (``time_of(label,
    call)`` calls it) and takes the time ``time_of`` returns (the untimed warm-up calls run as they do)."""
    monkeypatch.setattr(timing.Timer, "_round", lambda self, fns: {k: (time_of(k, fn), 0.0) for k, fn in fns.items()})


@pytest.fixture
def tuned(monkeypatch, tmp_path):
    """Tuning on, the CPU declared to tune the strategies, with a fresh cache in tmp_path; timings replaced by a
    fixed table (atomic_free faster), and every timed candidate counted."""
    monkeypatch.setattr(_autotune, "enabled", True)
    monkeypatch.setenv("TORCH_SPARSE_METAL_CACHE_DIR", str(tmp_path))
    new_process(monkeypatch)
    one_round(monkeypatch)
    strategies_tuned_on_the_cpu(monkeypatch)
    timed: list[str] = []

    def time_of(strategy, call):
        result = call()  # the candidate really runs: it must work on these tensors
        assert isinstance(result, tuple) and len(result) == 2
        timed.append(strategy)
        return {"fused_atomic": 2.0, "atomic_free": 1.0}[strategy]

    fake_rounds(monkeypatch, time_of)
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
    assert decision == {"strategy": "atomic_free", "ms": {"fused_atomic": 2.0, "atomic_free": 1.0},
                        "spread_ms": {"fused_atomic": 0.0, "atomic_free": 0.0}}
    _backward(layer)
    _backward(SparseLinear(110, 64, density=0.19), batch=15)  # the same bucket: no new timing
    assert len(tuned) == 2
    assert resolve_strategy("auto", torch.device("cpu"), 100, 60, layer.nnz, 16) == "atomic_free"
    assert resolve_strategy("fused_atomic", torch.device("cpu"), 100, 60, layer.nnz, 16) == "fused_atomic"


def test_decisions_survive_the_process(tuned, monkeypatch):
    _backward(SparseLinear(50, 40, density=0.3))
    new_process(monkeypatch)  # a new process reads the file
    assert tuning.choose(CPU, tuning.bucket_key(torch.float32, 50, 40, 600, 16),
                         tuning.candidates("cpu", STRATEGIES)) == {"strategy": "atomic_free"}


def test_tuning_off_follows_the_static_rule(tuned, monkeypatch, tmp_path):
    monkeypatch.setattr(_autotune, "enabled", False)
    _backward(SparseLinear(100, 60, density=0.2))
    assert tuned == [] and not (tmp_path / "tuning.json").exists()
    assert resolve_strategy("auto", torch.device("cpu"), 100, 60, 1200, 16) == STATIC


def test_no_tuning_in_a_create_graph_backward_or_under_compile(tuned):
    layer = SparseLinear(30, 20, density=0.3)
    x = torch.randn(4, 30, requires_grad=True)
    torch.autograd.grad(layer(x).square().sum(), x, create_graph=True)
    torch.compile(layer, fullgraph=True, backend="aot_eager")(torch.randn(4, 30)).sum().backward()
    assert tuned == []


def test_dynamic_shape_tracing_with_tuning_on_follows_the_static_rule(tuned):
    # Sizes are SymInts while torch.compile traces dynamic shapes: no bucket can be formed (nor hashed).
    layer = SparseLinear(30, 20, density=0.3)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager", dynamic=True)
    for batch in (4, 7):
        x = torch.randn(batch, 30, requires_grad=True)
        compiled(x).square().sum().backward()
        assert torch.allclose(x.grad, torch.autograd.grad(layer(x).square().sum(), x)[0], atol=1e-5)
    topo = layer.topology
    args = (torch.randn(5, 30, requires_grad=True), layer.weight.detach().clone().requires_grad_(True),
            *topo.kernel_args(), "auto")
    torch.library.opcheck(torch.ops.torch_sparse_metal.csr_linear.default, args)


def test_unwritable_cache_warns_and_tunes_in_memory(tuned, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TORCH_SPARSE_METAL_CACHE_DIR", str(blocker / "sub"))  # a folder inside a file
    with pytest.warns(UserWarning, match="cannot write the tuning cache"):
        _backward(SparseLinear(100, 60, density=0.2))
    assert resolve_strategy("auto", torch.device("cpu"), 100, 60, 1200, 16) == "atomic_free"


# ------------------------------------------------------------------- where the cache lives, what it survives
def _cache_env(monkeypatch, tmp_path, cache_dir=None, xdg=None) -> tuple[Path, Path]:
    """A working directory and a home folder in tmp_path, the two cache variables set as given (None: unset);
    returns (working directory, home)."""
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    home.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    for name, value in (("TORCH_SPARSE_METAL_CACHE_DIR", cache_dir), ("XDG_CACHE_HOME", xdg)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    return cwd, home


@pytest.mark.parametrize(("cache_dir", "xdg"), [("", None), ("  ", ""), (None, ""), (None, "relative/cache"),
                                                ("", "."), (None, None)])
def test_empty_or_relative_variables_never_put_the_cache_in_the_working_directory(tuned, monkeypatch, tmp_path,
                                                                                  cache_dir, xdg):
    cwd, home = _cache_env(monkeypatch, tmp_path, cache_dir, xdg)
    assert tuning.cache_path() == home / ".cache" / "torch_sparse_metal" / "tuning.json"
    _backward(SparseLinear(40, 30, density=0.3))
    assert list(cwd.rglob("*")) == [] and tuning.cache_path().exists()


def test_an_absolute_xdg_cache_home_and_the_cache_dir_are_used(tuned, monkeypatch, tmp_path):
    _cache_env(monkeypatch, tmp_path, None, str(tmp_path / "xdg"))
    assert tuning.cache_path() == tmp_path / "xdg" / "torch_sparse_metal" / "tuning.json"
    monkeypatch.setenv("TORCH_SPARSE_METAL_CACHE_DIR", str(tmp_path / "mine"))
    assert tuning.cache_path() == tmp_path / "mine" / "tuning.json"


def test_no_home_folder_tunes_in_memory(tuned, monkeypatch, tmp_path):
    cwd, _ = _cache_env(monkeypatch, tmp_path)
    monkeypatch.setenv("HOME", "relative/home")
    with pytest.raises(RuntimeError, match="set TORCH_SPARSE_METAL_CACHE_DIR"):
        tuning.cache_path()
    with pytest.warns(UserWarning, match="cannot write the tuning cache"):
        _backward(SparseLinear(40, 30, density=0.3))
    assert list(cwd.rglob("*")) == [] and tuned == ["fused_atomic", "atomic_free"]
    _backward(SparseLinear(40, 30, density=0.3))  # decided in this process
    assert len(tuned) == 2


_BUCKET = tuning.bucket_key(torch.float32, 40, 30, 360, 16)


def _malformed() -> list[tuple[str, object]]:
    """Cache files the tuner must survive, as (name, JSON text or bytes); ``MACHINE`` stands for this machine."""
    entries = {"null": None, "list": [1, 2], "number": 3, "string": "fused_atomic", "true": True,
               "no strategy": {"ms": {}}, "strategy a number": {"strategy": 5},
               "strategy a list": {"strategy": ["atomic_free"]}, "strategy a dict": {"strategy": {"a": 1}},
               "unknown strategy": {"strategy": "fastest"}, "provisional string": {"strategy": "atomic_free",
                                                                                   "provisional": "no"}}
    files = [(f"bucket {k}", json.dumps({"MACHINE": {_BUCKET: v}})) for k, v in entries.items()]
    files += [(f"machine {k}", json.dumps({"MACHINE": v})) for k, v in
              {"null": None, "list": [], "number": 1.5, "string": "x"}.items()]
    files += [("top-level list", "[1]"), ("top-level null", "null"), ("not json", "{not json"), ("empty", ""),
              ("deep nesting", "[" * 100_000 + "]" * 100_000), ("not utf-8", b"\xff\xfe{"),
              ("nan entry", '{"MACHINE": {"' + _BUCKET + '": NaN}}')]
    return files


@pytest.mark.parametrize(("name", "content"), _malformed(), ids=[n for n, _ in _malformed()])
def test_malformed_cache_content_is_no_decision(tuned, tmp_path, name, content):
    """Whatever the file holds for this machine, ``auto`` backward works: a malformed entry counts as no
    decision (tuned again and replaced by a valid one); the file's other machines are kept where it is valid."""
    path = tmp_path / "tuning.json"
    machine = tuning.device_key(CPU)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        content = content.replace('"MACHINE"', json.dumps(machine))
        if content.startswith("{"):
            content = content[:-1] + ', "another machine": {"b": {"strategy": "fused_atomic"}}}'
        path.write_text(content)
    layer = SparseLinear(40, 30, density=0.3)
    assert layer.nnz == 360
    _backward(layer)
    assert tuned == ["fused_atomic", "atomic_free"], name
    cache = json.loads(path.read_text())
    assert cache[machine][_BUCKET]["strategy"] == "atomic_free"
    if isinstance(content, str) and content.startswith("{") and "not json" not in name:
        assert cache["another machine"] == {"b": {"strategy": "fused_atomic"}}
    assert tuning.variant(CPU, _BUCKET, "values_per_lane") is None


def test_a_cache_path_that_is_a_directory_leaves_no_temporary_files(tuned, monkeypatch, tmp_path):
    (tmp_path / "tuning.json").mkdir()
    for _ in range(3):
        new_process(monkeypatch)
        with pytest.warns(UserWarning, match="cannot write the tuning cache"):
            _backward(SparseLinear(40, 30, density=0.3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tuning.json", "tuning.json.lock"]
    assert len(tuned) == 3 * 2


def test_a_failed_write_removes_its_temporary_file(tuned, monkeypatch, tmp_path):
    def refuse(src, dst):
        raise PermissionError("refused")

    monkeypatch.setattr(tuning.os, "replace", refuse)
    with pytest.warns(UserWarning, match="refused"):
        _backward(SparseLinear(40, 30, density=0.3))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tuning.json.lock"]


_TUNER = """
import json, sys, time
from pathlib import Path
import torch
from torch_sparse_metal import timing, tuning
cpu, ready, name = torch.device("cpu"), Path(sys.argv[1]), sys.argv[2]
tuning.decisions()  # each process holds the empty cache before either writes
(ready / name).touch()
while len(list(ready.iterdir())) < 2:
    time.sleep(0.01)
timing.Timer._round = lambda self, fns: {k: ({"fused_atomic": 2.0, "atomic_free": 1.0}[k], 0.0) for k in fns}
candidates = tuning.candidates("cpu", ("fused_atomic", "atomic_free"))
for i in range(int(sys.argv[3])):
    tuning.choose(cpu, f"{name}/{i}", candidates, lambda config: None)
print(tuning.device_key(cpu))
"""


def test_processes_tuning_at_once_keep_each_others_decisions(monkeypatch, tmp_path):
    """Two processes read the empty cache, then each tunes its own buckets: the file ends with all of them."""
    monkeypatch.setenv("TORCH_SPARSE_METAL_TUNE", "1")  # read by the processes' imports
    monkeypatch.setenv("TORCH_SPARSE_METAL_CACHE_DIR", str(tmp_path / "cache"))
    ready = tmp_path / "ready"
    ready.mkdir()
    n = 20
    procs = [subprocess.Popen([sys.executable, "-c", _TUNER, str(ready), name, str(n)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for name in ("a", "b")]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outs]
    machine = outs[0][0].strip()
    decisions = json.loads((tmp_path / "cache" / "tuning.json").read_text())[machine]
    assert sorted(decisions) == sorted(f"{name}/{i}" for name in "ab" for i in range(n))
    assert {d["strategy"] for d in decisions.values()} == {"atomic_free"}
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["tuning.json", "tuning.json.lock"]


# ------------------------------------------------------------------- rounds, noise and provisional decisions
@pytest.fixture
def rounds(monkeypatch, tmp_path) -> list[tuple[str, str]]:
    """Tuning on with a fresh cache and the real number of rounds; returns ``(phase, strategy)`` per call of a
    candidate, phase "warm-up" or "timed"."""
    monkeypatch.setattr(_autotune, "enabled", True)
    monkeypatch.setenv("TORCH_SPARSE_METAL_CACHE_DIR", str(tmp_path))
    new_process(monkeypatch)
    return []


def _choose(calls: list[tuple[str, str]], monkeypatch, samples: dict[str, list[float]], bucket: str = "b"):
    """``tuning.choose`` for the two strategies, each timed sample taken from ``samples`` in turn."""
    left = {k: list(v) for k, v in samples.items()}

    def time_of(strategy, call):
        call()
        calls[-1] = ("timed", strategy)
        return left[strategy].pop(0)

    fake_rounds(monkeypatch, time_of)
    return tuning.choose(CPU, bucket, tuning.candidates("cpu", STRATEGIES),
                         lambda c: calls.append(("warm-up", c["strategy"])))


def test_candidates_are_timed_in_interleaved_rounds(rounds, monkeypatch):
    assert tuning.REPS == 3
    _choose(rounds, monkeypatch, {"fused_atomic": [2.0] * 3, "atomic_free": [1.0] * 3})
    assert rounds == [("warm-up", "fused_atomic"), ("warm-up", "atomic_free"),
                      ("timed", "fused_atomic"), ("timed", "atomic_free"),
                      ("timed", "atomic_free"), ("timed", "fused_atomic"),
                      ("timed", "fused_atomic"), ("timed", "atomic_free")]


def test_a_lead_within_the_noise_is_provisional_and_timed_again_by_the_next_process(rounds, monkeypatch, tmp_path):
    """A load spike in one round: fused_atomic's median wins, by less than the spread of its samples. This
    process keeps it; the file marks it provisional; the next process times again and, with a clear lead,
    replaces it with a decision that lasts."""
    loaded = {"fused_atomic": [1.0, 3.0, 1.2], "atomic_free": [2.0, 1.1, 2.1]}
    assert _choose(rounds, monkeypatch, loaded) == {"strategy": "fused_atomic"}
    entry = json.loads((tmp_path / "tuning.json").read_text())[tuning.device_key(CPU)]["b"]
    assert entry["provisional"] is True and entry["spread_ms"] == {"fused_atomic": 2.0, "atomic_free": 1.0}
    assert tuning.cached(CPU, "b", tuning.candidates("cpu", STRATEGIES)) == {"strategy": "fused_atomic"}
    new_process(monkeypatch)
    assert tuning.cached(CPU, "b", tuning.candidates("cpu", STRATEGIES)) is None
    clear = {"fused_atomic": [2.0, 2.1, 2.05], "atomic_free": [1.0, 1.1, 1.05]}
    assert _choose(rounds, monkeypatch, clear) == {"strategy": "atomic_free"}
    entry = json.loads((tmp_path / "tuning.json").read_text())[tuning.device_key(CPU)]["b"]
    assert "provisional" not in entry and entry["ms"] == {"fused_atomic": 2.05, "atomic_free": 1.05}
    new_process(monkeypatch)
    assert tuning.cached(CPU, "b", tuning.candidates("cpu", STRATEGIES)) == {"strategy": "atomic_free"}


def test_a_provisional_decision_does_not_replace_a_lasting_one(rounds, monkeypatch, tmp_path):
    """Another process wrote a lasting decision while this one was timing: a provisional one leaves it."""
    tuning.decisions()
    lasting = {"strategy": "atomic_free", "ms": {"fused_atomic": 2.0, "atomic_free": 1.0}}
    (tmp_path / "tuning.json").write_text(json.dumps({tuning.device_key(CPU): {"b": lasting}}))
    tied = {"fused_atomic": [1.0, 1.2, 1.1], "atomic_free": [1.15, 1.05, 1.2]}
    assert _choose(rounds, monkeypatch, tied) == {"strategy": "fused_atomic"}  # this process's own timing
    assert json.loads((tmp_path / "tuning.json").read_text())[tuning.device_key(CPU)]["b"] == lasting


def test_real_timing_picks_one_of_the_strategies(monkeypatch, tmp_path, capsys):
    """Without the fake timer: on a backend that tunes the strategies, the CLI tunes a layer on this CPU and
    prints the decision and the cache."""
    monkeypatch.setattr(_autotune, "enabled", True)
    monkeypatch.setenv("TORCH_SPARSE_METAL_CACHE_DIR", str(tmp_path))
    new_process(monkeypatch)
    one_round(monkeypatch)
    strategies_tuned_on_the_cpu(monkeypatch)
    assert tune_main(["--device", "cpu", "--layer", "128,96,0.1", "--batch", "32"]) == 0
    out = capsys.readouterr().out
    assert "128x96, density 0.1, batch 32 on cpu: " in out
    cache = json.loads((tmp_path / "tuning.json").read_text())
    (decision,) = next(iter(cache.values())).values()
    assert decision["strategy"] in ("fused_atomic", "atomic_free") and set(decision["ms"]) == {"fused_atomic",
                                                                                                "atomic_free"}
    assert tune_main(["--clear"]) == 0 and not (tmp_path / "tuning.json").exists()


# ------------------------------------------------------------------- off by default: the op path without the tuner
_OFF = """
import json, sys
import torch
import torch_sparse_metal
from torch_sparse_metal import SparseLinear
from torch_sparse_metal_tools.testing.reference import reference_outputs

loaded = lambda: sorted(m for m in sys.modules if m.startswith("torch_sparse_metal"))
after_import = loaded()
layer = SparseLinear(70, 50, density=0.2, bias=False)  # backward="auto"
x, go = torch.randn(40, 70), torch.randn(40, 50)
opened = []


def step():
    xr = x.clone().requires_grad_()
    layer.weight.grad = None
    y = layer(xr)
    y.backward(go)
    return y, xr.grad, layer.weight.grad


def audited(warm_up):
    warm_up()  # the compiling that is not the op's (the executor's shaders)
    start = len(opened)
    got = step()  # the first call of the layer: a tuner would read its cache and time here
    ref = reference_outputs(go, x, layer.weight.detach(), layer.topology)
    err = max((a.double() - b).abs().max().item() for a, b in zip(got, ref))
    return {"opened": opened[start:], "max_err": err}


w = torch.ones(3, requires_grad=True)
(w * 2).backward(torch.ones(3))  # torch's own lazy imports at a first backward with a given gradient
if "torch.onnx" in sys.modules:  # torch's own lazy import of its exporters' flags, at the layer's first forward
    torch.onnx.is_in_onnx_export()
sys.addaudithook(lambda event, args: opened.append(str(args[0])) if event in ("open", "os.listdir") else None)
result = {"cpu": audited(lambda: None)}
if sys.argv[1] == "metal":  # the csr_linear ops' CPU kernels replaced by the Metal host over the MSL-on-CPU executor
    from tsm_dev.msl import compile_shader
    from torch_sparse_metal.backends.mps import MetalCsrLinear
    host = MetalCsrLinear(compile_shader, device_type="cpu", poison=True)
    lib = torch.library.Library("torch_sparse_metal", "IMPL")
    lib.impl("csr_linear", lambda x, w, *index_and_backward: host.forward(x, w, *index_and_backward[:6]), "CPU")
    lib.impl("csr_linear_backward", lambda *args: host.backward(*args), "CPU")
    calls = []
    forward = host.forward
    host.forward = lambda *a: calls.append("forward") or forward(*a)
    layer = SparseLinear(60, 40, density=0.2, bias=False)  # another size: no decision this process made before
    x, go = torch.randn(40, 60), torch.randn(40, 40)
    result["metal"] = audited(lambda: host.library) | {"host_calls": len(calls)}
result["after_import"] = after_import
print(json.dumps(result))
"""


@pytest.mark.parametrize("backend", ["cpu", "metal"])
def test_tuning_off_by_default_touches_no_file(tmp_path, backend):
    """A fresh process, TORCH_SPARSE_METAL_TUNE unset and the cache folder empty: ``auto`` forward and backward (on
    the CPU kernels, then on the Metal host through the executor) match float64, open no file and leave the folder
    empty."""
    cache = tmp_path / "cache"
    cache.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TORCH_SPARSE_METAL_TUNE"}
    env |= {"TORCH_SPARSE_METAL_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _OFF, backend], capture_output=True, text=True, timeout=600,
                         env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert "torch_sparse_metal.ops" in result["after_import"]
    for name in ("cpu", "metal") if backend == "metal" else ("cpu",):
        assert result[name]["opened"] == [] and result[name]["max_err"] < 1e-4, (name, result[name])
    if backend == "metal":
        assert result["metal"]["host_calls"] > 0  # the op really ran on the Metal host
    assert list(cache.iterdir()) == []


def test_enable_turns_the_tuner_on_and_off_for_the_ops(tuned):
    tuning.enable(False)
    assert not tuning.enabled()
    _backward(SparseLinear(100, 60, density=0.2))
    assert tuned == []
    tuning.enable()
    assert tuning.enabled()
    _backward(SparseLinear(100, 60, density=0.2))
    assert tuned == ["fused_atomic", "atomic_free"]


def test_the_tuner_and_timer_are_attributes_of_the_package():
    code = ("import torch_sparse_metal as t; t.tuning.enable(); "
            "print(t.tuning.enabled(), t._autotune.enabled, t.timing.Timer.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "Timer"]


# ------------------------------------------------------------------- as shipped: what each backend tunes
def test_no_backend_tunes_the_strategies_and_mps_tunes_its_variant():
    """The decision of docs/strategies.md: fused_atomic wins beyond the noise wherever measured, so ``auto``
    chooses no strategy anywhere; MPS's values_per_lane (never timed on Apple hardware) is what tuning times."""
    assert all(not b.tunes_strategy for b in devices.BACKENDS.values())
    assert {t: tuned_strategies(t) for t in devices.BACKENDS} == {t: ("fused_atomic",) for t in devices.BACKENDS}
    for device_type in ("cpu", "cuda"):
        assert tuning.candidates(device_type, tuned_strategies(device_type)) == ({"strategy": "fused_atomic"},)
    assert [tuning.label(c) for c in tuning.candidates("mps", tuned_strategies("mps"))] == [
        "fused_atomic values_per_lane=1", "fused_atomic values_per_lane=4"]


def test_where_nothing_differs_auto_times_reads_and_writes_nothing(monkeypatch, tmp_path, capsys):
    """On the CPU as shipped: tuning on, a cache that says atomic_free for the bucket; auto runs the static rule,
    times nothing and leaves the file as it was; the CLI says there is nothing to tune."""
    monkeypatch.setattr(_autotune, "enabled", True)
    monkeypatch.setenv("TORCH_SPARSE_METAL_CACHE_DIR", str(tmp_path))
    new_process(monkeypatch)
    fake_rounds(monkeypatch, lambda label, call: pytest.fail(f"timed {label}"))
    layer = SparseLinear(40, 30, density=0.3)
    cache = {tuning.device_key(CPU): {_BUCKET: {"strategy": "atomic_free", "ms": {}}}}
    (tmp_path / "tuning.json").write_text(json.dumps(cache))
    _backward(layer)
    assert resolve_strategy("auto", CPU, 40, 30, layer.nnz, 16) == STATIC == Strategy.FUSED_ATOMIC
    assert json.loads((tmp_path / "tuning.json").read_text()) == cache
    assert tune_main(["--device", "cpu", "--layer", "64,48,0.1"]) == 0
    out = capsys.readouterr().out
    assert "nothing to tune on cpu: auto runs fused_atomic" in out and "backward fused_atomic (the static rule)" in out
    assert json.loads((tmp_path / "tuning.json").read_text()) == cache


def test_static_strategy_takes_no_arguments():
    assert static_strategy() is Strategy.FUSED_ATOMIC
    with pytest.raises(TypeError):
        static_strategy(CPU, 10, 10, 5, 2)


# ------------------------------------------------------------------- kernel variants (Metal, through the executor)
class _LoggedLibrary:
    """A compiled library whose kernel calls are logged by name (the pipeline attributes pass through)."""

    def __init__(self, library: Any, log: list[str]):
        self._library, self._log = library, log

    def __getattr__(self, name: str) -> Any:
        fn, log = getattr(self._library, name), self._log

        class Kernel:
            max_threads_per_threadgroup = fn.max_threads_per_threadgroup
            thread_execution_width = fn.thread_execution_width
            static_thread_group_memory_length = fn.static_thread_group_memory_length

            def __call__(self, *args: Any, **kwargs: Any) -> Any:
                log.append(name)
                return fn(*args, **kwargs)

        return Kernel()


LOG: list[str] = []


@pytest.fixture(scope="module")
def metal() -> MetalCsrLinear:
    """The Metal host code over the executor, P not fixed: each call takes the tuner's P or the static rule's."""
    return MetalCsrLinear(lambda src: _LoggedLibrary(compile_shader(src), LOG), device_type="cpu", poison=True)


def _ps(names: list[str]) -> set[int]:
    """The P of the tiled kernels among dispatched kernel names (``spmm_float_p4`` -> 4)."""
    return {int(m.group(1)) for n in names if (m := re.search(r"_p(\d+)$", n))}


def _cost(names: list[str]) -> float:
    """A fake time from what was dispatched: P = 1 beats P = 4 (the opposite of the static rule at batch 40), and
    atomic_free beats fused_atomic."""
    return (1.0 if _ps(names) == {1} else 2.0) + (0.5 if any(n.startswith("spmm_sddmm_atomic") for n in names) else 0)


@pytest.fixture
def variants(monkeypatch, tmp_path) -> list[list[str]]:
    """Tuning on with a fresh cache; the CPU device declares the Metal variants and, as MPS, no strategy tuning (the
    executor runs Metal kernels on CPU tensors); each candidate's time comes from the kernels it dispatched
    (_cost); returns the kernel names each timed candidate dispatched. Of the Metal variants only values_per_lane
    (the SpMM kernel variant has its tests in test_metal_window.py)."""
    monkeypatch.setattr(_autotune, "enabled", True)
    monkeypatch.setenv("TORCH_SPARSE_METAL_CACHE_DIR", str(tmp_path))
    new_process(monkeypatch)
    one_round(monkeypatch)
    monkeypatch.setitem(tuning.VARIANTS, "cpu", {"values_per_lane": VALUES_PER_LANE})
    timed: list[list[str]] = []

    def time_of(label, call):
        start = len(LOG)
        call()
        timed.append(LOG[start:])
        return _cost(LOG[start:])

    fake_rounds(monkeypatch, time_of)
    LOG.clear()
    return timed


def _problem(n_in: int = 70, n_out: int = 50, density: float = 0.2, batch: int = 40, seed: int = 0):
    """``(topology, x, weight, grad_out)``: a random layer and its tensors."""
    g = torch.Generator().manual_seed(seed)
    topo = CSRTopology.random(n_in, n_out, density, generator=g)
    x, w = torch.randn(batch, n_in, generator=g), torch.randn(topo.nnz, generator=g)
    return topo, x, w, torch.randn(batch, n_out, generator=g)


def _check(topo, x, w, go, y=None, grads=None) -> None:
    """Against the float64 dense reference."""
    y64, gx64, gw64 = reference_outputs(go, x, w, topo)
    for got, ref in ((y, y64), *zip(grads or (), (gx64, gw64))):
        if got is not None:
            torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-4)


def _tune_forward(metal, topo, x, w) -> tuning.Config | None:
    return tuning.tune_forward(CPU, x.dtype, topo.in_features, topo.out_features, topo.nnz, x.shape[0],
                               lambda: metal.forward(x, w, *topo.kernel_args()))


def _tune_backward(metal, topo, x, w, go) -> Strategy:
    return resolve_strategy("auto", CPU, topo.in_features, topo.out_features, topo.nnz, x.shape[0],
                            measure=lambda s: metal.backward(go, x, w, *topo.kernel_args(), s.value))


def test_forward_tunes_values_per_lane_and_dispatches_it(metal, variants, tmp_path):
    topo, x, w, go = _problem()
    assert values_per_lane(x.shape[0]) == 4  # the static rule; the fake timer prefers 1
    assert _tune_forward(metal, topo, x, w) == {"values_per_lane": 1}
    assert [_ps(names) for names in variants] == [{1}, {4}]  # each candidate ran with its own P
    (decisions,) = json.loads((tmp_path / "tuning.json").read_text()).values()
    assert decisions[tuning.bucket_key(torch.float32, 70, 50, topo.nnz, 40, "forward")] == {
        "values_per_lane": 1, "ms": {"values_per_lane=1": 1.0, "values_per_lane=4": 2.0},
        "spread_ms": {"values_per_lane=1": 0.0, "values_per_lane=4": 0.0}}
    LOG.clear()
    _check(topo, x, w, go, y=metal.forward(x, w, *topo.kernel_args()))
    assert _ps(LOG) == {1}


def test_backward_tunes_values_per_lane_of_the_static_strategy_and_dispatches_it(metal, variants, tmp_path):
    topo, x, w, go = _problem()
    assert _tune_backward(metal, topo, x, w, go) == STATIC == Strategy.FUSED_ATOMIC
    ran = [("fused_atomic" if any(n.startswith("spmm_sddmm_atomic") for n in names) else "atomic_free", _ps(names))
           for names in variants]
    assert ran == [("fused_atomic", {p}) for p in VALUES_PER_LANE]  # the static strategy with each P
    (decisions,) = json.loads((tmp_path / "tuning.json").read_text()).values()
    decision = decisions[tuning.bucket_key(torch.float32, 70, 50, topo.nnz, 40)]
    assert {k: v for k, v in decision.items() if "ms" not in k} == {"strategy": "fused_atomic", "values_per_lane": 1}
    assert decision["ms"] == {"fused_atomic values_per_lane=1": 1.5, "fused_atomic values_per_lane=4": 2.5}
    LOG.clear()
    _check(topo, x, w, go, grads=metal.backward(go, x, w, *topo.kernel_args(), "fused_atomic"))
    assert _ps(LOG) == {1}
    LOG.clear()  # a strategy other than the decision's takes the static P
    _check(topo, x, w, go, grads=metal.backward(go, x, w, *topo.kernel_args(), "atomic_free"))
    assert _ps(LOG) == {4}


def test_no_tuning_when_the_bucket_is_cached(metal, variants, monkeypatch):
    topo, x, w, go = _problem()
    _tune_forward(metal, topo, x, w)
    _tune_backward(metal, topo, x, w, go)
    assert len(variants) == 2 + 2
    new_process(monkeypatch)  # a new process reads the file
    other = _problem(n_in=66, n_out=60, density=0.21, batch=35, seed=1)  # another size, the same buckets
    assert _tune_forward(metal, *other[:3]) == {"values_per_lane": 1}
    assert _tune_backward(metal, *other) == Strategy.FUSED_ATOMIC
    assert len(variants) == 2 + 2
    LOG.clear()
    _check(*other, y=metal.forward(*other[1:3], *other[0].kernel_args()))
    assert _ps(LOG) == {1}


@pytest.mark.parametrize("p", VALUES_PER_LANE)
@pytest.mark.parametrize("batch", [1, 40])
def test_each_forced_values_per_lane_is_correct(p, batch):
    log: list[str] = []
    forced = MetalCsrLinear(lambda src: _LoggedLibrary(compile_shader(src), log), device_type="cpu", poison=True,
                            values_per_lane=p)
    topo, x, w, go = _problem(batch=batch, seed=p)
    _check(topo, x, w, go, y=forced.forward(x, w, *topo.kernel_args()))
    for s in STRATEGIES:
        _check(topo, x, w, go, grads=forced.backward(go, x, w, *topo.kernel_args(), s))
    assert _ps(log) == {p}


def test_tuning_off_follows_the_static_rules(metal, variants, monkeypatch, tmp_path):
    topo, x, w, go = _problem()
    _tune_forward(metal, topo, x, w)
    _tune_backward(metal, topo, x, w, go)  # cached: P = 1, fused_atomic
    monkeypatch.setattr(_autotune, "enabled", False)
    variants.clear()
    other = _problem(n_in=100, n_out=100, batch=100, seed=2)
    assert _tune_forward(metal, *other[:3]) is None
    assert _tune_backward(metal, *other) == STATIC
    assert variants == []
    LOG.clear()  # the cached decisions are ignored too
    _check(topo, x, w, go, y=metal.forward(x, w, *topo.kernel_args()),
           grads=metal.backward(go, x, w, *topo.kernel_args(), "fused_atomic"))
    assert _ps(LOG) == {values_per_lane(40)} == {4}


def test_old_entries_without_the_variant_count_as_no_decision(metal, variants, tmp_path):
    """An entry written before a device had variants (a strategy, no values_per_lane): the static P, and the
    static strategy; tuned again (and replaced) at the next real first use. Devices without variants that tune
    the strategies keep using it."""
    topo, x, w, go = _problem()
    bucket = tuning.bucket_key(torch.float32, 70, 50, topo.nnz, 40)
    old = {"strategy": "atomic_free", "ms": {"fused_atomic": 2.0, "atomic_free": 1.0}}
    (tmp_path / "tuning.json").write_text(json.dumps({tuning.device_key(CPU): {bucket: old}}))
    assert tuning.cached(CPU, bucket, tuning.candidates("cuda", STRATEGIES)) == {"strategy": "atomic_free"}
    assert tuning.cached(CPU, bucket, tuning.candidates("cpu", STRATEGIES)) is None
    assert resolve_strategy("auto", CPU, 70, 50, topo.nnz, 40) == STATIC
    metal.backward(go, x, w, *topo.kernel_args(), "atomic_free")
    assert _ps(LOG) == {4} and variants == []
    assert _tune_backward(metal, topo, x, w, go) == STATIC and len(variants) == 2
    (decisions,) = json.loads((tmp_path / "tuning.json").read_text()).values()
    assert decisions[bucket]["values_per_lane"] == 1


def test_a_bad_cached_variant_falls_back_to_the_static_rule(metal, variants, tmp_path):
    topo, x, w, go = _problem()
    bucket = tuning.bucket_key(torch.float32, 70, 50, topo.nnz, 40, "forward")
    for bad in (3, 4.0, True, "4"):
        (tmp_path / "tuning.json").write_text(json.dumps({tuning.device_key(CPU): {bucket: {"values_per_lane": bad}}}))
        tuning._memory = None
        LOG.clear()
        _check(topo, x, w, go, y=metal.forward(x, w, *topo.kernel_args()))
        assert _ps(LOG) == {4}, bad


def test_selfcheck_tunes_and_prints_the_configuration(metal, variants, capsys):
    """The self-check's table of auto's configuration, on the Mac path (tune=True), through the executor."""
    rows = selfcheck.tuner_choices(metal, "cpu", tune=True, features=64, batch=40, edges=[400])
    assert rows[0]["forward"] == {"values_per_lane": 1} and rows[0]["forward_from"] == "tuned"
    assert rows[0]["backward"] == {"strategy": "fused_atomic", "values_per_lane": 1}
    again = selfcheck.tuner_choices(metal, "cpu", tune=True, features=64, batch=40, edges=[400])
    assert again[0]["backward_from"] == "cached" and len(variants) == 2 + 2
    out = capsys.readouterr().out
    assert "values_per_lane=1" in out and "fused_atomic values_per_lane=1" in out and "cached / cached" in out


@pytest.fixture
def cpu_variants(monkeypatch, tmp_path) -> list[tuning.Config]:
    """Tuning on with a fresh cache, the CPU declared to have the Metal variants (its kernels ignore P), times
    from the configuration being timed (P = 1 faster); returns the labels of the configurations timed."""
    monkeypatch.setattr(_autotune, "enabled", True)
    monkeypatch.setenv("TORCH_SPARSE_METAL_CACHE_DIR", str(tmp_path))
    new_process(monkeypatch)
    one_round(monkeypatch)
    monkeypatch.setitem(tuning.VARIANTS, "cpu", {"values_per_lane": VALUES_PER_LANE})
    timed: list[str] = []

    def time_of(label, call):
        call()
        timed.append(label)
        return 1.0 if label.endswith("values_per_lane=1") else 2.0

    fake_rounds(monkeypatch, time_of)
    return timed


def test_eager_forward_tunes_variants_but_not_under_compile_or_func(cpu_variants):
    """The forward's variants are tuned at the first eager call of a bucket on a device with variants, never
    while torch.compile traces or under a torch.func transform."""
    layer = SparseLinear(30, 20, density=0.3)
    x = torch.randn(4, 30)
    torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    torch.func.vjp(layer, x)
    assert cpu_variants == []
    layer(x)
    layer(torch.randn(3, 30))  # the same bucket
    assert cpu_variants == ["values_per_lane=1", "values_per_lane=4"]


def test_cli_tunes_and_shows_the_variants(cpu_variants, monkeypatch, tmp_path, capsys):
    """The command tunes with tuning off (running it is the opt-in) and leaves it off; a run with tuning on then
    reads its decisions without timing."""
    monkeypatch.setattr(_autotune, "enabled", False)
    assert tune_main(["--device", "cpu", "--layer", "64,48,0.1", "--batch", "40"]) == 0
    assert len(cpu_variants) == 2 + 2 and not tuning.enabled()
    out = capsys.readouterr().out
    assert ("64x48, density 0.1, batch 40 on cpu: forward values_per_lane=1, backward fused_atomic values_per_lane=1"
            in out)
    assert "runs read these decisions only with tuning on (TORCH_SPARSE_METAL_TUNE=1" in out
    tuning.enable()
    SparseLinear(64, 48, density=0.1)(torch.randn(40, 64)).sum().backward()
    assert len(cpu_variants) == 2 + 2
    assert tune_main(["--show"]) == 0
    shown = capsys.readouterr().out
    cache = json.loads(shown[shown.index("{"):])
    (decisions,) = cache.values()
    assert sorted(d["values_per_lane"] for d in decisions.values()) == [1, 1]
