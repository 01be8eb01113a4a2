"""Copies of evolving layers (AveragedModel / EMA) follow each topology update or stop it; optimizers whose state is
not per edge are refused; a grown ``grow_to`` schedule resumes in the documented order."""

import copy

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from torch_sparse_metal import CSRTopology, SparseLinear
from torch_sparse_metal.evolve import DynamicSparsity, apply_update, plan_update


def _model(seed, in_f=24, hidden=40, out_f=12, density=0.25):
    gen = torch.Generator().manual_seed(seed)
    return nn.Sequential(SparseLinear(in_f, hidden, density=density, generator=gen), nn.Tanh(),
                         SparseLinear(hidden, out_f, density=density, generator=gen))


def _keys(layer):
    return set((layer.src.long() * layer.out_features + layer.dst.long()).tolist())


def _dense_twin(model):
    """An nn.Linear model computing the same function, for an EMA over (output, input) coordinates."""
    twin = nn.Sequential(*(nn.Linear(m.in_features, m.out_features) if isinstance(m, SparseLinear) else m
                           for m in model))
    _mirror(twin, model)
    return twin


def _mirror(twin, model):
    with torch.no_grad():
        for dense, sparse in zip(twin, model):
            if isinstance(sparse, SparseLinear):
                dense.weight.copy_(sparse.to_dense())
                dense.bias.copy_(sparse.bias)


@pytest.mark.parametrize(("mode", "grow_to", "use_buffers"), [("set", None, False), ("rigl", None, True),
                                                              ("rigl", 0.45, False), ("set", 0.45, True)])
def test_ema_of_unchanged_connections_equals_dense_twin_ema(mode, grow_to, use_buffers):
    torch.manual_seed(1)
    model = _model(seed=int(torch.randint(0, 1000, ())))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.8), use_buffers=use_buffers)
    evo = DynamicSparsity(model, opt, prune_every=3, total_steps=24, drop_fraction=0.4, mode=mode, grow_to=grow_to,
                          generator=torch.Generator().manual_seed(2), followers=[ema])
    twin = _dense_twin(model)
    ema_dense = AveragedModel(twin, multi_avg_fn=get_ema_multi_avg_fn(0.8), use_buffers=use_buffers)
    layers = [model[0], model[2]]
    unchanged = [_keys(layer) for layer in layers]
    start = [set(k) for k in unchanged]
    updates = 0
    for _ in range(24):
        model(torch.randn(16, 24)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if evo.step():
            updates += 1
            unchanged = [u & _keys(layer) for u, layer in zip(unchanged, layers)]
        ema.update_parameters(model)
        _mirror(twin, model)
        ema_dense.update_parameters(twin)
    assert updates >= 5
    for i, layer in enumerate(layers):
        follower, dense = ema.module[2 * i], ema_dense.module[2 * i]
        assert torch.equal(follower.dst, layer.dst) and torch.equal(follower.row_ptr, layer.row_ptr)
        assert 0 < len(unchanged[i]) < len(start[i])  # some connections changed, some never did
        keys = (follower.src.long() * follower.out_features + follower.dst.long()).tolist()
        stay = torch.tensor([k in unchanged[i] for k in keys])
        expected = dense.weight.detach()[follower.dst.long(), follower.src.long()]
        assert torch.equal(follower.weight.detach()[stay], expected[stay])
        assert torch.equal(follower.bias.detach(), dense.bias.detach())
    # the averaged model computes: same edges as the model, values of the dense EMA on its kept connections
    assert torch.isfinite(ema(torch.randn(4, 24))).all()


def _state(model, opt):
    return copy.deepcopy(model.state_dict()), str(opt.state_dict())


def _same(a, b):
    return a[1] == b[1] and a[0].keys() == b[0].keys() and all(
        torch.equal(a[0][k], b[0][k]) for k in a[0] if torch.is_tensor(a[0][k]))


def _trained(seed=0):
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 24)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("make", [lambda m: AveragedModel(m), copy.deepcopy], ids=["AveragedModel", "deepcopy"])
def test_unregistered_copy_refuses_update_and_changes_nothing(make):
    model, opt = _trained()
    held = make(model)
    evo = DynamicSparsity(model, opt, prune_every=1, total_steps=5, generator=torch.Generator().manual_seed(0))
    before, copy_before = _state(model, opt), copy.deepcopy(held.state_dict())
    with pytest.raises(ValueError, match="register_follower"):
        evo.step()
    assert _same(before, _state(model, opt))
    assert all(torch.equal(v, held.state_dict()[k]) for k, v in copy_before.items())
    evo.register_follower(held)
    assert evo.step()  # now remapped with the update
    copies = [m for m in held.modules() if isinstance(m, SparseLinear)]
    assert len(copies) == 2
    assert all(torch.equal(getattr(c, n), getattr(m, n)) for c, m in zip(copies, (model[0], model[2]))
               for n in ("row_ptr", "dst"))


def test_left_behind_snapshot_keeps_its_topology():
    model, opt = _trained()
    snapshot = copy.deepcopy(model)
    kept = copy.deepcopy(snapshot.state_dict())
    evo = DynamicSparsity(model, opt, prune_every=1, total_steps=5, generator=torch.Generator().manual_seed(0))
    evo.leave_behind(snapshot)
    assert evo.step()
    assert all(torch.equal(v, snapshot.state_dict()[k]) for k, v in kept.items())
    assert not torch.equal(snapshot[0].dst, model[0].dst)


def test_twin_schedules_on_copies_run_independently():
    model, opt = _trained()
    twin = copy.deepcopy(model)
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    evo = DynamicSparsity(model, opt, prune_every=1, total_steps=5, generator=torch.Generator().manual_seed(0))
    twin_evo = DynamicSparsity(twin, twin_opt, prune_every=1, total_steps=5, generator=torch.Generator().manual_seed(0))
    assert evo.step() and twin_evo.step()
    assert torch.equal(model[0].dst, twin[0].dst)  # the same seed, the same update


def test_follower_registration_is_checked():
    model, opt = _trained()
    evo = DynamicSparsity(model, opt, prune_every=1, total_steps=5, generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="holds no deep copy"):
        evo.register_follower(_model(seed=5))
    with pytest.raises(TypeError, match="nn.Module"):
        evo.register_follower(model.state_dict())
    stale = AveragedModel(model)
    evo.leave_behind(stale)
    assert evo.step()
    with pytest.raises(ValueError, match="connections differ"):
        evo.register_follower(stale)


def test_lbfgs_is_refused_when_the_schedule_is_built():
    model, _ = _trained()
    lbfgs = torch.optim.LBFGS(model.parameters())
    with pytest.raises(ValueError, match="LBFGS keeps its curvature history"):
        DynamicSparsity(model, lbfgs, prune_every=1, total_steps=5)
    plan = plan_update(model[0], 4, 4, generator=torch.Generator().manual_seed(0))
    dst = model[0].dst.clone()
    with pytest.raises(ValueError, match="LBFGS"):
        apply_update(model[0], *plan, [lbfgs])
    assert torch.equal(model[0].dst, dst)


def test_state_that_is_not_per_edge_is_refused_before_any_change():
    model, opt = _trained()
    opt.state[model[2].weight]["flat_history"] = torch.zeros(7)  # what an optimizer with flattened state keeps
    evo = DynamicSparsity(model, opt, prune_every=1, total_steps=5, generator=torch.Generator().manual_seed(0))
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match="'flat_history' of shape \\(7,\\)"):
        evo.step()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # layer 0 unchanged too


GROW_TO = 0.4


def _grow_run(steps, path, resume_at=None):
    """A grow_to run whose layers' final counts round above GROW_TO of their connections; resumed in the order
    docs/distributed.md gives: model state, optimizer over the loaded parameters and its state, then the schedule
    built and its state loaded."""
    model = _model(seed=0, in_f=24, hidden=31, out_f=7, density=0.2)
    for layer in (model[0], model[2]):  # the precondition of the case: the schedule's rounding lands above grow_to
        total = layer.in_features * layer.out_features
        assert round(GROW_TO * total) > GROW_TO * total
    data = torch.Generator().manual_seed(3)
    start = 0
    if resume_at is not None:
        state = torch.load(path)
        model.load_state_dict(state["model"])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt.load_state_dict(state["opt"])
        evo = DynamicSparsity(model, opt, prune_every=2, total_steps=steps, grow_to=GROW_TO, grow_until=0.3,
                              generator=torch.Generator().manual_seed(2))
        evo.load_state_dict(state["evo"])
        data.set_state(state["data"])
        start = resume_at
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        evo = DynamicSparsity(model, opt, prune_every=2, total_steps=steps, grow_to=GROW_TO, grow_until=0.3,
                              generator=torch.Generator().manual_seed(2))
    for step in range(start, steps):
        model(torch.randn(8, 24, generator=data)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        evo.step()
        if resume_at is None and step + 1 == steps // 2:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "evo": evo.state_dict(),
                        "data": data.get_state()}, path)
    return model


def test_grow_to_resumes_after_growth_in_the_documented_order(tmp_path):
    path = tmp_path / "ckpt.pt"
    straight = _grow_run(20, path)
    for layer in (straight[0], straight[2]):
        assert layer.nnz == round(GROW_TO * layer.in_features * layer.out_features) and layer.density > GROW_TO
    resumed = _grow_run(20, path, resume_at=10)
    for (k, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        if torch.is_tensor(a):
            assert torch.equal(a, b), k


@pytest.mark.parametrize("accumulate", [1, 3])
def test_rigl_grows_by_the_gradient_summed_over_the_last_steps(accumulate):
    """The grown edges are the top of |sum over the last N steps of the dense weight gradient| among absent edges,
    the dense gradient taken from an nn.Linear twin holding the layer's dense weights at each step."""
    torch.manual_seed(accumulate)
    layer = SparseLinear(20, 24, density=0.2, generator=torch.Generator().manual_seed(4))
    opt = torch.optim.SGD(layer.parameters(), lr=0.05)
    evo = DynamicSparsity([layer], opt, prune_every=5, total_steps=20, drop_fraction=0.3, mode="rigl",
                          grad_accumulation=accumulate)
    twin = nn.Linear(20, 24, bias=True)
    summed = torch.zeros(24, 20, dtype=torch.float64)
    for step in range(1, 6):
        x = torch.randn(7, 20)
        with torch.no_grad():
            twin.weight.copy_(layer.to_dense())
            twin.bias.copy_(layer.bias)
        twin(x).square().mean().backward()
        if step > 5 - accumulate:
            summed += twin.weight.grad.double()
        twin.zero_grad()
        assert evo.records_next_step == (step > 5 - accumulate)  # this step is one of the last N before the update
        before = _keys(layer)
        layer(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        updated = evo.step()
    assert updated and evo.steps == 5
    grown = _keys(layer) - before
    absent = torch.ones(24, 20, dtype=torch.bool)
    for key in before:
        absent[key % 24, key // 24] = False
    scores = torch.where(absent, summed.abs(), torch.tensor(-1.0, dtype=torch.float64))
    ranked = scores.flatten().sort(descending=True).values
    k = len(grown)
    assert k == round(evo.drop_fraction_at(5 / 20) * 96)  # as many grown as dropped
    got = torch.tensor([float(scores[key % 24, key // 24]) for key in grown], dtype=torch.float64)
    tol = 1e-5 * float(ranked[0])
    assert float(got.min()) >= float(ranked[k]) - tol  # every grown edge is among the top k (float32 rounding)
    assert float(got.sum()) >= float(ranked[:k].sum()) - k * tol


def test_grad_accumulation_is_checked():
    model, opt = _trained()
    with pytest.raises(ValueError, match="grad_accumulation must be an integer >= 1"):
        DynamicSparsity(model, opt, total_steps=5, mode="rigl", grad_accumulation=0)


# ------------------------------------------------------------- AveragedModel(use_buffers=True): indices copied
def _bn_model(block: int) -> nn.Module:
    return nn.Sequential(SparseLinear(24, 16, density=0.4, block=block, dtype=torch.float64), nn.BatchNorm1d(16,
                         dtype=torch.float64), nn.ReLU(), SparseLinear(16, 8, density=0.5, dtype=torch.float64))


@pytest.mark.parametrize("block", [1, 8])
@pytest.mark.parametrize("average", ["swa", "ema"])
def test_averaged_model_with_buffers_copies_the_index_buffers_and_averages_the_rest(average, block):
    """With use_buffers=True the layers' int32 index buffers are copied from the model exactly (torch would average
    them in floating point and truncate), while weights, biases and the other buffers (BatchNorm's statistics) are
    averaged as torch averages them: checked against the average computed here in float64, and the averaged model
    against dense products of the averaged values."""
    torch.manual_seed(int(torch.randint(2**31, (1,))))
    model = _bn_model(block)
    kwargs = {"multi_avg_fn": get_ema_multi_avg_fn(0.9)} if average == "ema" else {}
    averaged = AveragedModel(model, use_buffers=True, **kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = None
    for step in range(5):
        model(torch.randn(32, 24, dtype=torch.float64)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        averaged.update_parameters(model)
        now = [t.detach().clone() for t in (*model.parameters(), model[1].running_mean, model[1].running_var)]
        if expected is None:
            expected = now
        elif average == "ema":
            expected = [0.9 * e + 0.1 * n for e, n in zip(expected, now)]
        else:
            expected = [e + (n - e) / (step + 1) for e, n in zip(expected, now)]
    got = [t.detach() for t in (*averaged.module.parameters(), averaged.module[1].running_mean,
                                averaged.module[1].running_var)]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)
    for mine, theirs in ((averaged.module[0], model[0]), (averaged.module[3], model[3])):
        integer = {name for name, b in mine.named_buffers() if not b.is_floating_point()}
        assert set(mine._index_buffers()) < integer, "the index buffers and the shape record"
        for name in integer:
            assert mine._buffers[name].dtype == theirs._buffers[name].dtype != torch.float32
            assert torch.equal(mine._buffers[name], theirs._buffers[name]), name
    x = torch.randn(6, 24, dtype=torch.float64)
    averaged.eval()
    first, bn, second = averaged.module[0], averaged.module[1], averaged.module[3]
    h = torch.relu(bn(x @ first.to_dense().T + first.bias))
    torch.testing.assert_close(averaged(x), h @ second.to_dense().T + second.bias, rtol=1e-12, atol=1e-12)


def test_averaged_model_with_buffers_keeps_indices_above_2_to_the_24_exact():
    """Input indices above 2**24, which float32 cannot all hold: torch's average would round them (and the layer
    would read other inputs, or refuse its own topology); they are copied instead."""
    in_features = 2**24 + 9
    src = torch.tensor([in_features - 1, in_features - 2, 2**24 + 1, 3, 2**24 + 3])
    dst = torch.tensor([0, 1, 1, 0, 1])
    layer = SparseLinear.from_topology(CSRTopology.from_indices(torch.stack([dst, src]), in_features, 2)[0])
    model = nn.Sequential(layer)
    averaged = AveragedModel(model, use_buffers=True)
    for _ in range(3):
        with torch.no_grad():
            layer.weight.add_(torch.randn(layer.nnz))
        averaged.update_parameters(model)
    copy_ = averaged.module[0]
    assert torch.equal(copy_.src, layer.src) and torch.equal(copy_.src_by_dst, layer.src_by_dst)
    x = torch.zeros(1, in_features)
    x[0, src] = torch.randn(5)
    w = copy_.weight.detach().double()
    expected = torch.zeros(2, dtype=torch.float64).index_add_(0, copy_.dst.long(), w * x[0, copy_.src.long()].double())
    torch.testing.assert_close(averaged(x)[0].double(), expected + copy_.bias.detach().double(), rtol=1e-6, atol=1e-6)


def test_averaged_model_with_buffers_refuses_a_layer_of_another_topology():
    model = nn.Sequential(SparseLinear(24, 16, density=0.4))
    averaged = AveragedModel(model, use_buffers=True)
    averaged.update_parameters(model)
    before = copy.deepcopy(averaged.state_dict())
    other = nn.Sequential(SparseLinear(24, 16, density=0.2))
    with pytest.raises(ValueError, match=r"pairs a SparseLinear copy with a layer of another topology.*Nothing was "
                                         r"changed"):
        averaged.update_parameters(other)
    after = averaged.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


# ---------------------------------------------------------------------- several optimizers over one weight
def _by_connection(layer, values):
    """Per-edge values keyed by (output, input) connection."""
    return dict(zip(zip(layer.dst.tolist(), layer.src.tolist()), values.tolist()))


def test_every_optimizer_given_to_the_schedule_has_its_state_carried_by_connection():
    """Two optimizers over the same weights (a list): each update carries both optimizers' per-edge state with the
    connections that survive, and starts grown ones at 0, for both."""
    model = _model(seed=int(torch.randint(0, 1000, ())))
    first = torch.optim.AdamW(model.parameters(), lr=1e-2)
    second = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    evo = DynamicSparsity(model, [first, second], prune_every=2, total_steps=12, drop_fraction=0.4,
                          generator=torch.Generator().manual_seed(3))
    assert evo.optimizers == [first, second]
    layer, updates = model[0], 0
    for _ in range(8):
        model(torch.randn(16, 24)).square().mean().backward()
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
        before = [_by_connection(layer, opt.state[layer.weight][key])
                  for opt, key in ((first, "exp_avg"), (second, "momentum_buffer"))]
        if not evo.step():
            continue
        updates += 1
        for old, (opt, key) in zip(before, ((first, "exp_avg"), (second, "momentum_buffer"))):
            now = _by_connection(layer, opt.state[layer.weight][key])
            assert now.keys() == _by_connection(layer, layer.weight.detach()).keys()
            for connection, value in now.items():
                assert value == old.get(connection, 0.0)
    assert updates >= 3


def test_a_step_of_an_optimizer_the_update_was_not_given_is_refused_before_it_changes_anything():
    """A second optimizer holding the weight but not given to the update keeps its moments on the old edge order:
    its next step raises before changing anything; without that state (as the message says) it steps."""
    layer = SparseLinear(16, 8, density=0.5)
    given, other = torch.optim.AdamW(layer.parameters(), lr=1e-2), torch.optim.AdamW([layer.weight], lr=1e-2)
    for opt in (given, other):
        layer(torch.randn(4, 16)).square().mean().backward()
        opt.step()
        layer.zero_grad()
    apply_update(layer, *plan_update(layer, 8, 8, generator=torch.Generator().manual_seed(0)), [given])
    layer(torch.randn(4, 16)).square().mean().backward()
    given.step()  # the optimizer the update was given steps
    weight, state = layer.weight.detach().clone(), copy.deepcopy(other.state[layer.weight])
    with pytest.raises(RuntimeError, match=r"AdamW holds per-edge state \('exp_avg', 'exp_avg_sq'\) of a SparseLinear "
                                           r"weight whose edges a topology update reordered.*The step did not run"):
        other.step()
    assert torch.equal(layer.weight.detach(), weight)
    assert all(torch.equal(state[k], v) for k, v in other.state[layer.weight].items())
    other.state.pop(layer.weight)
    other.step()  # fresh state, on the new edges
    assert not torch.equal(layer.weight.detach(), weight)
    other.step()  # and from then on it is one of the weight's optimizers


def test_the_optimizer_list_is_checked():
    model = _model(seed=0)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="optimizer is an empty list"):
        DynamicSparsity(model, [], total_steps=10)
    with pytest.raises(ValueError, match="lists one optimizer twice"):
        DynamicSparsity(model, [opt, opt], total_steps=10)
    with pytest.raises(ValueError, match="is trainable but not in the optimizer"):
        DynamicSparsity(model, [torch.optim.AdamW(model[0].parameters())], total_steps=10)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer"):
        DynamicSparsity(model, [opt, "sgd"], total_steps=10)
