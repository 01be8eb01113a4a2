"""CPU kernels of the csr_linear ops against float64 dense math and torch.sparse; opcheck; gradcheck."""

import pytest
import torch

import torch_sparse_metal  # noqa: F401  (registers the ops)
from torch_sparse_metal.backends import cpu
from torch_sparse_metal.ops import csr_linear, csr_linear_backward
from torch_sparse_metal.testing import axes
from torch_sparse_metal.testing.reference import (
    random_topology,
    reference_backward,
    reference_forward,
    torch_sparse_forward,
)

STRATEGIES = axes.STRATEGIES
DTYPES = [torch.float32, torch.float64]  # the kernels' own types; 16-bit values are widened to float32 first
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float64: dict(atol=1e-10, rtol=1e-10)}

# (in_features, out_features, density, batch): zero edges, full density, batch 0 and 1, sizes that are not
# multiples of the batch tile (16 floats, 8 doubles) or of any block, more tiles than threads, sources with
# edge counts that are not multiples of the 4-edge groups of the AVX2 kernels.
SHAPES = [
    (1, 1, 1.0, 1),
    (7, 5, 0.0, 3),
    (33, 17, 1.0, 0),
    (33, 17, 0.5, 1),
    (64, 48, 0.1, 31),
    (100, 61, 0.05, 33),
    (129, 257, 0.02, 70),
    (300, 200, 0.3, 97),
    (0, 9, 0.5, 4),
    (9, 0, 0.5, 4),
]


@pytest.fixture(params=cpu.KERNEL_SETS, autouse=True)
def cpu_kernels(request):
    """Every test runs with the kernels this CPU picks (AVX2 + FMA where available) and with the baseline ones."""
    with cpu.use_kernels(request.param):
        yield request.param


def _case(shape, dtype, seed, empty_rows=False):
    in_features, out_features, density, batch = shape
    topo = random_topology(in_features, out_features, density, seed, empty_rows=empty_rows)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, in_features, generator=g, dtype=dtype)
    w = torch.randn(topo.nnz, generator=g, dtype=dtype)
    grad_out = torch.randn(batch, out_features, generator=g, dtype=dtype)
    return topo, x, w, grad_out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("empty_rows", [False, True])
def test_forward_matches_dense_and_torch_sparse(shape, dtype, empty_rows):
    topo, x, w, _ = _case(shape, dtype, seed=sum(shape[:2]) + shape[3] + empty_rows, empty_rows=empty_rows)
    y = csr_linear(x, w, topo)
    assert y.shape == (shape[3], shape[1]) and y.dtype == dtype
    torch.testing.assert_close(y.double(), reference_forward(x, w, topo), **TOL[dtype])
    torch.testing.assert_close(y.double(), torch_sparse_forward(x, w, topo), **TOL[dtype])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("empty_rows", [False, True])
def test_backward_matches_dense(shape, dtype, strategy, empty_rows):
    seed = 7 * sum(shape[:2]) + shape[3] + len(strategy)
    topo, x, w, grad_out = _case(shape, dtype, seed=seed, empty_rows=empty_rows)
    grad_x, grad_w = csr_linear_backward(grad_out, x, w, topo, strategy)
    ref_x, ref_w = reference_backward(grad_out, x, w, topo)
    assert grad_x.shape == x.shape and grad_w.shape == w.shape
    torch.testing.assert_close(grad_x.double(), ref_x, **TOL[dtype])
    torch.testing.assert_close(grad_w.double(), ref_w, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_strategies_agree(dtype):
    topo, x, w, grad_out = _case((257, 129, 0.1, 130), dtype, seed=3)
    fused = csr_linear_backward(grad_out, x, w, topo, "fused_atomic")
    free = csr_linear_backward(grad_out, x, w, topo, "atomic_free")
    torch.testing.assert_close(fused[0], free[0], **TOL[dtype])
    torch.testing.assert_close(fused[1], free[1], **TOL[dtype])


def test_atomic_free_is_deterministic():
    topo, x, w, grad_out = _case((200, 150, 0.2, 300), torch.float32, seed=4)
    first = csr_linear_backward(grad_out, x, w, topo, "atomic_free")
    for _ in range(3):
        again = csr_linear_backward(grad_out, x, w, topo, "atomic_free")
        assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("shape", [(6, 5, 0.5, 3), (11, 7, 0.3, 1), (8, 4, 1.0, 0), (5, 5, 0.0, 2)])
def test_gradcheck_float64(shape, strategy):
    topo, x, w, _ = _case(shape, torch.float64, seed=5)
    x.requires_grad_(True)
    w.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: csr_linear(a, b, topo, strategy), (x, w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(20, 13, 0.3, 5), (33, 40, 0.1, 1), (10, 10, 0.0, 4), (12, 8, 0.5, 0)])
def test_opcheck(shape, dtype):
    topo, x, w, grad_out = _case(shape, dtype, seed=6)
    for strategy in ["auto", *STRATEGIES]:
        args = (x.clone().requires_grad_(True), w.clone().requires_grad_(True), *topo.kernel_args(), strategy)
        torch.library.opcheck(torch.ops.torch_sparse_metal.csr_linear.default, args)
    for strategy in STRATEGIES:
        args = (grad_out, x, w, *topo.kernel_args(), strategy)
        torch.library.opcheck(torch.ops.torch_sparse_metal.csr_linear_backward.default, args)


def test_op_rejects_bad_arguments():
    topo, x, w, grad_out = _case((10, 6, 0.5, 3), torch.float32, seed=7)
    op = torch.ops.torch_sparse_metal.csr_linear
    bwd = torch.ops.torch_sparse_metal.csr_linear_backward
    with pytest.raises(RuntimeError, match="int32"):
        op(x, w, topo.row_ptr.long(), *topo.kernel_args()[1:], "auto")
    with pytest.raises(RuntimeError, match="dtype"):
        op(x, w.double(), *topo.kernel_args(), "auto")
    with pytest.raises(RuntimeError, match="must be one of"):
        op(x.to(torch.float8_e5m2), w.to(torch.float8_e5m2), *topo.kernel_args(), "auto")
    # Formats integers: a build that links its own libstdc++ segfaulted here (docs/cuda.md, "Building").
    with pytest.raises(RuntimeError, match="row_ptr has 11 elements but x has in_features=5"):
        op(x[:, :5], w, *topo.kernel_args(), "auto")
    with pytest.raises(RuntimeError, match="2-D"):
        op(x[0], w, *topo.kernel_args(), "auto")
    with pytest.raises(RuntimeError, match="unknown backward strategy 'sideways'"):
        bwd(grad_out, x, w, *topo.kernel_args(), "sideways")
    with pytest.raises(RuntimeError, match=r"grad_out must be \[batch, out_features\] with batch=3"):
        bwd(grad_out[:2], x, w, *topo.kernel_args(), "atomic_free")
