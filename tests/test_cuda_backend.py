"""CUDA kernels of ``csr_linear`` against the CPU op and a float64 dense reference.

Skipped without a GPU (CI has none); run on the H200 with ``pytest tests/test_cuda_backend.py``. The 16-bit
dtypes are checked against their error bounds in tests/test_dtypes.py, which runs on every device present.
"""

from __future__ import annotations

import pytest
import torch
from _helpers import poison_cuda_allocator, random_topology_with_empty_lines

import torch_sparse_metal  # noqa: F401  (loads the ops)
from torch_sparse_metal.topology import CSRTopology
from torch_sparse_metal_tools.testing import axes
from torch_sparse_metal_tools.testing.reference import reference_outputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")

OPS = torch.ops.torch_sparse_metal
STRATEGIES = axes.STRATEGIES
DTYPES = (torch.float32, torch.float64)  # compared with the CPU kernels' own types
# (in_features, out_features): none a multiple of 32 nor of the 8 rows of a block.
SIZES = ((1, 1), (33, 17), (70, 130), (300, 257))
DENSITIES = (0.0, 0.03, 0.3, 1.0)
# 1 and 7 take the 32-column path; 33 and 130 pad a 128-column chunk; 257 pads a 256-column chunk of 2-byte values
BATCHES = (0, 1, 7, 33, 130, 257)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_matches_cpu_and_dense(size, density, batch, dtype):
    in_features, out_features = size
    topo = random_topology_with_empty_lines(in_features, out_features, density, seed=in_features * 7 + batch)
    torch.manual_seed(batch + in_features)
    x = torch.randn(batch, in_features, dtype=dtype)
    w = torch.randn(topo.nnz, dtype=dtype)
    g = torch.randn(batch, out_features, dtype=dtype)
    exact = reference_outputs(g, x, w, topo)
    magnitude = reference_outputs(g.abs(), x.abs(), w.abs(), topo)  # sum of |products|: the error bound's scale
    terms = {"y": in_features, "grad_x": out_features, "grad_w": batch}

    def check(what: str, got: torch.Tensor, i: int, backend: str) -> None:
        axes.assert_within_bound(f"{backend} {what}", got, exact[i], magnitude[i], terms[what], dtype)

    cuda = topo.to("cuda")
    xc, wc, gc = x.cuda(), w.cuda(), g.cuda()

    poison_cuda_allocator(dtype)
    y = OPS.csr_linear(xc, wc, *cuda.kernel_args(), "auto")
    torch.cuda.synchronize()
    assert y.shape == (batch, out_features) and y.dtype == dtype and y.is_contiguous()
    assert not y.isnan().any(), "forward left output elements unwritten"
    check("y", y, 0, "cuda")
    check("y", OPS.csr_linear(x, w, *topo.kernel_args(), "auto"), 0, "cpu")  # the second backend, same bound

    for strategy in STRATEGIES:
        poison_cuda_allocator(dtype)
        gx, gw = OPS.csr_linear_backward(gc, xc, wc, *cuda.kernel_args(), strategy)
        torch.cuda.synchronize()
        assert gx.shape == x.shape and gw.shape == w.shape and gx.is_contiguous()
        assert not gx.isnan().any() and not gw.isnan().any(), f"{strategy} left gradient elements unwritten"
        check("grad_x", gx, 1, f"cuda {strategy}")
        check("grad_w", gw, 2, f"cuda {strategy}")
        cpu_gx, cpu_gw = OPS.csr_linear_backward(g, x, w, *topo.kernel_args(), strategy)
        check("grad_x", cpu_gx, 1, f"cpu {strategy}")
        check("grad_w", cpu_gw, 2, f"cpu {strategy}")


# (in_features, out_features, density, batch): many blocks and batch chunks with a padded last chunk; many short
# rows gathering from a wide input
LARGE = [(1000, 900, 0.05, 515), (7001, 40, 0.02, 260)]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("shape", LARGE, ids=lambda s: "x".join(map(str, s)))
def test_large_case_matches_dense(strategy, shape):
    n_in, n_out, density, batch = shape
    topo = CSRTopology.random(n_in, n_out, density, generator=torch.Generator().manual_seed(3)).to("cuda")
    x = torch.randn(batch, n_in, device="cuda")
    w = torch.randn(topo.nnz, device="cuda")
    g = torch.randn(batch, n_out, device="cuda")
    ref_y, ref_gx, ref_gw = reference_outputs(g, x, w, topo)
    y = OPS.csr_linear(x, w, *topo.kernel_args(), strategy)
    gx, gw = OPS.csr_linear_backward(g, x, w, *topo.kernel_args(), strategy)
    for got, ref in ((y, ref_y), (gx, ref_gx), (gw, ref_gw)):
        err = (got.double().cpu() - ref).norm() / ref.norm()
        assert err < 1e-5, f"relative error {err:.2e}"


def _kernel_names(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_wide_lanes_match_dense(dtype):
    """A layer large enough that fused_atomic on 16-bit values takes 32 bytes a lane (its csr_tile_kernel instance
    with P = 16), against float64 dense, with a padded last chunk; the other walks at the same size too."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = 16 * sms + 3  # blocks of 8 rows x 2 chunks fill the GPU 4 times over
    batch = 1000  # pads to 1024: two chunks of 512 columns
    topo = CSRTopology.random(n, n, 0.005, generator=torch.Generator().manual_seed(4)).to("cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(batch, n, device="cuda", generator=g).to(dtype)
    w = torch.randn(topo.nnz, device="cuda", generator=g).to(dtype)
    go = torch.randn(batch, n, device="cuda", generator=g).to(dtype)
    dense = torch.zeros(n, n, device="cuda", dtype=torch.float64)
    rows, cols = topo.dst.long(), topo.src.long()

    def reference(x, w, go):
        dense.zero_()[rows, cols] = w.double()
        return x.double() @ dense.t(), go.double() @ dense, (go.double().t() @ x.double())[rows, cols]

    exact = [t.cpu() for t in reference(x, w, go)]
    magnitude = [t.cpu() for t in reference(x.abs(), w.abs(), go.abs())]
    terms = (n, n, batch)
    poison_cuda_allocator(dtype)
    y = OPS.csr_linear(x, w, *topo.kernel_args(), "auto")
    axes.assert_within_bound("y", y, exact[0], magnitude[0], terms[0], dtype)
    for strategy in STRATEGIES:
        poison_cuda_allocator(dtype)
        if strategy == "fused_atomic":
            names = _kernel_names(lambda: OPS.csr_linear_backward(go, x, w, *topo.kernel_args(), "fused_atomic"))
            assert any("csr_tile_kernel" in k and ", 16, " in k for k in names), names
        gx, gw = OPS.csr_linear_backward(go, x, w, *topo.kernel_args(), strategy)
        assert not gx.isnan().any() and not gw.isnan().any(), f"{strategy} left gradient elements unwritten"
        axes.assert_within_bound(f"{strategy} grad_x", gx, exact[1], magnitude[1], terms[1], dtype)
        axes.assert_within_bound(f"{strategy} grad_w", gw, exact[2], magnitude[2], terms[2], dtype)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_opcheck(strategy):
    topo = CSRTopology.random(37, 29, 0.2, generator=torch.Generator().manual_seed(1)).to("cuda")
    x = torch.randn(11, 37, device="cuda", requires_grad=True)
    w = torch.randn(topo.nnz, device="cuda", requires_grad=True)
    torch.library.opcheck(OPS.csr_linear.default, (x, w, *topo.kernel_args(), strategy))
    g = torch.randn(11, 29, device="cuda")
    torch.library.opcheck(
        OPS.csr_linear_backward.default, (g, x.detach(), w.detach(), *topo.kernel_args(), strategy)
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradcheck_float64(strategy):
    topo = CSRTopology.random(13, 11, 0.3, generator=torch.Generator().manual_seed(2)).to("cuda")
    x = torch.randn(5, 13, device="cuda", dtype=torch.float64, requires_grad=True)
    w = torch.randn(topo.nnz, device="cuda", dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: OPS.csr_linear(a, b, *topo.kernel_args(), strategy), (x, w))


# One call per test. "wrong_in_features" segfaulted on the H200 when the extension was linked with the machine's
# /opt/gcc toolchain, which links libstdc++ statically: formatting the integers of its message went through the
# extension's own copy of libstdc++ (docs/cuda.md, "Building").
ERROR_CASES = ("int64_index", "mixed_devices", "dtype_mismatch", "auto_strategy", "wrong_in_features")


@pytest.mark.parametrize("case", ERROR_CASES)
def test_errors_name_the_problem(case):
    topo = CSRTopology.random(8, 6, 0.5, generator=torch.Generator().manual_seed(0)).to("cuda")
    x = torch.randn(3, 8, device="cuda")
    w = torch.randn(topo.nnz, device="cuda")
    args = list(topo.kernel_args())
    calls = {
        "int64_index": ("int32", lambda: OPS.csr_linear(x, w, args[0].long(), *args[1:], "auto")),
        "mixed_devices": ("is on cpu", lambda: OPS.csr_linear(x, w, args[0].cpu(), *args[1:], "auto")),
        "dtype_mismatch": ("dtype", lambda: OPS.csr_linear(x, w.double(), *args, "auto")),
        "auto_strategy": (
            "unknown backward strategy",
            lambda: OPS.csr_linear_backward(torch.randn(3, 6, device="cuda"), x, w, *args, "auto"),
        ),
        "wrong_in_features": (
            "in_features",
            lambda: OPS.csr_linear(torch.randn(3, 9, device="cuda"), w, *args, "auto"),
        ),
    }
    match, call = calls[case]
    with pytest.raises(RuntimeError, match=match):
        call()
