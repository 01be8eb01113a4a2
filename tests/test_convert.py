"""Conversions between SparseLinear, torch.sparse tensors and nn.Linear, and sparsify(model): one convention
everywhere (PyTorch's: a weight is [out_features, in_features]; indices() row 0 is the output index), checked on
non-square layers so a transposition cannot pass."""

from __future__ import annotations

import copy
import importlib.util
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from torch_sparse_metal import CSRTopology, SparseLinear, sparsify


def _sparse_weight(out_features: int = 5, in_features: int = 7, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(out_features, in_features, generator=g)
    dense[torch.rand(out_features, in_features, generator=g) < 0.6] = 0.0
    dense[1, 2] = 0.0
    return dense


@pytest.mark.parametrize("layout", ["coo", "csr", "csc", "bsr"])
def test_from_sparse_keeps_the_matrix_not_its_transpose(layout):
    dense = _sparse_weight()
    sparse = {"coo": dense.to_sparse(), "csr": dense.to_sparse_csr(), "csc": dense.to_sparse_csc(),
              "bsr": dense.to_sparse_bsr((1, 1))}[layout]
    layer = SparseLinear.from_sparse(sparse, bias=torch.arange(5.0))
    assert (layer.out_features, layer.in_features) == (5, 7)
    torch.testing.assert_close(layer.to_dense(), dense)
    x = torch.randn(3, 7)
    torch.testing.assert_close(layer(x), x @ dense.T + torch.arange(5.0))


def test_explicit_zeros_stay_edges():
    idx = torch.tensor([[0, 1, 1], [2, 0, 3]])
    sparse = torch.sparse_coo_tensor(idx, torch.tensor([1.0, 0.0, 2.0]), (2, 4))
    layer = SparseLinear.from_sparse(sparse)
    assert layer.nnz == 3 and sorted(map(tuple, layer.indices().T.tolist())) == [(0, 2), (1, 0), (1, 3)]


def test_round_trip_through_torch_sparse_csr():
    layer = SparseLinear(9, 4, density=0.4, generator=torch.Generator().manual_seed(1))
    csr = layer.to_sparse_csr()
    assert csr.layout == torch.sparse_csr and csr.shape == (4, 9)
    torch.testing.assert_close(csr.to_dense(), layer.to_dense())
    back = SparseLinear.from_sparse(csr, layer.bias.detach())
    assert back.topology.same_as(layer.topology)
    torch.testing.assert_close(back.weight, layer.weight)


def test_to_sparse_csr_is_differentiable():
    layer = SparseLinear(6, 3, density=0.5, bias=False, generator=torch.Generator().manual_seed(2))
    x = torch.randn(6, 2)
    (layer.to_sparse_csr() @ x).sum().backward()
    ref = x.sum(1)[layer.src.long()]  # d/dw[e] of sum(W @ x) = sum_j x[src[e], j]
    torch.testing.assert_close(layer.weight.grad, ref)


def test_from_indices_uses_the_indices_convention():
    layer = SparseLinear(8, 3, density=0.5, generator=torch.Generator().manual_seed(3))
    shuffled = torch.randperm(layer.nnz, generator=torch.Generator().manual_seed(4))
    topo, order = CSRTopology.from_indices(layer.indices()[:, shuffled], in_features=8, out_features=3)
    assert topo.same_as(layer.topology)
    assert torch.equal(shuffled[order], torch.arange(layer.nnz))  # values[order] realigns shuffled values
    with pytest.raises(ValueError, match=r"indices\[0\] \(output\)"):
        CSRTopology.from_indices(torch.tensor([[3], [0]]), in_features=8, out_features=3)


def test_to_linear_computes_the_same_function():
    layer = SparseLinear(10, 6, density=0.3, generator=torch.Generator().manual_seed(5))
    x = torch.randn(4, 10)
    torch.testing.assert_close(layer.to_linear()(x), layer(x))


def test_init_weight_applies_nn_init():
    layer = SparseLinear(20, 10, density=0.5, generator=torch.Generator().manual_seed(6))
    dst = layer.dst.clone()
    layer.init_weight_(nn.init.constant_, 0.25)
    assert torch.all(layer.weight == 0.25) and torch.equal(layer.dst, dst)
    layer.init_weight_(nn.init.xavier_uniform_)
    bound = (6 / 30) ** 0.5
    assert layer.weight.abs().max() <= bound and layer.weight.std() > 0


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 9), nn.ReLU(), nn.Sequential(nn.Linear(9, 5), nn.Tanh()), nn.Linear(5, 2))


def test_sparsify_by_magnitude_keeps_the_largest_weights():
    model = _model()
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    sparsify(model, density=0.3)
    for name, weight in dense.items():
        layer = model.get_submodule(name)
        assert isinstance(layer, SparseLinear) and layer.nnz == CSRTopology.random_edge_count(*weight.shape[::-1], 0.3)
        kept = layer.to_dense() != 0
        assert weight.abs()[kept].min() >= weight.abs()[~kept].max()
        torch.testing.assert_close(layer.to_dense()[kept], weight[kept])


def test_sparsify_density_one_is_the_same_model():
    model = _model()
    x = torch.randn(3, 12)
    ref = model(x)
    torch.testing.assert_close(sparsify(model, density=1.0)(x), ref)


def test_sparsify_random_filter_and_masks():
    a = sparsify(_model(), density=0.5, method="random", generator=torch.Generator().manual_seed(7))
    b = sparsify(_model(), density=0.5, method="random", generator=torch.Generator().manual_seed(7))
    assert torch.equal(a[0].dst, b[0].dst)
    only_first = sparsify(_model(), density=0.5, filter=lambda name, m: name == "0")
    assert isinstance(only_first[0], SparseLinear) and type(only_first[2][0]) is nn.Linear
    mask = torch.zeros(5, 9, dtype=torch.bool)
    mask[0, 0] = mask[4, 8] = True
    masked = sparsify(_model(), masks={"2.0": mask}, filter=lambda name, m: name == "2.0")
    assert masked[2][0].nnz == 2


def test_sparsify_checks_everything_before_changing_anything():
    model = _model()
    before = copy.deepcopy(model)
    with pytest.raises(ValueError, match="mask for '3' must be a bool tensor of shape"):
        sparsify(model, density=0.5, masks={"3": torch.ones(2, 5)})
    assert all(type(m) is type(n) for m, n in zip(model.modules(), before.modules()))
    with pytest.raises(ValueError, match="not nn.Linear layers"):
        sparsify(model, density=0.5, masks={"1": torch.ones(1, dtype=torch.bool)})
    with pytest.raises(ValueError, match="pass density"):
        sparsify(model)


def test_sparsify_example_runs(capsys):
    """examples/sparsify_model.py: dense training, sparsify, fine-tuning, with tiny settings."""
    path = Path(__file__).resolve().parents[1] / "examples" / "sparsify_model.py"
    spec = importlib.util.spec_from_file_location("sparsify_model_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--steps", "20", "--finetune-steps", "10", "--d-model", "32", "--context", "32",
                           "--batch-size", "4", "--eval-chars", "2048"])
    assert set(results) == {"dense", "sparsified", "fine-tuned"}
    assert all(math.isfinite(v) and 0 < v < 10 for v in results.values())
    assert "| sparsified to density 0.25 (8 SparseLinear layers) |" in capsys.readouterr().out
