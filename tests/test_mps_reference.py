"""The MPS reference path (torch_sparse_metal/backends/mps_reference.py, issue #40): run through the MPS hosts'
own forward/backward (the code the "mps" registration calls) on CPU tensors, with the reference path forced, with a
dtype's library failing to compile, or with a kernel's pipeline failing at its first dispatch (issue #46), against
float64 dense references; and the isolation of a failure to its family and dtype, with one warning per process that
says what failed and how to report it."""

from __future__ import annotations

import platform
import warnings
from collections import Counter

import pytest
import torch

from torch_sparse_metal import CSRTopology
from torch_sparse_metal.backends import metal, mps_reference
from torch_sparse_metal.backends.mps import MetalCsrLinear
from torch_sparse_metal_tools.testing.reference import dense_weight, vector_dense_weight
from tsm_dev.msl import compile_shader
from tsm_dev.msl.faults import PIPELINE_ERROR, FailingPipelines

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
STRATEGIES = ["fused_atomic", "atomic_free"]
TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
# (in, out, density, batch): no edges, batch 0 and 1, empty sides, and a sizeable layer
CASES = [(37, 45, 0.3, 5), (64, 32, 0.0, 3), (50, 72, 1.0, 0), (33, 96, 0.5, 1), (0, 8, 0.0, 4), (6, 0, 0.0, 4),
         (100, 64, 0.1, 40)]


def _never_compiles(source: str):
    raise AssertionError("the forced reference path compiled a Metal library")


@pytest.fixture
def forced(monkeypatch):
    monkeypatch.setattr(metal, "_force_reference", True)
    return MetalCsrLinear(_never_compiles, "cpu", poison=True)


def _case(n_in, n_out, density, batch, dtype, block, seed=0):
    g = torch.Generator().manual_seed(seed)
    groups = n_out // block  # the vector layout's outputs: whole groups
    n_out = groups * block
    topo = CSRTopology.from_mask(torch.rand(groups, n_in, generator=g) < density)
    shape = (topo.nnz,) if block == 1 else (topo.nnz, block)
    w = torch.randn(shape, generator=g).to(dtype)
    x, go = torch.randn(batch, n_in, generator=g).to(dtype), torch.randn(batch, n_out, generator=g).to(dtype)
    dense = dense_weight(w, topo) if block == 1 else vector_dense_weight(w, topo)  # float64 [out, in]
    return topo, w, x, go, dense


def _expected_grad_w(topo, go, x, block):
    """grad_w from the dense float64 weight gradient (grad_out^T x) read at each edge."""
    full = go.double().T @ x.double()
    _, dst, src, *_ = (t.long() for t in topo.kernel_args())
    if block == 1:
        return full[dst, src]
    return torch.stack([full[d * block:(d + 1) * block, s] for d, s in zip(dst.tolist(), src.tolist())]) \
        if len(dst) else torch.zeros(0, block, dtype=torch.float64)


def _check(host, case, dtype, block):
    topo, w, x, go, dense = case
    tol = TOL[dtype] * max(1.0, dense.abs().sum(1).max().item() if dense.numel() else 1.0)
    y = host.forward(x, w, *topo.kernel_args())
    assert y.dtype == dtype and y.shape == (x.shape[0], dense.shape[0])
    assert not y.isnan().any()  # poisoned outputs: every element written
    torch.testing.assert_close(y.double(), x.double() @ dense.T, rtol=0, atol=tol)
    for strategy in STRATEGIES:
        gx, gw = host.backward(go, x, w, *topo.kernel_args(), strategy)
        assert gx.dtype == dtype and gw.dtype == dtype and gw.shape == w.shape
        assert not gx.isnan().any() and not gw.isnan().any()
        torch.testing.assert_close(gx.double(), go.double() @ dense, rtol=0, atol=tol)
        torch.testing.assert_close(gw.double(), _expected_grad_w(topo, go, x, block), rtol=0,
                                   atol=TOL[dtype] * max(1, x.shape[0]) * 4)
        again = host.backward(go, x, w, *topo.kernel_args(), strategy)
        assert torch.equal(again[0], gx) and torch.equal(again[1], gw)  # deterministic, bit for bit


@pytest.mark.parametrize("block", [1, 8], ids=["unstructured", "vector8"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n_in,n_out,density,batch", CASES)
def test_reference_path_matches_float64_dense(forced, n_in, n_out, density, batch, dtype, block):
    _check(forced, _case(n_in, n_out, density, batch, dtype, block), dtype, block)


def test_reference_path_chunks_large_blocks(forced, monkeypatch):
    """A layer whose gathered terms exceed one block runs in several chunks, with the same results."""
    monkeypatch.setattr(mps_reference, "_BLOCK_TERMS", 64)
    for block in (1, 8):
        _check(forced, _case(40, 48, 0.4, 7, torch.float32, block, seed=1), torch.float32, block)


def test_reference_padding_keeps_infinities_out():
    """An infinite input reaches only the outputs its edges feed (the padding's zero weights are masked, not
    multiplied), as in the kernels."""
    topo = CSRTopology.from_mask(torch.tensor([[True, False], [False, True]]))
    x = torch.tensor([[float("inf"), 1.0]])
    args = topo.kernel_args()
    from torch_sparse_metal.ops._csr_linear import check_forward

    w = torch.ones(2)
    y = mps_reference.forward(x, w, args, check_forward(x, w, *args))
    assert y[0, 0].isinf() and y[0, 1].item() == 1.0


def _failing_bfloat(source: str):
    if "X(bfloat)" in source:  # only the bfloat library instantiates bfloat kernels (the type list)
        raise RuntimeError("program_source:12:3: error: unknown type name 'bfloat4'")
    return compile_shader(source)


def test_compile_failure_costs_only_its_dtype(monkeypatch):
    """A bfloat library that does not compile: float32 keeps the Metal kernels; bfloat16 runs the reference path
    with exactly one warning, naming the family, dtype, Metal language, torch and macOS versions, the compiler's
    log, and the command to report with."""
    monkeypatch.setattr(metal, "_force_reference", False)
    monkeypatch.setattr(mps_reference, "_warned", set())
    compiled: list[str] = []
    host = MetalCsrLinear(lambda src: compiled.append(src) or _failing_bfloat(src), "cpu", poison=True)
    case = _case(37, 45, 0.3, 5, torch.float32, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # float32 warns nothing
        _check(host, case, torch.float32, 1)
    assert not host.runs_reference(torch.float32) and torch.float32 not in host.failures
    assert len(compiled) == 1 and "X(float)" in compiled[0] and "X(half)" not in compiled[0]
    bf16 = _case(37, 45, 0.3, 5, torch.bfloat16, 1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _check(host, bf16, torch.bfloat16, 1)
        host.forward(bf16[2], bf16[1], *bf16[0].kernel_args())
    fallback = [w for w in seen if issubclass(w.category, mps_reference.MetalFallbackWarning)]
    assert len(fallback) == 1, [str(w.message) for w in seen]
    assert len(compiled) == 2  # the failure is remembered, not recompiled at each call
    text = str(fallback[0].message)
    for part in ("csr_linear.metal", "torch.bfloat16", "Metal language", f"torch {torch.__version__}",
                 f"macOS {platform.mac_ver()[0] or 'none'}", "unknown type name 'bfloat4'",
                 "python -m torch_sparse_metal_tools.selfcheck --json report.json", "issue",
                 "TORCH_SPARSE_METAL_METAL"):
        assert part in text, (part, text)
    with pytest.raises(RuntimeError, match=r"torch.bfloat16 failed to compile .*Metal language"):
        host.library_for(torch.bfloat16)


def _calls_since(before: Counter) -> dict:
    """Calls by (family, dtype, path) since ``before`` (a copy of metal.CALLS_BY_PATH)."""
    return dict(Counter(metal.CALLS_BY_PATH) - before)


@pytest.mark.parametrize("failing", ["every bfloat kernel", "spmm and vector_spmm"])
def test_pipeline_failure_falls_back_for_its_family_and_dtype(monkeypatch, failing):
    """bfloat16 libraries that compile, but whose pipelines cannot be created (every kernel's, or only one the call
    reaches after another kernel ran): each family's first bfloat16 call falls back to the reference path and
    matches float64; the failure is remembered (never looked up again), warned about once per family and dtype,
    naming both and the kernel; float32 and float16 keep the Metal kernels."""
    monkeypatch.setattr(metal, "_force_reference", False)
    monkeypatch.setattr(mps_reference, "_warned", set())
    if failing == "every bfloat kernel":
        picks = lambda name: "bfloat" in name.split("_")  # noqa: E731
    else:
        # spmm runs after forward_operands: the call falls back with a kernel of it already dispatched
        picks = lambda name: name.startswith(("spmm_bfloat", "vector_spmm_v8_bfloat"))  # noqa: E731
    faults = FailingPipelines(compile_shader, picks)
    host = MetalCsrLinear(faults, "cpu", poison=True)
    before = Counter(metal.CALLS_BY_PATH)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for block in (1, 8):
            for dtype in DTYPES:
                _check(host, _case(37, 45, 0.3, 5, dtype, block, seed=block), dtype, block)
                _check(host, _case(33, 96, 0.5, 1, dtype, block, seed=2), dtype, block)
    fallback = [w for w in seen if issubclass(w.category, mps_reference.MetalFallbackWarning)]
    assert len(fallback) == 2, [str(w.message) for w in seen]
    assert len(faults.attempts) == 2  # one failed lookup per family: not retried at each call
    for family, warning, attempt in zip(("csr_linear.metal", "vector_csr_linear.metal"), fallback, faults.attempts):
        text = str(warning.message)
        for part in (f"kernels of {family} for torch.bfloat16", f"pipeline of kernel {attempt} could not be created",
                     PIPELINE_ERROR, "Metal language", f"torch {torch.__version__}",
                     "python -m torch_sparse_metal_tools.selfcheck --json report.json", "TORCH_SPARSE_METAL_METAL"):
            assert part in text, (part, text)
    for layout in host.layouts.values():
        assert set(layout.failures) == {torch.bfloat16}
        assert isinstance(layout.failures[torch.bfloat16], metal.MetalUnavailable)
    # Every call is counted on the path that produced its result: 1 forward + 2 x 2 backward per case and layout.
    calls = _calls_since(before)
    families = ("csr_linear.metal", "vector_csr_linear.metal")
    assert calls == {(f, d, "reference" if d == torch.bfloat16 else "metal"): 10 for f in families for d in DTYPES}


def test_selfcheck_paths_find_a_failing_pipeline_before_any_call(monkeypatch):
    """selfcheck.paths creates each dtype's pipelines, so a pipeline that cannot be created shows as the reference
    path, with its reason, before any call reaches it."""
    from torch_sparse_metal_tools import selfcheck

    monkeypatch.setattr(metal, "_force_reference", False)
    failing = "vector_sddmm_v16_half"
    host = MetalCsrLinear(FailingPipelines(compile_shader, lambda name: name == failing), "cpu")
    found = selfcheck.paths(host)
    assert found["unstructured"] == {"float32": "metal", "float16": "metal", "bfloat16": "metal"}
    assert found["vector"]["float32"] == found["vector"]["bfloat16"] == "metal"
    assert found["vector"]["float16"].startswith("reference (") and failing in found["vector"]["float16"]
    assert host.vector.runs_reference(torch.float16) and not host.runs_reference(torch.float16)


@pytest.mark.parametrize("torch_version,mac,expected", [("2.13.0", "14.5", "3.1"), ("2.14.0", "15.1", "3.2"),
                                                        ("2.15.0", "26.0", "4.0"), ("2.10.0", "15.0", "3.1"),
                                                        ("2.7.1", "13.6", "3.0"), ("2.13.0", "", "unknown")])
def test_metal_version_named_in_reports(torch_version, mac, expected):
    from torch_sparse_metal.backends.metal_platform import metal_version

    assert metal_version(torch_version, mac).startswith(expected)


def test_an_error_of_the_host_code_is_not_a_fallback(monkeypatch):
    """Only the compiler's failure falls back: an error in building the source (the host's own code) is raised as it
    is, and nothing is remembered, so no call runs the reference path in place of a bug."""
    monkeypatch.setattr(metal, "_force_reference", False)
    host = MetalCsrLinear(_never_compiles, "cpu")
    monkeypatch.setattr(host, "source", lambda: "")  # a source builder of the wrong signature
    case = _case(37, 45, 0.3, 5, torch.float32, 1)
    with pytest.raises(TypeError):
        host.forward(case[2], case[1], *case[0].kernel_args())
    assert host.failures == {}


def test_platform_refusal_is_not_a_fallback(monkeypatch):
    """No MPS or too old a macOS is the platform check's error, raised as before, never the reference path."""
    monkeypatch.setattr(metal, "_force_reference", False)

    def refuse():
        raise RuntimeError("MPS is not available on this machine")

    host = MetalCsrLinear(_never_compiles, "cpu", check_platform=refuse)
    with pytest.raises(RuntimeError, match="MPS is not available"):
        host.runs_reference(torch.float32)


def test_selfcheck_says_which_path_runs(monkeypatch):
    """selfcheck.paths names the path of each layout and dtype, and why a dtype falls back."""
    from torch_sparse_metal_tools import selfcheck

    monkeypatch.setattr(metal, "_force_reference", False)
    host = MetalCsrLinear(_failing_bfloat, "cpu")
    found = selfcheck.paths(host)
    assert found["unstructured"]["float32"] == found["vector"]["float16"] == "metal"
    assert found["unstructured"]["bfloat16"].startswith("reference (") and "bfloat4" in found["vector"]["bfloat16"]
    monkeypatch.setattr(metal, "_force_reference", True)
    assert {v.split(" (")[0] for v in selfcheck.paths(host)["vector"].values()} == {"reference"}
