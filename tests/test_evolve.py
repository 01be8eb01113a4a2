"""Evolving topology: prune/regrow keeps surviving weights and optimizer state exactly; schedules; errors."""

import copy
import re

import pytest
import torch
from torch import nn

from torch_sparse_metal import CSRTopology, SparseLinear
from torch_sparse_metal._resize import replace_data
from torch_sparse_metal.evolve import DynamicSparsity, apply_update, plan_update
from torch_sparse_metal_tools.testing import axes
from torch_sparse_metal_tools.testing.reference import reference_forward

DEVICES = axes.DEVICES


def _keys(layer):
    return (layer.src.long() * layer.out_features + layer.dst.long()).cpu()


def _step(model, opt, x) -> None:
    """One training step on the tests' loss, the mean square of the output."""
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _trained(device, optimizer="adamw", seed=0, in_f=40, out_f=30, density=0.2):
    torch.manual_seed(seed)
    layer = SparseLinear(in_f, out_f, density=density, device=device, generator=torch.Generator().manual_seed(seed))
    opt = (torch.optim.AdamW(layer.parameters(), lr=1e-2) if optimizer == "adamw"
           else torch.optim.SGD(layer.parameters(), lr=1e-2, momentum=0.9))
    for _ in range(3):
        _step(layer, opt, torch.randn(16, in_f, device=device))
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
        _step(model, opt, torch.randn(16, 64))
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
        _step(model, opt, torch.randn(16, 24, generator=data))
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


# ------------------------------------------------------------------------------------------ frozen layers
def _frozen_and_trainable():
    torch.manual_seed(0)
    model = nn.Sequential(SparseLinear(16, 24, density=0.2, generator=torch.Generator().manual_seed(0)), nn.ReLU(),
                          SparseLinear(24, 8, density=0.2, generator=torch.Generator().manual_seed(1)))
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def _assert_same_state(state, ref):
    assert state.keys() == ref.keys()
    for name, value in state.items():
        assert torch.equal(value, ref[name]) if torch.is_tensor(value) else value == ref[name], name


def _train(model, opt, evo, steps, width=16):
    for _ in range(steps):
        loss = model(torch.randn(8, width)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        evo.step()


@pytest.mark.parametrize("mode", ["set", "rigl"])
def test_frozen_layers_are_left_alone(mode):
    model, opt = _frozen_and_trainable()
    frozen = copy.deepcopy(model[0].state_dict())
    evo = DynamicSparsity(model, opt, prune_every=2, total_steps=12, grow_to=0.4, mode=mode)
    assert evo.layers == [model[2]]
    keys = _keys(model[2])
    _train(model, opt, evo, 8)
    assert len(evo.history) == 5 and model[2].nnz == evo.target_nnz(0, 8 / 12)
    assert not torch.equal(_keys(model[2]), keys)
    _assert_same_state(model[0].state_dict(), frozen)


def test_a_layer_frozen_after_construction_is_skipped_at_updates():
    model, opt = _frozen_and_trainable()
    model[0].requires_grad_(True)
    opt.add_param_group({"params": list(model[0].parameters())})
    evo = DynamicSparsity(model, opt, prune_every=2, total_steps=12, drop_fraction=0.5)
    _train(model, opt, evo, 2)
    assert evo.history[-1][0] == 2
    model[0].requires_grad_(False)
    frozen = copy.deepcopy(model[0].state_dict())
    keys = _keys(model[2])
    _train(model, opt, evo, 2)
    assert evo.history[-1][0] == 4 and not torch.equal(_keys(model[2]), keys)
    _assert_same_state(model[0].state_dict(), frozen)


def test_a_trainable_layer_outside_the_optimizer_is_refused():
    model, opt = _frozen_and_trainable()
    model[0].weight.requires_grad_(True)  # trainable, but the optimizer does not hold it
    with pytest.raises(ValueError, match=r"the weight of 0 is trainable but not in the optimizer.*not be carried"):
        DynamicSparsity(model, opt, total_steps=10)
    model[0].weight.requires_grad_(False)
    model[2].requires_grad_(False)
    with pytest.raises(ValueError, match=r"every SparseLinear layer found \(0, 2\) is frozen"):
        DynamicSparsity(model, opt, total_steps=10)


def test_a_layer_listed_twice_is_updated_once():
    layer, opt = _trained("cpu")
    evo = DynamicSparsity([layer, layer], opt, prune_every=1, total_steps=10, drop_fraction=0.5)
    assert evo.layers == [layer]
    evo.step()
    assert evo.history[-1] == (1, [layer.nnz])


# ------------------------------------------------------------------------------------------ RigL and checkpointing
class _Checkpointed(nn.Module):
    def __init__(self, checkpoint: str | None):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.inp = SparseLinear(12, 20, density=0.3, generator=gen)
        self.block = nn.Sequential(SparseLinear(20, 20, density=0.2, generator=gen), nn.Tanh(),
                                   SparseLinear(20, 20, density=0.2, generator=gen))
        self.head = SparseLinear(20, 3, density=0.3, generator=gen)
        self.checkpoint = checkpoint

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.checkpoint is None:
            h = self.block(h)
        else:
            h = torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=self.checkpoint == "reentrant")
        return self.head(h)


def _rigl_run(checkpoint: str | None):
    model = _Checkpointed(checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    evo = DynamicSparsity(model, opt, prune_every=3, total_steps=20, drop_fraction=0.4, grow_to=0.4, mode="rigl")
    data = torch.Generator().manual_seed(1)
    topologies = []
    for _ in range(12):
        _step(model, opt, torch.randn(10, 12, generator=data))
        if evo.step():
            topologies.append([_keys(layer) for layer in evo.layers])
    return model, topologies


@pytest.mark.parametrize("checkpoint", ["non_reentrant", "reentrant"])
def test_rigl_under_activation_checkpointing_grows_the_same_edges(checkpoint):
    plain, expected = _rigl_run(None)
    model, got = _rigl_run(checkpoint)
    assert len(got) == len(expected) == 4
    for update, (a, b) in enumerate(zip(got, expected)):
        for layer, (ka, kb) in enumerate(zip(a, b)):
            assert torch.equal(ka, kb), (update, layer)
    for (name, a), (_, b) in zip(model.state_dict().items(), plain.state_dict().items()):
        torch.testing.assert_close(a, b, msg=name)


def test_rigl_counts_every_back_propagated_call_of_a_shared_layer():
    layer, opt = _trained("cpu", in_f=20, out_f=20)
    evo = DynamicSparsity([layer], opt, prune_every=1, total_steps=10, drop_fraction=0.2, mode="rigl")
    x = torch.randn(6, 20)
    h = layer(x)
    y = layer(torch.tanh(h))
    g = torch.randn_like(y)
    y.backward(g)
    # the dense gradient of the weight, both calls: grad_h from the second call's backward, by autograd on a dense twin
    w = layer.to_dense().detach().requires_grad_(True)
    h_ref = x @ w.T + layer.bias.detach()
    (torch.tanh(h_ref) @ w.T).backward(g)
    dense = w.grad.abs()
    dense[layer.dst.long(), layer.src.long()] = -1
    drop = round(evo.drop_fraction_at(1 / 10) * layer.nnz)
    top = torch.topk(dense.reshape(-1), drop).indices
    expected = set(((top % 20) * 20 + top // 20).tolist())
    before = set(_keys(layer).tolist())
    opt.zero_grad()
    evo.step()
    assert set(_keys(layer).tolist()) - before == expected


# ------------------------------------------------------------------------------------------ graphs across updates
@pytest.mark.parametrize("mode", ["set", "rigl"])
def test_readme_loop_with_grow_to_runs_through_updates(mode):
    torch.manual_seed(0)
    model = nn.Sequential(SparseLinear(32, 32, density=0.05), nn.ReLU(), SparseLinear(32, 8, density=0.1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    evo = DynamicSparsity(model, optimizer, prune_every=3, total_steps=30, drop_fraction=0.3, mode=mode, grow_to=0.3)
    for _ in range(30):
        loss = model(torch.randn(8, 32)).square().mean()  # the previous step's loss (and graph) is alive here
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        evo.step()
    assert len(evo.history) == 8 and torch.isfinite(loss)
    assert [layer.nnz for layer in evo.layers] == [round(0.3 * 32 * 32), round(0.3 * 32 * 8)]


@pytest.mark.parametrize("drop, grow", [(20, 20), (20, 60)])
def test_backward_through_a_graph_built_before_an_update_raises(drop, grow):
    layer, opt = _trained("cpu")
    stale = layer(torch.randn(4, 40)).square().sum()
    apply_update(layer, *plan_update(layer, drop, grow, generator=torch.Generator().manual_seed(0)), [opt])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stale.backward()
    assert layer.weight.grad is None


def test_loading_another_topology_while_an_old_graph_is_alive_then_training():
    layer = SparseLinear(20, 10, density=0.2, generator=torch.Generator().manual_seed(0))
    other = SparseLinear(20, 10, density=0.5, generator=torch.Generator().manual_seed(1))
    x = torch.randn(6, 20)
    stale = layer(x).square().sum()
    stale.backward(retain_graph=True)  # a gradient of the old topology is held too
    layer.load_state_dict(other.state_dict())
    assert layer.weight.grad is None and layer.nnz == other.nnz
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    opt.zero_grad()  # the bias keeps its gradient through a load, as nn.Linear's does
    layer(x).square().sum().backward()
    other(x).square().sum().backward()
    torch.testing.assert_close(layer.weight.grad, other.weight.grad)
    opt.step()
    with torch.no_grad():
        other.weight -= 0.1 * other.weight.grad
        other.bias -= 0.1 * other.bias.grad
    torch.testing.assert_close(layer(x), other(x))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stale.backward()


def test_replace_data_keeps_the_parameter_its_optimizer_state_and_its_hooks():
    p = nn.Parameter(torch.randn(4, dtype=torch.float64))
    opt = torch.optim.AdamW([p], lr=0.1)
    (p * p).sum().backward()
    opt.step()
    state = opt.state[p]
    fired = []
    p.register_hook(lambda g: fired.append(("tensor", g.shape)) or 3 * g)  # its return value replaces the gradient
    p.register_post_accumulate_grad_hook(lambda t: fired.append(("post", t.grad.shape)))
    stale = (p * p).sum()
    new = torch.randn(7, dtype=torch.float64)
    replace_data(p, new.clone())
    assert opt.param_groups[0]["params"][0] is p and opt.state[p] is state and p.grad is None
    assert p.dtype == torch.float64 and torch.equal(p.detach(), new)
    (p * p).sum().backward()
    assert fired == [("tensor", (7,)), ("post", (7,))]
    torch.testing.assert_close(p.grad, 3 * 2 * new)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stale.backward()


# ------------------------------------------------------------------------------------------ in-place updates
def _storages(layer, opt):
    """The storage address of every tensor a captured graph could hold: index buffers, weight, per-edge state."""
    names = ("row_ptr", "dst", "src", "col_ptr", "src_by_dst", "perm")
    state = opt.state[layer.weight]
    return ([getattr(layer, n).data_ptr() for n in names] + [layer.weight.data_ptr()]
            + [state[k].data_ptr() for k in sorted(state) if torch.is_tensor(state[k])])


def _everything(layer, opt):
    names = ("row_ptr", "dst", "src", "col_ptr", "src_by_dst", "perm", "weight", "bias")
    state = opt.state[layer.weight]
    return ({n: getattr(layer, n).detach().cpu().clone() for n in names}
            | {f"state.{k}": v.detach().cpu().clone() for k, v in state.items() if torch.is_tensor(v)})


def _rigl_grad(layer, device, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(24, 40, generator=g).to(device), torch.randn(24, 30, generator=g).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("mode", ["set", "rigl"])
def test_in_place_update_is_bitwise_the_replacing_one_and_keeps_every_storage(device, optimizer, mode):
    replaced, opt_r = _trained(device, optimizer)
    written, opt_w = _trained(device, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(_everything(replaced, opt_r).values(),
                                                 _everything(written, opt_w).values()))
    grad = _rigl_grad(replaced, device) if mode == "rigl" else None
    plan = plan_update(replaced, 60, 60, mode=mode, grad=grad, generator=torch.Generator().manual_seed(3))
    for layer in (replaced, written):  # a gradient of the old edges, left from a step
        layer(torch.ones(2, 40, device=device)).sum().backward()
    grad = written.weight.grad
    before = _storages(written, opt_w)
    cached = written.topology  # the layer's cached CSRTopology shares the buffers

    assert apply_update(replaced, *plan, [opt_r]) is False
    assert apply_update(written, *plan, [opt_w], in_place=True) is True

    assert _storages(written, opt_w) == before
    a, b = _everything(replaced, opt_r), _everything(written, opt_w)
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert replaced.weight.grad is None and not bool(written.weight.grad.any())  # the old edges' gradient: gone
    assert not torch.equal(a["dst"], _everything(*_trained(device, optimizer))["dst"])
    assert written.topology is cached and torch.equal(cached.dst.cpu(), a["dst"]) and written.weight.grad is grad
    # the next step: same outputs, same gradients, same update
    x = torch.randn(8, 40, generator=torch.Generator().manual_seed(9)).to(device)
    for layer in (replaced, written):
        layer.bias.grad = None
        layer(x).square().mean().backward()
    assert torch.equal(replaced.weight.grad, written.weight.grad) and torch.equal(replaced.bias.grad, written.bias.grad)
    torch.testing.assert_close(written(x).double().cpu() - written.bias.double().cpu(),
                               reference_forward(x, written.weight, written.topology), atol=1e-5, rtol=1e-5)
    opt_r.step()
    opt_w.step()
    a, b = _everything(replaced, opt_r), _everything(written, opt_w)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_in_place_update_of_another_edge_count_replaces_the_tensors():
    layer, opt = _trained("cpu")
    twin, opt_t = _trained("cpu")
    plan = plan_update(layer, 30, 50, generator=torch.Generator().manual_seed(3))
    dst = twin.dst
    assert apply_update(twin, *plan, [opt_t], in_place=True) is False
    apply_update(layer, *plan, [opt])
    assert twin.dst is not dst and twin.nnz == 260
    a, b = _everything(layer, opt), _everything(twin, opt_t)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_in_place_update_makes_a_stale_backward_raise():
    layer, opt = _trained("cpu")
    stale = layer(torch.randn(4, 40)).square().sum()
    apply_update(layer, *plan_update(layer, 20, 20, generator=torch.Generator().manual_seed(1)), [opt], in_place=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stale.backward()


@pytest.mark.parametrize("mode", ["set", "rigl"])
def test_schedule_in_place_matches_the_replacing_schedule(mode):
    runs = {}
    for in_place in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(SparseLinear(32, 48, density=0.2, generator=torch.Generator().manual_seed(1)), nn.ReLU(),
                              SparseLinear(48, 8, density=0.3, generator=torch.Generator().manual_seed(2)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        evo = DynamicSparsity(model, opt, prune_every=3, total_steps=12, mode=mode, in_place=in_place,
                              generator=torch.Generator().manual_seed(4))
        storages = None  # once the optimizer's state exists
        data = torch.Generator().manual_seed(7)
        kept = []
        for _ in range(12):
            _step(model, opt, torch.randn(16, 32, generator=data))
            storages = storages or [_storages(layer, opt) for layer in evo.layers]
            if evo.step():
                kept.append(evo.updated_in_place)
                if in_place:
                    assert [_storages(layer, opt) for layer in evo.layers] == storages
        runs[in_place] = (kept, [_everything(layer, opt) for layer in evo.layers], evo.history)
    assert runs[True][0] == [True] * 3 and runs[False][0] == [False] * 3
    assert runs[True][2] == runs[False][2]
    for a, b in zip(runs[False][1], runs[True][1]):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_schedule_in_place_reports_growth_as_not_in_place():
    layer, opt = _trained("cpu")
    evo = DynamicSparsity([layer], opt, prune_every=2, total_steps=8, grow_to=0.4, grow_until=0.5, in_place=True)
    seen = []
    for _ in range(8):
        _step(layer, opt, torch.randn(8, 40))
        if evo.step():
            seen.append((evo.updated_in_place, layer.nnz))
    assert seen[0] == (False, seen[0][1]) and seen[0][1] > 240  # growing changes the edge count: new tensors
    assert seen[-1][0] is True  # growth done by half the run: later updates keep the count and the storage


def test_schedule_in_place_refuses_layers_sharing_index_tensors():
    a = SparseLinear(16, 16, density=0.25)
    b = SparseLinear.from_topology(a.topology)
    opt = torch.optim.AdamW([*a.parameters(), *b.parameters()])
    with pytest.raises(ValueError, match="share their index tensors"):
        DynamicSparsity([a, b], opt, total_steps=10, in_place=True)
    DynamicSparsity([a, b], opt, total_steps=10)  # replacing updates give each layer new tensors
    with pytest.raises(TypeError, match="in_place must be a bool"):
        DynamicSparsity([a], opt, total_steps=10, in_place=1)


# ------------------------------------------------------------------------------------------ refusals at construction
def _hooks(*layers):
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in layers]


def _dense_reference(model, x):
    """The model's output with each SparseLinear replaced by nn.Linear holding its dense weight."""
    for m in model:
        x = nn.functional.linear(x, m.to_dense(), m.bias) if isinstance(m, SparseLinear) else m(x)
    return x


def test_tied_weights_are_refused_before_any_change():
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    a = SparseLinear(12, 12, density=0.3, generator=g)
    b = SparseLinear.from_topology(a.topology, generator=g)
    b.weight = a.weight  # tied: one Parameter (and one topology) in two layers
    model = nn.Sequential(a, nn.Tanh(), b)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(5, 12, generator=g)
    model(x).square().mean().backward()
    opt.step()
    before, hooks = _snapshot(model, opt), _hooks(a, b)
    for layers in (model, [a, b]):
        with pytest.raises(ValueError, match=r"(0 and 2|layers\[0\] and layers\[1\]) share one weight Parameter "
                                             r"\(tied weights\).*wrong connections.*its own weight Parameter"):
            DynamicSparsity(layers, opt, prune_every=1, total_steps=10, mode="rigl")
    assert _same(before, _snapshot(model, opt)) and _hooks(a, b) == hooks
    torch.testing.assert_close(model(x), _dense_reference(model, x))
    # what the message says to do: each layer its own weight, then the schedule updates both correctly
    b.weight = nn.Parameter(a.weight.detach().clone())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    evo = DynamicSparsity(model, opt, prune_every=1, total_steps=10, generator=g)
    evo.step()
    assert not torch.equal(_keys(a), _keys(b))  # their topologies went separate ways
    torch.testing.assert_close(model(x), _dense_reference(model, x))


def test_a_weight_shared_with_another_module_of_the_model_is_refused():
    layer = SparseLinear(10, 6, density=0.4)
    model = nn.Sequential(layer, nn.Linear(6, 6))
    model[1].register_parameter("tied", layer.weight)  # e.g. a regulariser that reads the values by edge
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=r"the weight of 0 is also 1\.tied \(a Linear\).*wrong connections"):
        DynamicSparsity(model, opt, total_steps=10)
    assert _same(before, _snapshot(model, opt))
    layer.requires_grad_(False)  # frozen: left out of the schedule, so nothing of it is reordered
    model.append(SparseLinear(6, 6, density=0.4))
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    assert DynamicSparsity(model, opt, total_steps=10).layers == [model[2]]


def _parametrized(kind):
    layer = SparseLinear(16, 8, density=0.3, generator=torch.Generator().manual_seed(int(torch.randint(99, (1,)))))
    if kind == "parametrized":
        class Scale(nn.Module):
            def forward(self, w):
                return 2.0 * w

        torch.nn.utils.parametrize.register_parametrization(layer, "weight", Scale())
        return layer, r"parametrized \(torch\.nn\.utils\.parametrize\): its Parameter is (layers\[0\]|layer)\." \
                      r"parametrizations\.weight\.original.*torch\.nn\.utils\.parametrize\.remove_parametrizations" \
                      r"\(layer, 'weight'\)"
    torch.nn.utils.prune.random_unstructured(layer, "weight", amount=0.25)
    return layer, r"pruned \(torch\.nn\.utils\.prune\): its Parameter is (layers\[0\]|layer)\.weight_orig.*" \
                  r"torch\.nn\.utils\.prune\.remove\(layer, 'weight'\)"


@pytest.mark.parametrize("kind", ["parametrized", "pruned"])
def test_a_parametrized_or_pruned_weight_is_refused_naming_the_unwrapping_call(kind):
    layer, message = _parametrized(kind)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)  # holds the original, as it should
    x = torch.randn(4, 16)
    layer(x).square().mean().backward()
    opt.step()
    before, hooks = _snapshot(layer, opt), _hooks(layer)
    for call in (lambda: DynamicSparsity([layer], opt, total_steps=10, mode="rigl"),
                 lambda: plan_update(layer, 4, 4)):
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert "not in the optimizer" not in str(info.value)
    assert _same(before, _snapshot(layer, opt)) and _hooks(layer) == hooks
    # the call the message names, then the schedule works with the same optimizer
    if kind == "parametrized":
        torch.nn.utils.parametrize.remove_parametrizations(layer, "weight")
    else:
        torch.nn.utils.prune.remove(layer, "weight")
    expected = nn.functional.linear(x, layer.to_dense(), layer.bias)
    torch.testing.assert_close(layer(x), expected)
    evo = DynamicSparsity([layer], opt, prune_every=1, total_steps=10, generator=torch.Generator().manual_seed(0))
    old = _keys(layer)
    evo.step()
    assert not torch.equal(_keys(layer), old) and layer.weight in opt.state
    torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.to_dense(), layer.bias))


@pytest.mark.parametrize("kind", ["parametrized", "pruned"])
def test_a_frozen_wrapped_layer_is_left_alone(kind):
    wrapped, _ = _parametrized(kind)
    wrapped.requires_grad_(False)
    model = nn.Sequential(wrapped, nn.ReLU(), SparseLinear(8, 8, density=0.3))
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    before = copy.deepcopy(wrapped.state_dict())
    evo = DynamicSparsity(model, opt, prune_every=1, total_steps=10)
    assert evo.layers == [model[2]]
    evo.step()
    _assert_same_state(wrapped.state_dict(), before)


@pytest.mark.parametrize("case", ["set, density 0.8", "rigl, block 8, density 0.9"])
def test_a_schedule_that_cannot_regrow_what_it_drops_is_refused_up_front(case):
    """README's loop at a high density: refused at construction naming the layer, the density, the drop fraction
    and the limit, instead of failing at the first update."""
    if case.startswith("set"):
        layer, mode, absent = SparseLinear(20, 10, density=0.8), "set", 40
        limit = r"a drop of at most 40 edges, a drop fraction of at most 0\.25 = \(1 - density\) / density"
    else:
        layer, mode, absent = SparseLinear(40, 16, density=0.9, block=8), "rigl", 64
        limit = r"a drop of at most 64 edges, a drop fraction of at most 0\.1111 = \(1 - density\) / density"
    model = nn.Sequential(nn.Linear(7, 7), layer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before, hooks = _snapshot(layer, opt), _hooks(layer)
    total = layer.in_features * layer.out_features
    schedule = dict(prune_every=200, total_steps=20_000, drop_fraction=0.3, mode=mode)
    with pytest.raises(ValueError) as info:
        DynamicSparsity(model, opt, **schedule)
    assert re.search(rf"edge count of 1 \({layer.in_features} -> {layer.out_features}, {total} possible connections"
                     rf".*step 200 \(drop fraction 0\.29\d*, decayed from drop_fraction=0\.3\) finds it at "
                     rf"{layer.nnz} edges \(density 0\.[89]\).*only {absent} connections are absent.*{limit}",
                     str(info.value)), info.value
    assert _same(before, _snapshot(layer, opt)) and _hooks(layer) == hooks
    # the drop fraction the message suggests fits
    fitting = float(re.search(r"drop_fraction \(to at most about ([0-9.]+)\)", str(info.value)).group(1))
    DynamicSparsity(model, opt, **{**schedule, "drop_fraction": fitting})


def _run_unchecked(layer, kwargs, progresses=None):
    """Run a SET schedule's updates with the construction check off: the step an update fails at, or None."""
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    original = DynamicSparsity._check_edge_budget
    DynamicSparsity._check_edge_budget = lambda *args: None
    try:
        evo = DynamicSparsity([layer], opt, generator=torch.Generator().manual_seed(0), **kwargs)
    finally:
        DynamicSparsity._check_edge_budget = original
    for i, progress in enumerate(progresses or [None] * kwargs["total_steps"]):
        try:
            evo.step(progress)
        except ValueError as exc:
            assert re.search(r"absent connections exist|would exceed the", str(exc)), exc
            return i + 1
    return None


def test_the_edge_budget_check_refuses_exactly_the_schedules_whose_updates_fail():
    """The construction check against the updates themselves, on random schedules (total_steps known): a refused
    schedule fails at the step it names, an accepted one runs to the end."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    rand = lambda: float(torch.rand((), generator=g))  # noqa: E731
    verdicts = set()
    for _ in range(40):
        block = 8 if rand() < 0.3 else 1
        in_f, out_f = int(torch.randint(1, 9, (), generator=g)), block * int(torch.randint(1, 9, (), generator=g))
        density = 0.3 + 0.7 * rand()
        layer = SparseLinear(in_f, out_f, density=density, block=block, generator=g)
        kwargs = dict(prune_every=int(torch.randint(1, 4, (), generator=g)), total_steps=int(torch.randint(4, 25, (),
                      generator=g)), drop_fraction=rand(), stop_fraction=0.3 + 0.7 * rand(), grow_until=rand())
        if rand() < 0.5:
            kwargs["grow_to"] = layer.density + (1 - layer.density) * rand()
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
        try:
            DynamicSparsity([layer], opt, **kwargs)
            named = None
        except ValueError as exc:
            named = int(re.search(r"its update at step (\d+)", str(exc)).group(1))
        assert _run_unchecked(layer, kwargs) == named, kwargs
        verdicts.add(named is None)
    assert verdicts == {True, False}  # both kinds of schedule were drawn


def test_a_progress_driven_schedule_is_checked_at_every_progress():
    """Without total_steps the updates come at any progress: a refused schedule fails when two updates come close
    together at the progress it names; an accepted one survives such pairs anywhere."""
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    layer = SparseLinear(10, 10, density=0.3, generator=g)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    kwargs = dict(prune_every=1, total_steps=None, drop_fraction=0.6, grow_to=0.9, grow_until=0.5)
    with pytest.raises(ValueError, match=r"an update at progress ([0-9.]+) .*every progress up to stop_fraction"
                       ) as info:
        DynamicSparsity([layer], opt, **kwargs)
    at = float(re.search(r"an update at progress ([0-9.]+)", str(info.value)).group(1))
    assert _run_unchecked(copy.deepcopy(layer), kwargs, [at + 1e-4, at + 2e-4]) is not None
    kwargs["drop_fraction"] = 0.25  # accepted: any increasing progress keeps within the budget
    DynamicSparsity([layer], opt, **kwargs)
    for _ in range(5):
        points = sorted(float(t) for t in torch.rand(6, generator=g) * 0.8)
        assert _run_unchecked(copy.deepcopy(layer), kwargs, [p for t in points for p in (t, t + 1e-6)]) is None


def test_the_edge_budget_check_of_a_long_run_names_its_first_failing_update():
    """A run of 10^12 updates is searched, not walked: the update named is the first whose counts break the budget."""
    layer = SparseLinear(64, 64, density=0.2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    kwargs = dict(prune_every=1, total_steps=10**12, grow_to=0.95, drop_fraction=0.4)
    with pytest.raises(ValueError, match=r"its update at step (\d+)") as info:
        DynamicSparsity([layer], opt, **kwargs)
    step = int(re.search(r"its update at step (\d+)", str(info.value)).group(1))
    original = DynamicSparsity._check_edge_budget
    DynamicSparsity._check_edge_budget = lambda *args: None
    try:
        evo = DynamicSparsity([layer], opt, **kwargs)
    finally:
        DynamicSparsity._check_edge_budget = original

    def needs(s):  # edges after update s plus the edges it drops, from the schedule's own formulas
        before = evo.target_nnz(0, (s - 1) / 10**12)
        return evo.target_nnz(0, s / 10**12) + evo._drop(0, s / 10**12, before)

    assert 10**6 < step < 10**12 and needs(step) > 64 * 64 >= needs(step - 1)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("grow", [4, 7])
def test_an_update_under_inference_mode_leaves_a_layer_and_optimizer_that_train(in_place, grow):
    """The update's new weight and optimizer state are made outside inference_mode: autograd can save the weight
    for backward (gradients as float64 dense math gives them) and the optimizer can update its state in place."""
    layer, opt = _trained("cpu")
    with torch.inference_mode():
        plan = plan_update(layer, 4, grow, generator=torch.Generator().manual_seed(3))
        apply_update(layer, *plan, [opt], in_place=in_place)
    state = [v for v in opt.state[layer.weight].values() if isinstance(v, torch.Tensor)]
    assert not layer.weight.is_inference() and not any(v.is_inference() for v in state)
    x = torch.randn(16, layer.in_features)
    layer(x).square().mean().backward()
    dense = layer.to_dense().detach().double().requires_grad_()
    (x.double() @ dense.T + layer.bias.detach().double()).square().mean().backward()
    want = dense.grad[layer.dst.long(), layer.src.long()]
    torch.testing.assert_close(layer.weight.grad.double(), want, rtol=1e-5, atol=1e-7)
    before = layer.weight.detach().clone()
    opt.step()
    assert not torch.equal(layer.weight.detach(), before)
