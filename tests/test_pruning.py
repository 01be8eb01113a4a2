"""Gradual magnitude pruning: edge counts on the cubic schedule, magnitude choice, state carried, refusals."""

import copy

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from torch_sparse_metal import SparseLinear, sparsify
from torch_sparse_metal.convert import sparsify_densities
from torch_sparse_metal.pruning import GradualPruning


def _keys(layer):
    return (layer.src.long() * layer.out_features + layer.dst.long()).tolist()


def _model(seed, density=1.0, block=1):
    torch.manual_seed(seed)
    dense = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 16))
    return sparsify(dense, density=density, block=block)


def _train_step(model, opt, gen):
    model(torch.randn(8, 24, generator=gen)).square().mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("power", [3, 1])
def test_edge_counts_follow_the_polynomial_and_keep_the_largest(seed, power):
    gen = torch.Generator().manual_seed(seed)
    start_density = [1.0, 0.7][seed % 2]
    model = _model(seed, start_density)
    layers = [model[0], model[2]]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    start, every = int(torch.randint(0, 4, (), generator=gen)), int(torch.randint(1, 4, (), generator=gen))
    end = start + int(torch.randint(3, 12, (), generator=gen))
    final = 0.02 + 0.4 * float(torch.rand((), generator=gen))
    gmp = GradualPruning(model, opt, final_density=final, start_step=start, end_step=end, prune_every=every,
                         power=power)
    n_i = [layer.nnz for layer in layers]
    n_f = [round(final * layer.in_features * layer.out_features) for layer in layers]
    counts = list(n_i)
    for t in range(1, end + 4):
        _train_step(model, opt, gen)
        before_w = [dict(zip(_keys(layer), layer.weight.detach().clone())) for layer in layers]
        before_m = [dict(zip(_keys(layer), opt.state[layer.weight]["exp_avg_sq"].clone())) for layer in layers]
        gmp.step()
        if start <= t <= end and ((t - start) % every == 0 or t == end):  # Zhu & Gupta's update steps, and the end
            p = (t - start) / (end - start)
            counts = [round(f + (i - f) * (1 - p) ** power) for i, f in zip(n_i, n_f)]
        for layer, count, w, m in zip(layers, counts, before_w, before_m):
            assert layer.nnz == count, t
            kept = _keys(layer)
            assert set(kept) <= set(w)  # nothing grown
            mags = torch.stack(list(w.values())).abs().sort(descending=True).values
            if count < len(w):  # the survivors are the largest in magnitude
                assert min(abs(float(w[k])) for k in kept) >= float(mags[count])
            assert torch.equal(layer.weight.detach(), torch.stack([w[k] for k in kept]))
            assert torch.equal(opt.state[layer.weight]["exp_avg_sq"], torch.stack([m[k] for k in kept]))
    assert counts == n_f


def test_vector_layers_prune_whole_vectors():
    model = _model(0, 1.0, block=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gmp = GradualPruning(model, opt, final_density=0.1, end_step=6, prune_every=2)
    gen = torch.Generator().manual_seed(0)
    for t in range(1, 8):
        _train_step(model, opt, gen)
        gmp.step()
        for i, layer in enumerate((model[0], model[2])):
            assert layer.nnz % 8 == 0 and layer.nnz == gmp.target_nnz(i, min(t - t % 2, 6))
    assert model[0].nnz == 8 * round(0.1 * 24 * 48 / 8)


def test_erk_final_densities_by_name_and_an_ema_that_follows():
    torch.manual_seed(1)
    dense = nn.Sequential(nn.Linear(24, 48), nn.ReLU(), nn.Linear(48, 16))
    final = sparsify_densities(dense, 0.1, distribution="erk")  # the final shares, from the dense model
    model = sparsify(dense, density=1.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ema = AveragedModel(model)
    gmp = GradualPruning(model, opt, final_density=final, end_step=4, prune_every=1, followers=[ema])
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        _train_step(model, opt, gen)
        gmp.step()
        ema.update_parameters(model)
    assert model[0].nnz + model[2].nnz == round(0.1 * (24 * 48 + 48 * 16))
    assert torch.equal(ema.module[0].dst, model[0].dst) and torch.equal(ema.module[2].dst, model[2].dst)


def test_resume_continues_exactly(tmp_path):
    def run(resume):
        model = _model(2)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(5)
        if resume is not None:
            model.load_state_dict(resume["model"])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            opt.load_state_dict(resume["opt"])
            gen.set_state(resume["gen"])
        gmp = GradualPruning(model, opt, final_density=0.1, start_step=1, end_step=9, prune_every=2)
        if resume is not None:
            gmp.load_state_dict(resume["gmp"])
        saved = None
        for _ in range(gmp.steps, 10):
            _train_step(model, opt, gen)
            gmp.step()
            if gmp.steps == 4:
                saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                                       "gmp": gmp.state_dict()})
        return model, saved

    straight, saved = run(None)
    resumed, _ = run(saved)
    for (k, a), (_, b) in zip(straight.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(final_density=0.9), "above its current density"),
    (dict(final_density={"0": 0.1}), "no entry for \\['2'\\]"),
    (dict(final_density=1.5), "final_density must be in"),
    (dict(final_density=0.1, start_step=5, end_step=3), "end_step must be an integer >= 5"),
    (dict(final_density=0.1, power=0), "power must be"),
])
def test_bad_schedules_are_refused(kwargs, message):
    model = _model(3, 0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=message):
        GradualPruning(model, opt, **{"end_step": 10, **kwargs})


def test_lbfgs_and_unregistered_copies_are_refused():
    model = _model(3)
    with pytest.raises(ValueError, match="LBFGS"):
        GradualPruning(model, torch.optim.LBFGS(model.parameters()), final_density=0.1, end_step=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gmp = GradualPruning(model, opt, final_density=0.1, end_step=2, prune_every=1)
    held = copy.deepcopy(model)
    nnz = [model[0].nnz, model[2].nnz]
    with pytest.raises(ValueError, match="register_follower"):
        gmp.step()
    assert [model[0].nnz, model[2].nnz] == nnz
    del held
    assert gmp.update()
    assert isinstance(model[0], SparseLinear) and model[0].nnz < nnz[0]
