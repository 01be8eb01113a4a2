"""torch.compile over models with SparseLinear: one graph (fullgraph=True, no graph break), and the same outputs
and gradients as eager. Eager stays the fast path; compile only has to work."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torch_sparse_metal import SparseLinear
from torch_sparse_metal_tools.testing import axes

DEVICES = [d for d in axes.DEVICES if d != "mps"]  # the inductor has no Metal backend for our op


def _model(device: str) -> nn.Module:
    g = torch.Generator().manual_seed(0)
    return nn.Sequential(SparseLinear(32, 24, density=0.3, generator=g), nn.GELU(),
                         SparseLinear(24, 5, density=0.5, backward="atomic_free", generator=g)).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_fullgraph_compile_matches_eager(backend, device):
    torch._dynamo.reset()
    model = _model(device)
    x = torch.randn(3, 7, 32, device=device)
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    y = compiled(x)
    y.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    y_eager = model(x)
    y_eager.square().sum().backward()
    torch.testing.assert_close(y, y_eager)
    for got, p in zip(grads, model.parameters()):
        torch.testing.assert_close(got, p.grad)
