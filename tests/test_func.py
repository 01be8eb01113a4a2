"""torch.func over SparseLinear: grad, vjp, jacrev, vmap (batched inputs, per-sample gradients, ensembles of
weights) and Hessians, each against autograd or a dense masked weight. No fallback warning may be raised (the
ops have vmap rules)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.func import functional_call, grad, jacrev, vjp, vmap

from torch_sparse_metal import SparseLinear


@pytest.fixture
def layer() -> SparseLinear:
    return SparseLinear(6, 4, density=0.5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def _params(layer: SparseLinear) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in layer.named_parameters()}


def _loss(layer, params, x):
    return functional_call(layer, params, (x,)).sin().sum()


def _dense_loss(layer, params, x):
    dense = x.new_zeros(layer.out_features, layer.in_features).index_put(
        (layer.dst.long(), layer.src.long()), params["weight"])
    return (x @ dense.T + params["bias"]).sin().sum()


def test_grad_matches_autograd(layer):
    x = torch.randn(3, 6, dtype=torch.float64)
    g = grad(lambda p: _loss(layer, p, x))(_params(layer))
    ref = grad(lambda p: _dense_loss(layer, p, x))(_params(layer))
    for k in g:
        torch.testing.assert_close(g[k], ref[k])


def test_per_sample_gradients(layer):
    x = torch.randn(5, 6, dtype=torch.float64)
    per_sample = vmap(grad(lambda p, xi: _loss(layer, p, xi.unsqueeze(0))), in_dims=(None, 0))(_params(layer), x)
    for i in range(5):
        ref = grad(lambda p, xi=x[i]: _dense_loss(layer, p, xi.unsqueeze(0)))(_params(layer))
        torch.testing.assert_close(per_sample["weight"][i], ref["weight"])


def test_jacrev_is_the_dense_weight(layer):
    x = torch.randn(3, 6, dtype=torch.float64)
    jac = jacrev(lambda xx: functional_call(layer, _params(layer), (xx,)))(x)
    for n in range(3):
        torch.testing.assert_close(jac[n, :, n, :], layer.to_dense().detach())


def test_vjp(layer):
    x = torch.randn(3, 6, dtype=torch.float64)
    params = _params(layer)
    y, pullback = vjp(lambda w: functional_call(layer, {**params, "weight": w}, (x,)), params["weight"])
    cotangent = torch.randn_like(y)
    (got,) = pullback(cotangent)
    ref = (cotangent.T @ x)[layer.dst.long(), layer.src.long()]
    torch.testing.assert_close(got, ref)


def test_vmap_over_inputs_and_over_weights(layer):
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    batched = vmap(lambda xx: layer(xx))(x)
    torch.testing.assert_close(batched, layer(x))
    weights = torch.randn(2, layer.nnz, dtype=torch.float64)  # an ensemble of two weight vectors
    outs = vmap(lambda w: functional_call(layer, {**_params(layer), "weight": w}, (x[0],)))(weights)
    for i in range(2):
        torch.testing.assert_close(outs[i], functional_call(layer, {**_params(layer), "weight": weights[i]}, (x[0],)))


def test_hessian_matches_dense(layer):
    x = torch.randn(3, 6, dtype=torch.float64)
    params = _params(layer)
    hess = jacrev(jacrev(lambda w: _loss(layer, {**params, "weight": w}, x)))(params["weight"])
    ref = torch.autograd.functional.hessian(lambda w: _dense_loss(layer, {**params, "weight": w}, x), params["weight"])
    torch.testing.assert_close(hess, ref)
