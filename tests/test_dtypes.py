"""Every op, strategy and value dtype on every device present, against float64 dense math, within the error
bound of each dtype (torch_sparse_metal_tools.testing.axes.error_bound: float32 accumulation, one rounding to the
dtype). Outputs start as NaN (TORCH_SPARSE_METAL_POISON=1, tests/conftest.py), so an unwritten element fails."""

from __future__ import annotations

import pytest
import torch
from _helpers import max_terms

from torch_sparse_metal import SparseLinear, sparse_linear
from torch_sparse_metal.ops import csr_linear, csr_linear_backward
from torch_sparse_metal_tools.testing import axes
from torch_sparse_metal_tools.testing.reference import dense_weight, random_topology

CASES_BY_DEVICE = [(d, t) for d in axes.DEVICES for t in axes.dtypes(d)]
IDS = [f"{d}-{str(t).removeprefix('torch.')}" for d, t in CASES_BY_DEVICE]
# (in_features, out_features, density, batch): batch 0 and 1, widths that are not multiples of a tile, chunk or
# threadgroup, zero edges, full density, rows with no edges.
SHAPES = [(1, 1, 1.0, 1), (37, 45, 0.3, 5), (64, 33, 0.0, 3), (50, 70, 1.0, 0), (100, 61, 0.05, 257),
          (129, 31, 0.9, 33), (200, 130, 0.02, 9)]


def _case(shape, dtype, device, seed):
    n_in, n_out, density, batch = shape
    topo = random_topology(n_in, n_out, density, seed, empty_rows=True)
    g = torch.Generator().manual_seed(seed)
    x, w, go = (torch.randn(*s, generator=g).to(dtype) for s in ((batch, n_in), (topo.nnz,), (batch, n_out)))
    return topo, x, w, go, (topo.to(device), x.to(device), w.to(device), go.to(device))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("device", "dtype"), CASES_BY_DEVICE, ids=IDS)
def test_forward_within_bound(device, dtype, shape):
    topo, x, w, _, (dt, xd, wd, _) = _case(shape, dtype, device, seed=sum(shape[:2]) + shape[3])
    y = csr_linear(xd, wd, dt)
    assert y.dtype == dtype and y.device.type == device
    dense = dense_weight(w, topo)
    axes.assert_within_bound("forward", y, x.double() @ dense.T, x.double().abs() @ dense.abs().T,
                             max_terms(topo.col_ptr), dtype)


@pytest.mark.parametrize("strategy", axes.STRATEGIES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("device", "dtype"), CASES_BY_DEVICE, ids=IDS)
def test_backward_within_bound(device, dtype, shape, strategy):
    topo, x, w, go, (dt, xd, wd, god) = _case(shape, dtype, device, seed=3 * sum(shape[:2]) + shape[3])
    grad_x, grad_w = csr_linear_backward(god, xd, wd, dt, strategy)
    assert grad_x.dtype == grad_w.dtype == dtype
    dense, edges = dense_weight(w, topo), (topo.dst.long(), topo.src.long())
    g64, x64 = go.double(), x.double()
    axes.assert_within_bound("grad_x", grad_x, g64 @ dense, g64.abs() @ dense.abs(), max_terms(topo.row_ptr), dtype)
    axes.assert_within_bound("grad_w", grad_w, (g64.T @ x64)[edges], (g64.abs().T @ x64.abs())[edges],
                             x.shape[0], dtype)


@pytest.mark.parametrize(("device", "dtype"), CASES_BY_DEVICE, ids=IDS)
def test_autocast_computes_in_its_dtype_and_grads_reach_float32_parameters(device, dtype):
    """As nn.Linear: float32 parameters, the op in the autocast dtype, float32 gradients."""
    if dtype in (torch.float32, torch.float64):
        pytest.skip("autocast casts to a lower precision")
    torch.manual_seed(0)
    layer = SparseLinear(48, 40, density=0.25, device=device)
    x = torch.randn(7, 3, 48, device=device, requires_grad=True)
    with torch.autocast(device, dtype=dtype):
        y = layer(x)
        no_bias = sparse_linear(x, layer.weight, layer.topology)
    assert y.dtype == no_bias.dtype == dtype and y.shape == (7, 3, 40)
    y.float().square().sum().backward()
    assert layer.weight.grad.dtype == layer.bias.grad.dtype == x.grad.dtype == torch.float32
    assert torch.isfinite(layer.weight.grad).all() and torch.isfinite(layer.bias.grad).all()
    # The same computation written out: inputs rounded to dtype, products summed, the result rounded to dtype.
    w16, x16 = (t.detach().to(dtype).double().cpu() for t in (layer.weight, x))
    dense = dense_weight(w16, layer.topology)
    axes.assert_within_bound("autocast forward", no_bias, x16 @ dense.T, x16.abs() @ dense.abs().T,
                             max_terms(layer.col_ptr), dtype)


def test_autocast_leaves_float64_alone():
    """Autocast's rule for lower-precision ops: float64 arguments are not cast."""
    layer = SparseLinear(8, 4, density=0.5, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(torch.randn(2, 8, dtype=torch.float64)).dtype == torch.float64


@pytest.mark.parametrize(("device", "dtype"), [c for c in CASES_BY_DEVICE if c[1] in (torch.float16, torch.bfloat16)],
                         ids=lambda c: str(c).removeprefix("torch."))
def test_mixed_model_trains_under_autocast_with_grad_scaler(device, dtype):
    """nn.Linear -> SparseLinear -> nn.Linear, float32 master weights, no cast written by the user; GradScaler
    (enabled for float16, as a user would) steps the optimizer. The loss must fall, parameters stay float32."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), SparseLinear(64, 64, density=0.2),
                                torch.nn.GELU(), torch.nn.Linear(64, 4)).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    x = torch.randn(256, 16, device=device)
    target = (x[:, :4] * x[:, 4:8]).sin()
    losses = []
    for _ in range(60):
        with torch.autocast(device, dtype=dtype):
            out = model(x)
            assert out.dtype == dtype
            loss = torch.nn.functional.mse_loss(out.float(), target)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.detach())
    assert all(p.dtype == torch.float32 for p in model.parameters())
    first, last = float(losses[0]), float(torch.stack(losses[-5:]).mean())
    assert last < 0.5 * first, f"loss {first:.4f} -> {last:.4f}"
