"""Loads are all-or-nothing: a malformed checkpoint raises, names what is wrong, and leaves the layer (or the
DynamicSparsity schedule) exactly as it was, compared tensor by tensor."""

from __future__ import annotations

import copy

import pytest
import torch

from torch_sparse_metal import SparseLinear
from torch_sparse_metal.evolve import DynamicSparsity


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
    (lambda sd: sd.__setitem__("_extra_state", [1, 2]), "_extra_state must be a dict"),
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
