"""State changes are all-or-nothing: a malformed checkpoint or topology update raises, names what is wrong, and
leaves the layer (its optimizer state, the DynamicSparsity schedule) exactly as it was, compared tensor by tensor."""

from __future__ import annotations

import copy

import pytest
import torch

from torch_sparse_metal import SparseLinear
from torch_sparse_metal.evolve import DynamicSparsity, EdgeMap, apply_update, plan_update


def _layer(seed: int = 0, n_in: int = 12, n_out: int = 7) -> SparseLinear:
    return SparseLinear(n_in, n_out, density=0.4, generator=torch.Generator().manual_seed(seed))


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in {**dict(module.named_parameters()),
                                                **dict(module.named_buffers())}.items()}


def _assert_unchanged(module: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = _snapshot(module)
    assert after.keys() == before.keys()
    for key in before:
        assert torch.equal(after[key], before[key]), key


def _other_checkpoint() -> dict:
    return _layer(seed=1, n_in=9, n_out=5).state_dict()  # another topology and shape


@pytest.mark.parametrize(("corrupt", "message"), [
    (lambda sd: sd.__setitem__("bias", None), "bias must be a tensor, got NoneType"),
    (lambda sd: sd.__setitem__("weight", torch.empty(sd["weight"].shape, device="meta")), "dense tensor with data"),
    (lambda sd: sd.__setitem__("weight", sd["weight"].to_sparse()), "dense tensor with data"),
    (lambda sd: sd.__setitem__("bias", sd["bias"].tolist()), "bias must be a tensor, got list"),
    (lambda sd: sd.__setitem__("row_ptr", "0,1,2"), "row_ptr must be a tensor, got str"),
    (lambda sd: sd.__setitem__("weight", sd["weight"].long()), "weight must be floating point"),
    (lambda sd: sd.__setitem__("_extra_state", [1, 2]), "_extra_state must be a tensor"),
])
def test_malformed_checkpoint_leaves_the_layer_unchanged(corrupt, message):
    layer = _layer()
    before = _snapshot(layer)
    state = _other_checkpoint()
    corrupt(state)
    with pytest.raises(RuntimeError, match=message):
        layer.load_state_dict(state)
    _assert_unchanged(layer, before)
    x = torch.randn(3, 12)
    assert layer(x).shape == (3, 7)  # still a working layer


def test_strict_load_with_an_unexpected_key_changes_nothing():
    layer = _layer()
    before = _snapshot(layer)
    state = {**_other_checkpoint(), "stray": torch.zeros(1)}
    with pytest.raises(RuntimeError, match=r'nothing was loaded\):\n\tUnexpected key\(s\) in state_dict: "stray"'):
        layer.load_state_dict(state)
    _assert_unchanged(layer, before)
    result = layer.load_state_dict(state, strict=False)  # non-strict: loads, and reports the key
    assert result.unexpected_keys == ["stray"] and (layer.in_features, layer.out_features) == (9, 5)


def test_dynamic_sparsity_load_is_all_or_nothing():
    model = torch.nn.Sequential(_layer(2), torch.nn.ReLU(), _layer(3, n_in=7, n_out=4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    evo = DynamicSparsity(model, optimizer, prune_every=5, total_steps=100)
    before = copy.deepcopy(evo.state_dict())
    for bad in ({**before, "history": [("x", [1])]}, {**before, "start_nnz": [1]}, {**before, "steps": None},
                {**before, "regrown": [1, 2, 3]}, {k: v for k, v in before.items() if k != "history"}):
        with pytest.raises(ValueError):
            evo.load_state_dict(bad)
        after = evo.state_dict()
        assert after["steps"] == before["steps"] and after["history"] == before["history"]
        assert after["start_nnz"] == before["start_nnz"] and after["regrown"] == before["regrown"]


# ------------------------------------------------------------------------------------------ topology updates
def _optimizer_state(layer: SparseLinear) -> tuple[torch.optim.Optimizer, dict[str, torch.Tensor]]:
    opt = torch.optim.AdamW(layer.parameters(), lr=0.01)
    layer(torch.randn(4, layer.in_features)).sum().backward()
    opt.step()
    return opt, {k: v.clone() for k, v in opt.state[layer.weight].items() if isinstance(v, torch.Tensor)}


def _bad_plans(layer: SparseLinear):
    topology, edge_map = plan_update(layer, 3, 3, generator=torch.Generator().manual_seed(0))
    other = _layer(seed=4, n_in=9, n_out=5)
    other_plan = plan_update(other, 2, 2, generator=torch.Generator().manual_seed(0))
    collapsed = EdgeMap(torch.zeros_like(edge_map.old_to_new), edge_map.grown)
    out_of_range = EdgeMap(edge_map.old_to_new + topology.nnz, edge_map.grown)
    return [
        ("another layer's plan", other_plan, "the plan is for a 9 -> 5 layer"),
        ("collapsing edge map", (topology, collapsed), "exactly once"),
        ("indices out of range", (topology, out_of_range), "outside -1"),
        ("not a plan", (topology, "map"), "pair that plan_update returns"),
    ]


@pytest.mark.parametrize("index", range(4))
def test_apply_update_refuses_a_plan_that_does_not_fit(index):
    layer = _layer()
    opt, moments = _optimizer_state(layer)
    before = _snapshot(layer)
    name, (topology, edge_map), message = _bad_plans(layer)[index]
    with pytest.raises((ValueError, TypeError), match=message):
        apply_update(layer, topology, edge_map, [opt])
    _assert_unchanged(layer, before)
    for key, value in moments.items():
        assert torch.equal(opt.state[layer.weight][key], value), (name, key)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"drop": 2.5, "grow": 1}, "drop must be an integer"),
    ({"drop": 1, "grow": True}, "grow must be an integer"),
    ({"drop": 1, "grow": 1, "mode": "rigl", "grad": (torch.randn(4, 11), torch.randn(4, 7))}, "widths"),
    ({"drop": 1, "grow": 1, "mode": "rigl", "grad": (torch.randn(4, 12), torch.randn(3, 7))}, "shapes"),
])
def test_plan_update_names_bad_arguments(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        plan_update(_layer(), **kwargs)
