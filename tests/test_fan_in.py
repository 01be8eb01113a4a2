"""Constant fan-in (SRigL): construction, updates, ablation, checkpoints, refusals; SµPar's scaling rules."""

import copy
import io
import math

import pytest
import torch
from torch import nn

from torch_sparse_metal import CSRTopology, SparseLinear, load_sparse_checkpoint, sparsify
from torch_sparse_metal.evolve import DynamicSparsity, apply_update, plan_update
from torch_sparse_metal.fan_in import plan_fan_in_update
from torch_sparse_metal.pruning import GradualPruning
from torch_sparse_metal.scaling import density_param_groups, sparse_init_std, sparse_lr_scale


def _train(layer, opt, evo, steps, in_f, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        layer(torch.randn(8, in_f, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if evo.step():
            yield


@pytest.mark.parametrize("seed", range(6))
def test_random_constructor_gives_every_output_the_same_in_degree(seed):
    g = torch.Generator().manual_seed(seed)
    in_f, out_f = int(torch.randint(1, 60, (1,), generator=g)), int(torch.randint(1, 40, (1,), generator=g))
    density = float(torch.rand(1, generator=g))
    layer = SparseLinear(in_f, out_f, density=density, constant_fan_in=True, generator=g)
    dense = layer.to_dense() != 0
    assert dense.sum(1).tolist() == [round(density * in_f)] * out_f  # independent count from the dense matrix
    assert layer.nnz == out_f * round(density * in_f) and layer.constant_fan_in


def test_top_per_output_keeps_the_largest_weights_of_each_output():
    w = torch.randn(13, 29, dtype=torch.float64)
    topo = CSRTopology.top_per_output(w.abs(), 5)
    mask = topo.to_sparse_csr(torch.ones(topo.nnz)).to_dense() != 0
    for o in range(13):
        assert set(torch.nonzero(mask[o]).flatten().tolist()) == set(w[o].abs().topk(5).indices.tolist())


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("mode", ["set", "rigl"])
def test_updates_keep_each_outputs_in_degree(seed, mode):
    torch.manual_seed(seed)
    layer = SparseLinear(48, 20, density=0.25, constant_fan_in=True)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    evo = DynamicSparsity([layer], opt, prune_every=2, total_steps=20, drop_fraction=0.5, mode=mode,
                          generator=torch.Generator().manual_seed(seed))
    updates = 0
    for _ in _train(layer, opt, evo, 14, 48, seed):
        updates += 1
        outputs = layer.indices()[0]  # counted from the public [out, in] indices
        assert torch.bincount(outputs, minlength=20).tolist() == [12] * 20
    assert updates >= 5 and layer.constant_fan_in


@pytest.mark.parametrize("seed", range(5))
def test_each_output_keeps_its_largest_weights_and_their_values(seed):
    torch.manual_seed(seed)
    layer = SparseLinear(30, 9, density=0.3, constant_fan_in=True)
    old = layer.to_dense().detach().clone()
    topology, edge_map, _ = plan_fan_in_update(layer, 3, generator=torch.Generator().manual_seed(seed))
    apply_update(layer, topology, edge_map)
    new = layer.to_dense().detach()
    assert torch.bincount(layer.indices()[0], minlength=9).tolist() == [9] * 9
    for o in range(9):
        want = set(old[o].abs().topk(6).indices.tolist())  # 9 edges, 3 dropped: the 6 largest survive
        kept = {i for i in range(30) if new[o, i] != 0}
        assert kept == want and torch.equal(new[o][list(want)], old[o][list(want)])


def test_rigl_regrows_each_outputs_largest_dense_gradient():
    torch.manual_seed(0)
    layer = SparseLinear(24, 6, density=0.25, constant_fan_in=True)
    x, grad_out = torch.randn(16, 24), torch.randn(16, 6)
    topology, edge_map, _ = plan_fan_in_update(layer, 2, mode="rigl", grad=(x, grad_out))
    dense_grad = (grad_out.double().t() @ x.double()).abs()
    present = layer.to_dense() != 0
    grown = topology.indices()[:, edge_map.grown]
    for o in range(6):
        ins = grown[1][grown[0] == o]
        candidates = dense_grad[o].masked_fill(present[o], -1)
        assert set(ins.tolist()) == set(candidates.topk(2).indices.tolist())


@pytest.mark.parametrize("seed", range(4))
def test_ablation_counts_and_total(seed):
    torch.manual_seed(seed)
    layer = SparseLinear(40, 16, density=0.2, constant_fan_in=True)
    total = layer.nnz
    w = layer.weight.detach().abs()
    drop = 4
    # independent count of salient weights: edges among the layer's nnz - D largest magnitudes (SET: no gradient)
    survivors = torch.zeros(layer.nnz, dtype=torch.bool)
    survivors[w.argsort(descending=True)[: layer.nnz - drop * 16]] = True
    salient = torch.zeros(16, dtype=torch.long).index_add_(0, layer.topology.dst.long(), survivors.long())
    topology, edge_map, report = plan_fan_in_update(layer, drop, min_salient=3, total=total,
                                                    generator=torch.Generator().manual_seed(seed))
    need = math.ceil(total / (40 - drop))
    expect_active = max(int((salient >= 3).sum()), need)
    assert report.active == expect_active
    if int((salient >= 3).sum()) >= need:  # enough qualify: exactly the outputs short of min_salient are ablated
        assert report.ablated == torch.nonzero(salient < 3).flatten().tolist()
    fan = topology.fan_in()
    assert report.fan_in == total // expect_active
    assert sorted(set(fan.tolist()) - {0}) == [report.fan_in] and int((fan > 0).sum()) == expect_active
    assert total - expect_active < topology.nnz <= total
    assert all(int(fan[o]) == 0 for o in report.ablated)


def test_ablation_through_the_schedule_keeps_constant_fan_in():
    torch.manual_seed(1)
    layer = SparseLinear(40, 16, density=0.2, constant_fan_in=True)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    evo = DynamicSparsity([layer], opt, prune_every=2, total_steps=20, drop_fraction=0.5, mode="rigl", min_salient=3)
    for _ in _train(layer, opt, evo, 14, 40, 1):
        assert layer.topology.common_fan_in() is not None
        assert layer.nnz > 128 - 16 and layer.nnz <= 128
    assert evo.fan_in_reports


def test_gradual_pruning_prunes_whole_rows_per_output():
    torch.manual_seed(0)
    layer = SparseLinear(32, 8, density=1.0, constant_fan_in=True)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    gmp = GradualPruning([layer], opt, final_density=0.1, start_step=2, end_step=8, prune_every=2)
    for _ in range(10):
        layer(torch.randn(4, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        gmp.step()
        assert len(set(layer.fan_in().tolist())) == 1
    assert layer.fan_in().tolist() == [3] * 8  # 8 * round(round(0.1 * 256) / 8)


def test_checkpoint_round_trip_keeps_the_property():
    layer = SparseLinear(20, 6, density=0.3, constant_fan_in=True)
    state = layer.state_dict()
    assert state["_extra_state"].tolist() == [3, 20, 6, 1, 1]
    other = SparseLinear(20, 6, density=0.5)
    other.load_state_dict(state)
    assert other.constant_fan_in and torch.equal(other.to_dense(), layer.to_dense())
    plain = SparseLinear(20, 6, density=0.5)
    layer.load_state_dict(plain.state_dict())
    assert not layer.constant_fan_in


def test_refusals_of_inconsistent_inputs():
    uneven = CSRTopology.from_mask(torch.tensor([[True, True, False], [True, False, False]]))
    with pytest.raises(ValueError, match="not of constant fan-in"):
        SparseLinear.from_topology(uneven, constant_fan_in=True)
    with pytest.raises(TypeError, match="constant_fan_in must be a bool"):
        SparseLinear(16, 16, density=0.5, block=8, constant_fan_in=1)
    layer = SparseLinear(20, 6, density=0.3, constant_fan_in=True)
    state = layer.state_dict()
    uneven_layer = SparseLinear.from_topology(CSRTopology.from_mask(torch.eye(6, 20, dtype=torch.bool) | (
        torch.arange(20) < 2)[None, :].expand(6, -1).clone().index_fill_(0, torch.tensor([1, 2, 3, 4, 5]), False)))
    bad = dict(state, **{k: v for k, v in uneven_layer.state_dict().items() if k != "_extra_state"})
    target = SparseLinear(20, 6, density=0.3, constant_fan_in=True)
    keep = target.to_dense().clone()
    # an uneven topology saved as constant fan-in: refused, and the layer is left as it was
    with pytest.raises(RuntimeError, match="not of constant fan-in"):
        target.load_state_dict(bad)
    assert torch.equal(target.to_dense(), keep) and target.constant_fan_in
    plan = plan_update(layer, 5, 3)  # an unstructured plan would break the property
    with pytest.raises(ValueError, match="constant fan-in"):
        apply_update(layer, *plan)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="grow_to"):
        DynamicSparsity([layer], opt, total_steps=10, grow_to=0.5)
    with pytest.raises(ValueError, match="min_salient"):
        DynamicSparsity([SparseLinear(8, 8, density=0.5)], opt, total_steps=10, min_salient=2)
    full = SparseLinear(10, 4, density=0.9, constant_fan_in=True)
    with pytest.raises(ValueError, match="cannot keep the fan-in"):
        DynamicSparsity([full], torch.optim.SGD(full.parameters(), lr=0.1), total_steps=10, prune_every=1,
                        drop_fraction=0.5)
    with pytest.raises(ValueError, match="constant fan-in"):
        sparsify(nn.Linear(3, 2), masks={"": uneven.to_sparse_csr(torch.ones(3)).to_dense() != 0},
                 constant_fan_in=True)


@pytest.mark.parametrize("block", (1, 8))
@pytest.mark.parametrize("drop_fraction", (0.3, 0.9))
def test_schedule_on_a_meta_layer_decides_as_on_the_materialized_one(drop_fraction, block):
    """A constant fan-in layer built on the meta device (no indices to count yet) gets the fan-in budget verdict of
    the same layer materialized: accepted at drop 0.3 (fan-in 38 of 64: 11 dropped, 26 absent to regrow into),
    refused at 0.9 (34 dropped)."""
    verdicts = []
    for device in ("meta", "cpu"):
        with torch.device(device):
            layer = SparseLinear(64, 16, density=0.6, constant_fan_in=True, block=block)
        try:
            DynamicSparsity([layer], torch.optim.SGD(layer.parameters(), lr=0.1), total_steps=10, prune_every=1,
                            drop_fraction=drop_fraction, mode="rigl")
            verdicts.append("accepted")
        except ValueError as e:
            assert "cannot keep the fan-in" in str(e) and "constant fan-in 38 of 64" in str(e)
            verdicts.append("refused")
    assert verdicts == ["accepted"] * 2 if drop_fraction == 0.3 else ["refused"] * 2


@pytest.mark.parametrize("density,base,width", [(0.25, 1.0, 1.0), (0.01, 0.5, 4.0), (1.0, 1.0, 0.5)])
def test_supar_rules_match_the_formula(density, base, width):
    m_rho, m_d = density / base, width
    assert sparse_lr_scale(density, base_density=base, width_multiplier=width) == pytest.approx(1 / (m_d * m_rho))
    std = sparse_init_std(0.02, density, base_density=base, width_multiplier=width)
    assert std ** 2 == pytest.approx(0.02 ** 2 / (m_d * m_rho))


def test_density_param_groups_scale_only_sparse_weights():
    model = nn.Sequential(SparseLinear(40, 40, density=0.1), nn.ReLU(), SparseLinear(40, 8, density=0.5),
                          nn.Linear(8, 2))
    groups = density_param_groups(model, 1e-3)
    by_name = {g.get("name"): g for g in groups}
    assert by_name["0"]["lr"] == pytest.approx(1e-3 / (model[0].nnz / 1600))
    assert by_name["2"]["lr"] == pytest.approx(1e-3 / 0.5)
    rest = by_name[None]
    assert rest["lr"] == 1e-3 and len(rest["params"]) == 4  # two sparse biases, the dense weight and bias
    torch.optim.Adam(groups)  # every parameter once
    with pytest.raises(ValueError, match="density"):
        sparse_lr_scale(0.0)


# ------------------------------------------------------------------------------------------------ vector layouts
def _group_vectors(layer):
    """[groups, in] bool: which inputs each group of V outputs connects to, from the public dense weight, checking
    that every connection is a whole vector (all V lanes of the group, or none)."""
    V = layer.block
    mask = (layer.to_sparse_csr().to_dense() != 0) | _explicit(layer)
    lanes = mask.view(layer.out_features // V, V, layer.in_features)
    assert torch.equal(lanes.any(1), lanes.all(1)), "a connection is not a whole vector"
    return lanes.any(1)


def _explicit(layer):
    """The connections as a dense bool mask (stored zeros included), from the public [out, in] indices."""
    mask = torch.zeros(layer.out_features, layer.in_features, dtype=torch.bool)
    mask[tuple(layer.indices())] = True
    return mask


@pytest.mark.parametrize("block", [8, 16, 32])
@pytest.mark.parametrize("seed", range(3))
def test_vector_constructor_gives_every_group_the_same_vector_count(block, seed):
    g = torch.Generator().manual_seed(seed)
    groups, in_f = int(torch.randint(1, 5, (1,), generator=g)), int(torch.randint(1, 50, (1,), generator=g))
    density = float(torch.rand(1, generator=g))
    layer = SparseLinear(in_f, groups * block, density=density, block=block, constant_fan_in=True, generator=g)
    k = round(density * in_f)
    assert _group_vectors(layer).sum(1).tolist() == [k] * groups
    assert _explicit(layer).sum(1).tolist() == [k] * (groups * block) and layer.nnz == groups * block * k
    assert layer.constant_fan_in and layer.topology.common_fan_in() == k


def _dense_state(layer, values):
    """Per-edge ``values`` placed in the layer's dense [out, in] matrix (float64)."""
    out = torch.zeros(layer.out_features, layer.in_features, dtype=torch.float64)
    out[tuple(layer.indices())] = values.detach().double()
    return out


@pytest.mark.parametrize("block", [8, 16])
@pytest.mark.parametrize("mode", ["set", "rigl"])
@pytest.mark.parametrize("seed", range(3))
def test_vector_updates_keep_the_count_and_carry_values_and_state(block, mode, seed):
    torch.manual_seed(seed)
    groups, in_f = 3, 40
    layer = SparseLinear(in_f, groups * block, density=0.25, block=block, constant_fan_in=True)
    opt = torch.optim.AdamW(layer.parameters(), lr=1e-2)
    evo = DynamicSparsity([layer], opt, prune_every=2, total_steps=20, drop_fraction=0.5, mode=mode,
                          generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed)
    updates = 0
    for step in range(1, 15):
        layer(torch.randn(8, in_f, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step % 2 == 0:  # an update is due: the independent reference of what it must keep, taken before it
            old_mask = _group_vectors(layer)
            old_w = _dense_state(layer, layer.weight)
            old_m = _dense_state(layer, opt.state[layer.weight]["exp_avg"])
            old_v = _dense_state(layer, opt.state[layer.weight]["exp_avg_sq"])
            norm = old_w.view(groups, block, in_f).norm(dim=1)
            drop = round(evo.drop_fraction_at(step / 20) * 10)
        if not evo.step():
            continue
        updates += 1
        new_mask = _group_vectors(layer)
        assert new_mask.sum(1).tolist() == [10] * groups  # every group keeps its 10 vectors
        for gi in range(groups):
            want = set(norm[gi].masked_fill(~old_mask[gi], -1).topk(10 - drop).indices.tolist())
            kept = {i for i in range(in_f) if new_mask[gi, i] and old_mask[gi, i]}
            assert kept == want  # each group keeps its vectors of largest L2 norm
        kept = new_mask.repeat_interleave(block, 0) & old_mask.repeat_interleave(block, 0)
        grown = new_mask.repeat_interleave(block, 0) & ~old_mask.repeat_interleave(block, 0)
        for name, old in (("weight", old_w), ("exp_avg", old_m), ("exp_avg_sq", old_v)):
            value = layer.weight if name == "weight" else opt.state[layer.weight][name]
            new = _dense_state(layer, value)
            assert torch.equal(new[kept], old[kept]), name  # carried exactly
            assert bool((new[grown] == 0).all()), name  # grown connections start at 0
    assert updates >= 5 and layer.constant_fan_in


def test_vector_rigl_regrows_each_groups_largest_gradient_norm():
    torch.manual_seed(0)
    V, groups, in_f = 8, 4, 24
    layer = SparseLinear(in_f, groups * V, density=0.25, block=V, constant_fan_in=True)
    x, grad_out = torch.randn(16, in_f), torch.randn(16, groups * V)
    topology, edge_map, _ = plan_fan_in_update(layer, 2, mode="rigl", grad=(x, grad_out))
    score = (grad_out.double().t() @ x.double()).view(groups, V, in_f).norm(dim=1)
    present = _group_vectors(layer)
    grown = topology.indices()[:, edge_map.grown]
    for gi in range(groups):
        ins = set(grown[1][grown[0] // V == gi].tolist())
        assert ins == set(score[gi].masked_fill(present[gi], -1).topk(2).indices.tolist())


@pytest.mark.parametrize("seed", range(3))
def test_vector_ablation_removes_whole_groups(seed):
    torch.manual_seed(seed)
    V, groups, in_f = 8, 8, 40
    layer = SparseLinear(in_f, groups * V, density=0.2, block=V, constant_fan_in=True)
    total, drop = layer.nnz, 4
    norm = layer.weight.detach().view(-1, V).norm(dim=1)  # a vector's V values are consecutive
    vec_group = layer.topology.vectors.dst.long()
    survivors = norm.argsort(descending=True)[: total // V - drop * groups]
    salient = torch.bincount(vec_group[survivors], minlength=groups)
    topology, _, report = plan_fan_in_update(layer, drop, min_salient=6, total=total,
                                             generator=torch.Generator().manual_seed(seed))
    need = math.ceil(total // V / (in_f - drop))
    active_groups = max(int((salient >= 6).sum()), need)
    assert report.active == active_groups * V and report.fan_in == (total // V) // active_groups
    if int((salient >= 6).sum()) >= need:
        ablated = torch.nonzero(salient < 6).flatten()
        assert report.ablated == (ablated[:, None] * V + torch.arange(V)).flatten().tolist()
    fan = topology.fan_in()
    assert sorted(set(fan.tolist()) - {0}) == [report.fan_in] and int((fan > 0).sum()) == active_groups * V
    assert all(int(fan[o]) == 0 for o in report.ablated)


def test_vector_gradual_pruning_and_sparsify_keep_the_largest_vectors():
    torch.manual_seed(0)
    V = 16
    dense = nn.Linear(30, 2 * V)
    layer = sparsify(dense, density=0.3, block=V, constant_fan_in=True)
    norm = dense.weight.detach().view(2, V, 30).norm(dim=1)
    assert layer.constant_fan_in
    chosen = _group_vectors(layer)
    for gi in range(2):
        assert set(torch.nonzero(chosen[gi]).flatten().tolist()) == set(norm[gi].topk(9).indices.tolist())
    full = SparseLinear(32, 2 * V, density=1.0, block=V, constant_fan_in=True)
    opt = torch.optim.SGD(full.parameters(), lr=0.1)
    gmp = GradualPruning([full], opt, final_density=0.1, start_step=2, end_step=8, prune_every=2)
    for _ in range(10):
        full(torch.randn(4, 32)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        gmp.step()
        assert len(set(_group_vectors(full).sum(1).tolist())) == 1
    assert _group_vectors(full).sum(1).tolist() == [3, 3]


def test_vector_checkpoint_round_trip_keeps_the_property():
    layer = SparseLinear(20, 16, density=0.3, block=8, constant_fan_in=True)
    state = layer.state_dict()
    assert state["_extra_state"].tolist() == [3, 20, 16, 8, 1]
    other = SparseLinear(20, 16, density=0.5, block=8)
    other.load_state_dict(state)
    assert other.constant_fan_in and torch.equal(other.to_dense(), layer.to_dense())


@pytest.mark.parametrize("block", [1, 8])
def test_every_way_of_saving_and_copying_keeps_the_property(block, tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    layer = SparseLinear(20, 16, density=0.3, block=block, constant_fan_in=True)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    copies = {"pickle": torch.load(buffer, weights_only=False), "deepcopy": copy.deepcopy(layer)}
    state = nn.Sequential(layer).state_dict()
    copies["load_sparse_checkpoint"] = load_sparse_checkpoint(nn.Sequential(nn.Linear(20, 16)), state)[0]
    safetensors.save_file(state, tmp_path / "model.safetensors")
    copies["safetensors"] = load_sparse_checkpoint(nn.Sequential(nn.Linear(20, 16)), tmp_path / "model.safetensors")[0]
    for how, other in copies.items():
        assert other.constant_fan_in and other.block == block, how
        assert torch.equal(other.to_dense(), layer.to_dense()), how
    meta = SparseLinear(20, 16, density=0.3, block=block, constant_fan_in=True, device="meta").to_empty(device="cpu")
    meta.reset_parameters()  # the deferred topology is drawn as constant fan-in
    assert meta.constant_fan_in and meta.fan_in().tolist() == [6] * 16
    plain = load_sparse_checkpoint(nn.Sequential(nn.Linear(20, 16)),
                                   nn.Sequential(SparseLinear(20, 16, density=0.3, block=block)).state_dict())[0]
    assert not plain.constant_fan_in
