"""The CUDA SpMM stage's panel-staged walk (csrc/cuda/spmm_reuse.cuh) against float64, forced on.

The walk serves the forward and ``atomic_free``'s grad_x pass; ``TORCH_SPARSE_METAL_CUDA_SPMM`` picks it (``reuse``),
the direct walk (``direct``) or the rule (``auto``). These tests force it through the switch the setting sets, so they
run it whatever the environment says, and check by kernel name that it ran. Skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from torch_sparse_metal import _C, settings
from torch_sparse_metal.backends.cpu import CUDA_SPMM_WALKS
from torch_sparse_metal.testing import axes
from torch_sparse_metal.testing.reference import reference_outputs
from torch_sparse_metal.topology import CSRTopology

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")

OPS = torch.ops.torch_sparse_metal
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# (in_features, out_features): several panels for every dtype and lane width (a panel holds 96 to 1536 features),
# windows of 256 rows (128 for float64) with a partial last one, and a single short row.
SIZES = ((1, 1), (70, 130), (1700, 300), (2000, 530))
DENSITIES = (0.0, 0.02, 0.3)
# 1 and 7: one value a lane (32-column chunks); 33, 130, 257: 128-column chunks, the last padded
BATCHES = (1, 7, 33, 130, 257)


@pytest.fixture(params=("reuse", "reuse8"))
def reuse_walk(request):
    """The panel-staged walk forced for the test (16 or 8 rows a warp), the environment's setting restored after."""
    _C.set_cuda_spmm(request.param)
    yield
    _C.set_cuda_spmm(settings.choice("TORCH_SPARSE_METAL_CUDA_SPMM", CUDA_SPMM_WALKS, "auto"))


def _topology(n_in: int, n_out: int, density: float, seed: int) -> CSRTopology:
    topo = CSRTopology.random(n_in, n_out, density, generator=torch.Generator().manual_seed(seed))
    if n_in > 2 and n_out > 2 and 0 < density < 1:
        # Empty rows and columns: no edge from source 1 nor into output 2.
        mask = torch.zeros(n_out, n_in, dtype=torch.bool)
        mask[topo.dst.long(), topo.src.long()] = True
        mask[:, 1] = False
        mask[2, :] = False
        topo = CSRTopology.from_mask(mask)
    return topo


def _poison_allocator(dtype: torch.dtype) -> None:
    """Fill freed blocks of the caching allocator with NaN so an unwritten output element shows up."""
    blocks = [torch.full((n,), float("nan"), dtype=dtype, device="cuda") for n in (1 << 12, 1 << 17, 1 << 21)
              for _ in range(3)]
    del blocks


def _kernel_names(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_reuse_walk_matches_float64(reuse_walk, size, density, batch, dtype):
    n_in, n_out = size
    topo = _topology(n_in, n_out, density, seed=n_in * 7 + batch)
    torch.manual_seed(batch + n_in)
    x, w, g = (torch.randn(*s).to(dtype) for s in ((batch, n_in), (topo.nnz,), (batch, n_out)))
    exact = reference_outputs(g, x, w, topo)
    magnitude = reference_outputs(g.abs(), x.abs(), w.abs(), topo)
    cuda = topo.to("cuda")
    xc, wc, gc = x.cuda(), w.cuda(), g.cuda()

    _poison_allocator(dtype)
    y = OPS.csr_linear(xc, wc, *cuda.kernel_args(), "auto")
    axes.assert_within_bound("y", y, exact[0], magnitude[0], n_in, dtype)
    _poison_allocator(dtype)
    gx, gw = OPS.csr_linear_backward(gc, xc, wc, *cuda.kernel_args(), "atomic_free")
    axes.assert_within_bound("atomic_free grad_x", gx, exact[1], magnitude[1], n_out, dtype)
    axes.assert_within_bound("atomic_free grad_w", gw, exact[2], magnitude[2], batch, dtype)


@pytest.mark.parametrize("batch", (7, 257))
def test_reuse_kernel_runs_when_forced(reuse_walk, batch):
    """The forced setting reaches the kernel: forward and atomic_free launch reuse_spmm_kernel, fused_atomic not."""
    topo = CSRTopology.random(500, 400, 0.05, generator=torch.Generator().manual_seed(2)).to("cuda")
    x, w, g = (torch.randn(*s, device="cuda") for s in ((batch, 500), (topo.nnz,), (batch, 400)))
    assert any("reuse_spmm_kernel" in k for k in _kernel_names(lambda: OPS.csr_linear(x, w, *topo.kernel_args(),
                                                                                      "auto")))
    names = _kernel_names(lambda: OPS.csr_linear_backward(g, x, w, *topo.kernel_args(), "atomic_free"))
    assert any("reuse_spmm_kernel" in k for k in names), names
    names = _kernel_names(lambda: OPS.csr_linear_backward(g, x, w, *topo.kernel_args(), "fused_atomic"))
    assert not any("reuse_spmm_kernel" in k for k in names), names


def test_direct_walk_when_forced_off():
    topo = CSRTopology.random(500, 400, 0.05, generator=torch.Generator().manual_seed(2)).to("cuda")
    x, w = torch.randn(257, 500, device="cuda"), torch.randn(topo.nnz, device="cuda")
    _C.set_cuda_spmm("direct")
    try:
        names = _kernel_names(lambda: OPS.csr_linear(x, w, *topo.kernel_args(), "auto"))
    finally:
        _C.set_cuda_spmm(settings.choice("TORCH_SPARSE_METAL_CUDA_SPMM", CUDA_SPMM_WALKS, "auto"))
    assert not any("reuse_spmm_kernel" in k for k in names) and any("csr_tile_kernel" in k for k in names), names


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_reuse_walk_any_column_order(reuse_walk, dtype):
    """Columns that do not ascend within a row (each row's by-destination order reversed, values moved with them)
    give the same sums: edges outside the current panel read their row from global memory."""
    n_in, n_out, batch = 1900, 300, 130
    topo = CSRTopology.random(n_in, n_out, 0.05, generator=torch.Generator().manual_seed(6))
    row_ptr, dst, src, col_ptr, src_by_dst, perm = topo.kernel_args()
    order = torch.cat([torch.arange(int(col_ptr[o + 1]) - 1, int(col_ptr[o]) - 1, -1) for o in range(n_out)])
    args = [t.cuda() for t in (row_ptr, dst, src, col_ptr, src_by_dst[order].contiguous(), perm[order].contiguous())]
    x = torch.randn(batch, n_in).to(dtype)
    w = torch.randn(topo.nnz).to(dtype)
    g = torch.randn(batch, n_out).to(dtype)
    exact = reference_outputs(g, x, w, topo)
    magnitude = reference_outputs(g.abs(), x.abs(), w.abs(), topo)
    _poison_allocator(dtype)
    y = OPS.csr_linear(x.cuda(), w.cuda(), *args, "auto")
    axes.assert_within_bound("y", y, exact[0], magnitude[0], n_in, dtype)


def test_setting_rejects_unknown_walk():
    with pytest.raises(ValueError, match="auto, direct, reuse or reuse8"):
        _C.set_cuda_spmm("fast")
