"""Evolving topology: prune/regrow keeps surviving weights and optimizer state exactly; schedules; errors."""

import copy

import pytest
import torch
from torch import nn

from torch_sparse_metal import CSRTopology, SparseLinear
from torch_sparse_metal.evolve import DynamicSparsity, apply_update, plan_update
from torch_sparse_metal.testing import axes
from torch_sparse_metal.testing.reference import reference_forward

DEVICES = axes.DEVICES


def _keys(layer):
    return (layer.src.long() * layer.out_features + layer.dst.long()).cpu()


def _trained(device, optimizer="adamw", seed=0, in_f=40, out_f=30, density=0.2):
    torch.manual_seed(seed)
    layer = SparseLinear(in_f, out_f, density=density, device=device, generator=torch.Generator().manual_seed(seed))
    opt = (torch.optim.AdamW(layer.parameters(), lr=1e-2) if optimizer == "adamw"
           else torch.optim.SGD(layer.parameters(), lr=1e-2, momentum=0.9))
    for _ in range(3):
        layer(torch.randn(16, in_f, device=device)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return layer, opt


def _per_edge_state(layer, opt):
    state = opt.state[layer.weight]
    return {k: v.detach().cpu().clone() for k, v in state.items() if v.shape == layer.weight.shape}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("drop, grow", [(0, 0), (50, 50), (80, 20), (10, 150), (240, 0)])
def test_update_carries_surviving_weights_and_state(device, optimizer, drop, grow):
    layer, opt = _trained(device, optimizer)
    param = layer.weight
    old_keys, old_w, old_state = _keys(layer), layer.weight.detach().cpu().clone(), _per_edge_state(layer, opt)
    topology, edge_map = plan_update(layer, drop, grow, mode="set", generator=torch.Generator().manual_seed(1))
    apply_update(layer, topology, edge_map, [opt])

    assert layer.weight is param and layer.nnz == 240 - drop + grow
    CSRTopology.from_csr(layer.row_ptr.cpu(), layer.dst.cpu(), 40, 30)  # a valid, sorted, duplicate-free CSR
    new_keys, new_w, new_state = _keys(layer), layer.weight.detach().cpu(), _per_edge_state(layer, opt)
    kept = edge_map.kept.cpu()
    assert int(kept.sum()) == 240 - drop
    # Dropped edges are the smallest in magnitude.
    if drop and drop < 240:
        assert old_w[~kept].abs().max() <= old_w[kept].abs().min()
    # Every surviving edge: same key, same weight, same moments, bit for bit.
    where = edge_map.old_to_new.cpu()[kept]
    assert torch.equal(new_keys[where], old_keys[kept])
    assert torch.equal(new_w[where], old_w[kept])
    for name, values in old_state.items():
        assert torch.equal(new_state[name][where], values[kept]), name
    # Grown edges are new, start at zero with zero state.
    grown = edge_map.grown.cpu()
    assert grown.numel() == grow and not bool(torch.isin(new_keys[grown], old_keys).any())
    assert torch.all(new_w[grown] == 0)
    for values in new_state.values():
        assert torch.all(values[grown] == 0)
    # The layer computes what its new weights say, and keeps training.
    x = torch.randn(5, 40, device=device)
    torch.testing.assert_close(layer(x).double().cpu() - layer.bias.double().cpu(),
                               reference_forward(x, layer.weight, layer.topology), atol=1e-5, rtol=1e-5)
    layer(x).square().mean().backward()
    opt.step()


def test_rigl_grows_where_dense_gradient_is_largest():
    layer, opt = _trained("cpu")
    x, g = torch.randn(32, 40), torch.randn(32, 30)
    dense = (g.t() @ x).abs()  # [out, in]
    dense[layer.dst.long(), layer.src.long()] = -1  # existing edges are not candidates
    expected = torch.topk(dense.reshape(-1), 25).indices  # flat (dst, src)
    expected_keys = set(((expected % 40) * 30 + expected // 40).tolist())
    topology, edge_map = plan_update(layer, 25, 25, mode="rigl", grad=(x, g), chunk=7)
    apply_update(layer, topology, edge_map, [opt])
    assert set(_keys(layer)[edge_map.grown].tolist()) == expected_keys


def test_schedule_grows_decays_and_stops():
    torch.manual_seed(0)
    model = nn.Sequential(SparseLinear(64, 64, density=0.05), nn.ReLU(), SparseLinear(64, 8, density=0.1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    evo = DynamicSparsity(model, opt, prune_every=5, total_steps=40, drop_fraction=0.3, grow_to=0.2,
                          grow_until=0.5, mode="rigl", generator=torch.Generator().manual_seed(0))
    assert evo.drop_fraction_at(0.0) == pytest.approx(0.3) and evo.drop_fraction_at(0.75) == pytest.approx(0.0)
    updates = []
    for _ in range(40):
        model(torch.randn(16, 64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if evo.step():
            updates.append(evo.steps)
    assert updates == [5, 10, 15, 20, 25, 30]  # every 5 steps until 0.75 * 40
    assert [layer.nnz for layer in evo.layers] == [round(0.2 * 64 * 64), round(0.2 * 64 * 8)]
    counts = [n[0] for _, n in evo.history]
    assert counts == sorted(counts) and counts[0] == round(0.05 * 64 * 64)
    # each update regrew what it dropped plus the growth: after = before - drop + regrown, summed over layers
    assert len(evo.regrown) == len(evo.history) and evo.regrown[0] == 0
    for (_, before), (step, after), regrown in zip(evo.history, evo.history[1:], evo.regrown[1:]):
        drops = [round(evo.drop_fraction_at(step / 40) * n) for n in before]
        assert regrown == sum(after) - sum(before) + sum(drops)
    assert evo.regrown[1] > sum(evo.history[1][1]) - sum(evo.history[0][1])  # the first update replaced edges too


def _snapshot(layer, opt):
    return (copy.deepcopy(layer.state_dict()), copy.deepcopy(opt.state_dict()))


def _same(a, b):
    la, oa = a
    lb, ob = b
    same_layer = la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la if torch.is_tensor(la[k]))
    return same_layer and str(oa) == str(ob)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prune_every=0), "prune_every must be an integer >= 1"),
        (dict(drop_fraction=1.5), "drop_fraction must be in \\[0, 1\\]"),
        (dict(grow_to=0.01), "below a layer's current density"),
        (dict(mode="magic"), "mode must be"),
        (dict(total_steps=-3), "total_steps"),
    ],
)
def test_bad_schedule_values(kwargs, message):
    layer, opt = _trained("cpu")
    with pytest.raises(ValueError, match=message):
        DynamicSparsity([layer], opt, **{"total_steps": 10, **kwargs})


def test_growing_past_capacity_raises_and_changes_nothing():
    layer, opt = _trained("cpu", in_f=10, out_f=10, density=0.9)
    before = _snapshot(layer, opt)
    with pytest.raises(ValueError, match="exceed the 100 possible connections"):
        topology, edge_map = plan_update(layer, 0, 11)
    assert _same(before, _snapshot(layer, opt))


def test_rigl_without_gradient_raises_and_changes_nothing():
    layer, opt = _trained("cpu")
    evo = DynamicSparsity([layer], opt, prune_every=1, total_steps=10, mode="rigl")
    before = _snapshot(layer, opt)
    with pytest.raises(RuntimeError, match="no gradient was captured"):
        evo.step()
    assert _same(before, _snapshot(layer, opt))


def _run(steps, resume_at=None, path=None):
    torch.manual_seed(0)
    model = nn.Sequential(SparseLinear(24, 32, density=0.2, generator=torch.Generator().manual_seed(0)), nn.Tanh(),
                          SparseLinear(32, 4, density=0.3, generator=torch.Generator().manual_seed(1)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    evo = DynamicSparsity(model, opt, prune_every=3, total_steps=steps, grow_to=0.4,
                          generator=torch.Generator().manual_seed(2))
    data = torch.Generator().manual_seed(3)
    start = 0
    if resume_at is not None:
        state = torch.load(path)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        evo.load_state_dict(state["evo"])
        data.set_state(state["data"])
        start = resume_at
    for step in range(start, steps):
        x = torch.randn(16, 24, generator=data)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        evo.step()
        if path is not None and resume_at is None and step + 1 == steps // 2:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "evo": evo.state_dict(),
                        "data": data.get_state()}, path)
    return model


def test_resume_after_topology_changes_continues_exactly(tmp_path):
    path = tmp_path / "ckpt.pt"
    straight = _run(20, path=path)
    resumed = _run(20, resume_at=10, path=path)
    for (k, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), k


def test_no_host_reads_between_updates(monkeypatch):
    layer, opt = _trained("cpu")
    evo = DynamicSparsity([layer], opt, prune_every=100, total_steps=1000)
    calls = []
    monkeypatch.setattr(torch.Tensor, "item", lambda self: calls.append(1) or 0)
    for _ in range(20):
        evo.step()
    assert calls == []


def test_progress_driven_schedule_for_time_budgets():
    layer, opt = _trained("cpu")
    evo = DynamicSparsity([layer], opt, prune_every=2, total_steps=None, grow_to=0.3, grow_until=0.5)
    with pytest.raises(ValueError, match="pass step\\(progress="):
        evo.step()
    assert evo.steps == 0
    for i in range(1, 11):
        evo.step(progress=i / 10)
    assert layer.nnz == round(0.3 * 40 * 30)  # reached at half of the run
    assert [s for s, _ in evo.history] == [0, 2, 4, 6]  # no updates past stop_fraction = 0.75
