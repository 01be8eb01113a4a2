"""Deferred initialisation, as large-model loaders use it: construct on the meta device, then ``to_empty`` and
``reset_parameters()`` (or ``load_state_dict``), exactly as with ``nn.Linear``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_sparse_metal import CSRTopology, SparseLinear


def _materialise(layer: nn.Module) -> nn.Module:
    layer = layer.to_empty(device="cpu")
    for module in layer.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    return layer


def test_meta_layer_has_shapes_and_no_data():
    layer = SparseLinear(40, 30, density=0.25, device="meta")
    nnz = CSRTopology.random_edge_count(40, 30, 0.25)
    assert layer.weight.device.type == "meta" and layer.weight.shape == (nnz,)
    assert layer.bias.shape == (30,) and layer.row_ptr.shape == (41,) and layer.dst.shape == (nnz,)
    assert layer(torch.randn(2, 7, 40, device="meta")).shape == (2, 7, 30)  # shape inference on meta
    layer.reset_parameters()  # a no-op on meta, as nn.Linear's
    assert layer.weight.device.type == "meta"


def test_materialised_layer_is_valid_and_computes_its_dense_product():
    layer = _materialise(SparseLinear(40, 30, density=0.25, device="meta"))
    topo = CSRTopology.from_csr(layer.row_ptr, layer.dst, 40, 30)  # validates: sorted, in range, no duplicates
    assert topo.nnz == layer.nnz and torch.equal(topo.perm, layer.perm)
    x = torch.randn(5, 40, dtype=torch.float64)
    ref = x @ layer.to_dense().double().T + layer.bias.double()
    torch.testing.assert_close(layer(x.float()).double(), ref, rtol=1e-5, atol=1e-5)
    bound = layer.fan_in().clamp(min=1).double().rsqrt()[layer.dst.long()]
    assert (layer.weight.double().abs() <= bound).all()  # nn.Linear's scale for each output's fan-in


def test_materialisation_is_reproducible_from_the_generator():
    def make(seed: int) -> SparseLinear:
        return _materialise(SparseLinear(32, 16, density=0.3, device="meta",
                                         generator=torch.Generator().manual_seed(seed)))

    a, b, c = make(1), make(1), make(2)
    assert torch.equal(a.dst, b.dst) and torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert not torch.equal(a.dst, c.dst)


def test_meta_device_context_and_a_whole_model():
    with torch.device("meta"):
        model = nn.Sequential(SparseLinear(12, 10, density=0.5), nn.ReLU(), SparseLinear(10, 3, density=0.5))
    assert all(p.device.type == "meta" for p in model.parameters())
    model = _materialise(model)
    assert model(torch.randn(4, 12)).shape == (4, 3)


def test_forward_before_the_topology_is_drawn_says_what_to_do():
    layer = SparseLinear(8, 4, density=0.5, device="meta").to_empty(device="cpu")
    with pytest.raises(RuntimeError, match=r"reset_parameters\(\) after to_empty\(\), or load_state_dict"):
        layer(torch.randn(2, 8))


def test_load_state_dict_into_a_materialised_meta_layer():
    trained = SparseLinear(20, 9, density=0.4, generator=torch.Generator().manual_seed(3))
    layer = SparseLinear(20, 9, density=0.4, device="meta").to_empty(device="cpu")
    layer.load_state_dict(trained.state_dict())
    x = torch.randn(6, 20)
    torch.testing.assert_close(layer(x), trained(x), rtol=0, atol=0)
    layer.reset_parameters()  # the loaded topology stays; only values are re-drawn
    assert torch.equal(layer.dst, trained.dst)
