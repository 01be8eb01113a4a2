"""Second- and higher-order gradients through the sparse layer (create_graph=True): gradient penalties,
Hessian-vector products and MAML need the gradient to be differentiable. Checked with gradgradcheck in float64
and against the same quantities computed with a dense masked weight."""

from __future__ import annotations

import warnings

import pytest
import torch

from torch_sparse_metal import CSRTopology, SparseLinear, sparse_linear
from torch_sparse_metal_tools.testing import axes

STRATEGIES = axes.STRATEGIES
#: float64 devices (MPS has no float64: its kernels are checked against these by the Metal tests).
DEVICES = [d for d in axes.DEVICES if torch.float64 in axes.dtypes(d)]


def _problem(seed: int, n_in: int = 7, n_out: int = 5, batch: int = 3, density: float = 0.5, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    topo = CSRTopology.random(n_in, n_out, density, generator=g).to(device)
    x = torch.randn(batch, n_in, generator=g, dtype=torch.float64).to(device).requires_grad_()
    w = torch.randn(topo.nnz, generator=g, dtype=torch.float64).to(device).requires_grad_()
    return topo, x, w


def _dense(topo: CSRTopology, w: torch.Tensor) -> torch.Tensor:
    """The dense [out, in] weight as a differentiable function of the edge values."""
    dense = w.new_zeros(topo.out_features, topo.in_features)
    return dense.index_put((topo.dst.long(), topo.src.long()), w)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("seed", range(3))
def test_gradgradcheck(strategy, seed, device):
    topo, x, w = _problem(seed, n_in=6 + seed, n_out=4 + 2 * seed, device=device)
    assert torch.autograd.gradgradcheck(lambda a, b: sparse_linear(a, b, topo, backward=strategy), (x, w))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_third_order(strategy):
    topo, x, w = _problem(11)
    assert torch.autograd.gradgradcheck(
        lambda a, b: torch.autograd.grad(sparse_linear(a, b, topo, backward=strategy).pow(2).sum(), (a, b),
                                         create_graph=True), (x, w))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_penalty_matches_dense(strategy, device):
    """A WGAN-GP-style penalty ||d out / d x||^2: its gradients w.r.t. weights and inputs equal the dense ones."""
    topo, x, w = _problem(5, n_in=9, n_out=6, batch=4, device=device)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()

    def penalty(out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
        (gx,) = torch.autograd.grad(out.tanh().sum(), inp, create_graph=True)
        return gx.pow(2).sum() + out.pow(2).mean()

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "backward not differentiable" warning may be raised
        penalty(sparse_linear(x, w, topo, backward=strategy), x).backward()
    penalty(x2 @ _dense(topo, w2).T, x2).backward()
    torch.testing.assert_close(w.grad, w2.grad)
    torch.testing.assert_close(x.grad, x2.grad)


def test_hessian_vector_product_matches_dense():
    topo, x, w = _problem(7, n_in=8, n_out=8, batch=5, density=0.4)
    v = torch.randn_like(w)

    def loss(weights: torch.Tensor, fn) -> torch.Tensor:
        return fn(weights).sin().sum()

    hvp = torch.autograd.functional.hvp(lambda b: loss(b, lambda c: sparse_linear(x, c, topo)), w, v)[1]
    ref = torch.autograd.functional.hvp(lambda b: loss(b, lambda c: x @ _dense(topo, c).T), w, v)[1]
    torch.testing.assert_close(hvp, ref)


def test_module_and_op_are_twice_differentiable():
    layer = SparseLinear(6, 4, density=0.5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x = torch.randn(2, 3, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(layer, (x,))
    topo = layer.topology
    args = topo.kernel_args()
    op = torch.ops.torch_sparse_metal.csr_linear
    w = layer.weight.detach().clone().requires_grad_()
    assert torch.autograd.gradgradcheck(lambda a, b: op(a, b, *args, "auto"), (x[0].detach().requires_grad_(), w))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("seed", range(2))
def test_forward_mode_checks(strategy, seed, device):
    """torch's own checkers, against finite differences: forward AD (dual tensors), forward-over-reverse and
    reverse-over-reverse, through the layer and through the raw op."""
    topo, x, w = _problem(20 + seed, n_in=5 + seed, n_out=4 + seed, device=device)
    fn = lambda a, b: sparse_linear(a, b, topo, backward=strategy)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (x, w), check_forward_ad=True, check_backward_ad=True)
    assert torch.autograd.gradgradcheck(fn, (x, w), check_fwd_over_rev=True, check_rev_over_rev=True)
    op = torch.ops.torch_sparse_metal.csr_linear
    assert torch.autograd.gradcheck(lambda a, b: op(a, b, *topo.kernel_args(), strategy), (x, w),
                                    check_forward_ad=True)


def test_forward_over_reverse_of_a_gradient_penalty_matches_dense():
    """The tangent of a create_graph=True gradient penalty's gradient, from dual weights, equals the dense one."""
    topo, x, w = _problem(31, n_in=8, n_out=6, batch=4)
    v = torch.randn_like(w)

    def penalty_grad(weights: torch.Tensor, forward) -> torch.Tensor:
        inp = x.detach().requires_grad_()
        (gx,) = torch.autograd.grad(forward(inp, weights).tanh().sum(), inp, create_graph=True)
        (gw,) = torch.autograd.grad(gx.pow(2).sum(), weights)
        return gw

    def tangent(forward) -> torch.Tensor:
        with torch.autograd.forward_ad.dual_level():
            dual = torch.autograd.forward_ad.make_dual(w.detach().requires_grad_(), v)
            return torch.autograd.forward_ad.unpack_dual(penalty_grad(dual, forward)).tangent

    got = tangent(lambda a, b: sparse_linear(a, b, topo))
    ref = tangent(lambda a, b: a @ _dense(topo, b).T)
    torch.testing.assert_close(got, ref)
