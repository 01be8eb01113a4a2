"""torch's deterministic-algorithms contract: under ``torch.use_deterministic_algorithms(True)`` every result is
bitwise reproducible, or the op raises (warns with ``warn_only=True``). ``atomic_free`` and the forward are
deterministic on every device; ``fused_atomic`` only on the CPU with at most two threads (csrc/cpu adds one
partial weight gradient per thread's batch chunk atomically: two additions onto zero commute, three do not).
``auto`` runs ``atomic_free`` while the flag is on, whatever the tuning cache says."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from torch_sparse_metal import CSRTopology, _autotune, sparse_linear, timing, tuning
from torch_sparse_metal.backends import mps
from torch_sparse_metal.strategy import Strategy, check_deterministic, deterministic, resolve_strategy
from torch_sparse_metal_tools.testing.reference import reference_outputs

CPU = torch.device("cpu")
RUNS = 6


@pytest.fixture
def flag():
    """Restores the deterministic-algorithms flag and the thread count after the test."""
    state = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    threads = torch.get_num_threads()
    yield
    torch.use_deterministic_algorithms(state[0], warn_only=state[1])
    torch.set_num_threads(threads)


def _problem(seed: int, n_in: int = 300, n_out: int = 200, density: float = 0.1, batch: int = 200):
    g = torch.Generator().manual_seed(seed)
    topo = CSRTopology.random(n_in, n_out, density, generator=g)
    return topo, torch.randn(batch, n_in, generator=g), torch.randn(topo.nnz, generator=g)


def _run(topo, x, w, backward: str, order: int = 1) -> tuple[torch.Tensor, ...]:
    """``(y, x.grad, w.grad)`` of a loss; with ``order=2`` of a gradient penalty (create_graph=True), which runs
    the differentiable first-order gradients and then their backward."""
    x, w = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = sparse_linear(x, w, topo, backward=backward)
    loss = y.square().sum()
    if order == 2:
        (gx,) = torch.autograd.grad(loss, x, create_graph=True)
        loss = gx.square().sum() + loss
    loss.backward()
    return y.detach(), x.grad, w.grad


def _reproducible(results: list[tuple[torch.Tensor, ...]]) -> bool:
    return all(torch.equal(a, b) for r in results[1:] for a, b in zip(results[0], r))


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("order", [1, 2])
def test_atomic_free_and_auto_are_bitwise_reproducible_across_runs(flag, threads, order):
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    topo, x, w = _problem(seed=threads * 10 + order)
    for backward in ("atomic_free", "auto"):
        results = [_run(topo, x, w, backward, order) for _ in range(RUNS)]
        assert _reproducible(results), backward
    assert _reproducible([_run(topo, x, w, "atomic_free", order), _run(topo, x, w, "auto", order)])
    if order == 1:  # and the values are right: against the float64 dense computation
        y, gx, gw = results[0]
        for got, ref in zip((y, gx, gw), reference_outputs(2 * y, x, w, topo)):
            torch.testing.assert_close(got.double(), ref, rtol=1e-4, atol=1e-3)


def test_fused_atomic_with_two_threads_is_reproducible_and_allowed(flag):
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    topo, x, w = _problem(seed=3)
    assert deterministic("fused_atomic", CPU)
    assert _reproducible([_run(topo, x, w, "fused_atomic") for _ in range(RUNS)])


@pytest.mark.parametrize("threads", [3, 4])
def test_fused_atomic_with_more_threads_raises_before_any_gradient(flag, threads):
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    topo, x, w = _problem(seed=threads)
    w = w.clone().requires_grad_(True)
    loss = sparse_linear(x, w, topo, backward="fused_atomic").sum()
    message = (rf"the sparse layer's backward with backward='fused_atomic' does not have a deterministic "
               rf"implementation on the CPU with {threads} threads, but you set "
               rf"'torch.use_deterministic_algorithms\(True\)'\. Use backward='atomic_free' or 'auto'")
    with pytest.raises(RuntimeError, match=message):
        loss.backward()
    assert w.grad is None


def test_fused_atomic_under_warn_only_warns_and_runs(flag):
    torch.set_num_threads(4)
    torch.use_deterministic_algorithms(True, warn_only=True)
    topo, x, w = _problem(seed=5)
    with pytest.warns(UserWarning, match=r"use_deterministic_algorithms\(True, warn_only=True\)"):
        _, _, gw = _run(topo, x, w, "fused_atomic")
    torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(gw, _run(topo, x, w, "atomic_free")[2], rtol=1e-5, atol=1e-5)
    torch.use_deterministic_algorithms(True, warn_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto runs atomic_free: nothing to warn about
        _run(topo, x, w, "auto")


def test_second_order_through_fused_atomic_raises_at_the_kernel_that_sums_atomically(flag):
    """create_graph=True builds the first-order gradients from deterministic ops: no refusal there; the backward
    of those ops runs fused_atomic's kernels, and raises."""
    torch.set_num_threads(4)
    torch.use_deterministic_algorithms(True)
    topo, x, w = _problem(seed=6)
    x = x.requires_grad_(True)
    loss = sparse_linear(x, w.requires_grad_(True), topo, backward="fused_atomic").square().sum()
    (gx,) = torch.autograd.grad(loss, x, create_graph=True)
    with pytest.raises(RuntimeError, match="'fused_atomic' does not have a deterministic implementation"):
        gx.square().sum().backward()


@pytest.mark.parametrize("backward", ["auto", "atomic_free", "fused_atomic"])
def test_torch_func_grad_is_reproducible(flag, backward):
    """Under torch.func the gradients are built from the differentiable ops (the forward kernels and
    atomic_free's weight-gradient pass), whatever the strategy: reproducible, and nothing to refuse."""
    torch.set_num_threads(4)
    torch.use_deterministic_algorithms(True)
    topo, x, w = _problem(seed=7)
    grads = [torch.func.grad(lambda w: sparse_linear(x, w, topo, backward=backward).square().sum())(w)
             for _ in range(RUNS)]
    assert all(torch.equal(grads[0], g) for g in grads[1:])


@pytest.mark.parametrize("device", ["cuda", "mps"])
def test_gpus_refuse_fused_atomic_and_allow_atomic_free(flag, device):
    torch.use_deterministic_algorithms(True)
    assert not deterministic("fused_atomic", torch.device(device))
    assert deterministic("atomic_free", torch.device(device))
    check_deterministic("atomic_free", torch.device(device))
    with pytest.raises(RuntimeError, match=f"implementation on {device}, but you set"):
        check_deterministic("fused_atomic", torch.device(device))
    torch.use_deterministic_algorithms(False)
    check_deterministic("fused_atomic", torch.device(device))  # nothing to check without the flag


def test_auto_ignores_a_cached_fused_atomic_decision(flag, monkeypatch, tmp_path):
    """Tuning on, a cache that says fused_atomic for this bucket: under the flag auto runs atomic_free, times
    nothing and writes nothing; without the flag the cache decides again."""
    monkeypatch.setattr(_autotune, "enabled", True)
    monkeypatch.setenv("TORCH_SPARSE_METAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_memory", None)
    monkeypatch.setattr(tuning, "_session", {})
    monkeypatch.setattr(timing.Timer, "_round", lambda self, fns: pytest.fail("timed under the flag"))
    topo, x, w = _problem(seed=8)
    bucket = tuning.bucket_key(torch.float32, topo.in_features, topo.out_features, topo.nnz, x.shape[0])
    cache = {tuning.device_key(CPU): {bucket: {"strategy": "fused_atomic", "ms": {}}}}
    (tmp_path / "tuning.json").write_text(json.dumps(cache))
    sizes = (topo.in_features, topo.out_features, topo.nnz, x.shape[0])
    assert resolve_strategy("auto", CPU, *sizes) == Strategy.FUSED_ATOMIC
    torch.set_num_threads(4)
    torch.use_deterministic_algorithms(True)
    assert resolve_strategy("auto", CPU, *sizes) == Strategy.ATOMIC_FREE
    assert _reproducible([_run(topo, x, w, "auto") for _ in range(RUNS)] + [_run(topo, x, w, "atomic_free")])
    assert json.loads((tmp_path / "tuning.json").read_text()) == cache


def test_kernel_variants_follow_the_static_rule_under_the_flag(flag, monkeypatch, tmp_path):
    """On MPS the cache also holds kernel variants (values_per_lane): under the flag they are not read, so
    every run dispatches the same kernels whatever another process cached meanwhile."""
    monkeypatch.setattr(_autotune, "enabled", True)
    monkeypatch.setenv("TORCH_SPARSE_METAL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_memory", None)
    monkeypatch.setattr(tuning, "_session", {})
    monkeypatch.setitem(tuning.VARIANTS, "cpu", mps.VARIANTS)
    (tmp_path / "tuning.json").write_text(json.dumps({tuning.device_key(CPU): {
        "fwd": {"values_per_lane": 1}, "bwd": {"strategy": "atomic_free", "values_per_lane": 1}}}))
    assert tuning.variant(CPU, "fwd", "values_per_lane") == 1
    assert tuning.variant(CPU, "bwd", "values_per_lane", "atomic_free") == 1
    torch.use_deterministic_algorithms(True)
    assert tuning.variant(CPU, "fwd", "values_per_lane") is None
    assert tuning.variant(CPU, "bwd", "values_per_lane", "atomic_free") is None
    assert tuning.choose(CPU, "other", tuning.candidates("cpu"), lambda c: pytest.fail("timed")) is None


def test_determinism_and_auto_come_from_the_contract_rows(monkeypatch):
    """What makes a strategy deterministic is its row of csrc/contract.h (contract.STRATEGY_SPECS), never its name:
    with the rows' properties swapped, deterministic() follows them; auto runs the first deterministic row's under
    the flag."""
    import dataclasses

    from torch_sparse_metal import strategy

    assert strategy.DETERMINISTIC is next(s for s, spec in strategy.STRATEGY_SPECS.items() if spec.deterministic)
    for s, spec in strategy.STRATEGY_SPECS.items():
        assert deterministic(s, torch.device("cuda")) == spec.deterministic
        assert spec.accumulates != spec.deterministic  # today's two strategies: one owns every sum, one adds
    swapped = {s: dataclasses.replace(spec, deterministic=spec.accumulates, accumulates=spec.deterministic)
               for s, spec in strategy.STRATEGY_SPECS.items()}
    monkeypatch.setattr(strategy, "STRATEGY_SPECS", swapped)
    for s, spec in swapped.items():
        assert deterministic(s, torch.device("cuda")) == spec.deterministic
        assert deterministic(s, torch.device("cpu")) == (spec.deterministic or torch.get_num_threads() <= 2)
