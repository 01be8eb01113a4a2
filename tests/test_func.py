"""torch.func over SparseLinear: grad, vjp, jacrev, vmap (batched inputs, per-sample gradients, ensembles of
weights), forward mode (jvp, jacfwd, torch.autograd.forward_ad dual tensors) and Hessians in the weight and in the
input (jacrev(jacrev), hessian = jacfwd(jacrev)), each against the dense float64 computation (the masked dense
weight, ``to_dense()``). No fallback warning may be raised (the ops have vmap rules)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.func import functional_call, grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

from torch_sparse_metal import SparseLinear, sparse_linear


@pytest.fixture(params=["fused_atomic", "atomic_free"])
def layer(request) -> SparseLinear:
    return SparseLinear(6, 4, density=0.5, backward=request.param, dtype=torch.float64,
                        generator=torch.Generator().manual_seed(0))


@pytest.fixture(autouse=True)
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # torch's own: its first forward-mode call scripts its jvp decompositions with the deprecated torch.jit
        warnings.filterwarnings("ignore", message="`torch.jit.script", category=DeprecationWarning)
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


def _weight_loss(layer, x):
    """The loss as a function of the edge values, and the same function of a dense float64 layer."""
    params = _params(layer)
    return (lambda w: _loss(layer, {**params, "weight": w}, x),
            lambda w: _dense_loss(layer, {**params, "weight": w}, x))


def _input_loss(layer):
    return (lambda x: layer(x).sin().sum(), lambda x: layer.to_linear()(x).sin().sum())


def test_hessian_in_the_weight_matches_dense(layer):
    x = torch.randn(3, 6, dtype=torch.float64)
    sparse, dense = _weight_loss(layer, x)
    w = layer.weight.detach()
    ref = torch.autograd.functional.hessian(dense, w)
    torch.testing.assert_close(hessian(sparse)(w), ref)
    torch.testing.assert_close(jacfwd(jacfwd(sparse))(w), ref)
    torch.testing.assert_close(jacrev(jacfwd(sparse))(w), ref)


@pytest.mark.parametrize("shape", [(3, 6), (2, 2, 6), (6,)])
def test_hessian_in_the_input_matches_dense(layer, shape):
    x = torch.randn(*shape, dtype=torch.float64)
    sparse, dense = _input_loss(layer)
    ref = torch.autograd.functional.hessian(dense, x)
    torch.testing.assert_close(jacrev(jacrev(sparse))(x), ref)
    torch.testing.assert_close(hessian(sparse)(x), ref)


def test_jvp_in_input_and_weight_matches_dense(layer):
    x, dx = torch.randn(2, 3, 6, dtype=torch.float64), torch.randn(2, 3, 6, dtype=torch.float64)
    w, dw = layer.weight.detach(), torch.randn(layer.nnz, dtype=torch.float64)
    params = _params(layer)
    f = lambda xx, ww: functional_call(layer, {**params, "weight": ww}, (xx,))  # noqa: E731
    out, tangent = jvp(f, (x, w), (dx, dw))
    dense, d_dense = layer.to_dense().detach(), layer.topology.to_sparse_csr(dw).to_dense()
    torch.testing.assert_close(out, x @ dense.T + params["bias"])
    torch.testing.assert_close(tangent, dx @ dense.T + x @ d_dense.T)


def test_jacfwd_equals_jacrev_and_the_dense_weight(layer):
    x = torch.randn(3, 6, dtype=torch.float64)
    f = lambda xx: layer(xx)  # noqa: E731
    jac = jacfwd(f)(x)
    torch.testing.assert_close(jac, jacrev(f)(x))
    for n in range(3):
        torch.testing.assert_close(jac[n, :, n, :], layer.to_dense().detach())
    w = layer.weight.detach()
    jac_w = jacfwd(lambda ww: functional_call(layer, {**_params(layer), "weight": ww}, (x,)))(w)
    ref = torch.autograd.functional.jacobian(lambda ww: _dense_out(layer, ww, x), w)
    torch.testing.assert_close(jac_w, ref)


def _dense_out(layer, w, x):
    dense = x.new_zeros(layer.out_features, layer.in_features).index_put((layer.dst.long(), layer.src.long()), w)
    return x @ dense.T + layer.bias.detach()


def test_forward_ad_dual_tensors_match_dense(layer):
    x, dx = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    dw = torch.randn(layer.nnz, dtype=torch.float64)
    dense = layer.to_dense().detach()
    with fwAD.dual_level():
        y = layer(fwAD.make_dual(x, dx))
        torch.testing.assert_close(fwAD.unpack_dual(y).tangent, dx @ dense.T)
        y = sparse_linear(x, fwAD.make_dual(layer.weight.detach(), dw), layer.topology)
        torch.testing.assert_close(fwAD.unpack_dual(y).tangent, x @ layer.topology.to_sparse_csr(dw).to_dense().T)
    assert fwAD.unpack_dual(layer(x)).tangent is None


def test_forward_over_reverse_hvp_in_eager(layer):
    """Dual weights through a backward (no create_graph): the tangent of the gradient is the Hessian-vector
    product."""
    x = torch.randn(3, 6, dtype=torch.float64)
    sparse, dense = _weight_loss(layer, x)
    w = layer.weight.detach().clone().requires_grad_()
    v = torch.randn_like(w)
    with fwAD.dual_level():
        dual = fwAD.make_dual(w, v)
        (g,) = torch.autograd.grad(sparse(dual), dual)
        hvp = fwAD.unpack_dual(g).tangent
    torch.testing.assert_close(hvp, torch.autograd.functional.hvp(dense, w.detach(), v)[1])
    forward_mode = torch.autograd.functional.hessian(sparse, w.detach(), vectorize=True,
                                                      outer_jacobian_strategy="forward-mode")
    torch.testing.assert_close(forward_mode, torch.autograd.functional.hessian(dense, w.detach()))


def test_raw_op_under_forward_mode(layer):
    """The registered op: dual tensors get their tangent; torch.func's differentiating transforms, which
    torch.library's rule cannot run under, are refused with the entry to use instead."""
    op = torch.ops.torch_sparse_metal.csr_linear
    args = (layer.weight.detach(), *layer.topology.kernel_args(), "auto")
    x, dx = torch.randn(3, 6, dtype=torch.float64), torch.randn(3, 6, dtype=torch.float64)
    with fwAD.dual_level():
        tangent = fwAD.unpack_dual(op(fwAD.make_dual(x, dx), *args)).tangent
    torch.testing.assert_close(tangent, dx @ layer.to_dense().detach().T)
    for transform in (lambda f: lambda a: jvp(f, (a,), (dx,)), jacfwd, jacrev, grad, hessian):
        with pytest.raises(NotImplementedError, match="sparse_linear or SparseLinear"):
            transform(lambda a: op(a, *args).sum())(x)
    torch.testing.assert_close(vmap(lambda a: op(a, *args))(x[None])[0], x @ layer.to_dense().detach().T)
