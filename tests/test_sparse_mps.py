"""torch's own sparse CSR / CSC products on MPS (issue #39), verified without a Mac: every registered product
kernel is a plain function of tensors (torch_sparse_metal.sparse_mps), run here with the real Metal kernels under the
MSL-on-CPU executor on CPU tensors (poisoned outputs) against float64 dense references and torch's CPU sparse results,
on torch's OpInfo samples and the shapes of the users' threads (scaled down); the dispatch path (torch's API and its
derivative formulas) runs in a separate process with the kernels registered for SparseCsrCPU; the registrations are
checked by name against the dispatcher."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import torch_sparse_metal  # noqa: F401  (registers the MPS kernels)
from torch_sparse_metal import sparse_mps, sparse_mps_ops
from torch_sparse_metal.backends.mps import MetalCsrLinear
from torch_sparse_metal.sparse_mps import RefusedError
from torch_sparse_metal.testing import axes
from tsm_dev.msl import compile_shader

ROOT = Path(__file__).resolve().parents[1]
DTYPES = sparse_mps.DTYPES
warnings.filterwarnings("ignore", message="Sparse (CSR tensor support is in beta|invariant checks)")


@pytest.fixture(scope="module")
def metal() -> MetalCsrLinear:
    return MetalCsrLinear(compile_shader, device_type="cpu", poison=True)


def random_sparse(m: int, k: int, nnz: int, seed: int, *, empty_row: bool = True) -> torch.Tensor:
    """A dense [m, k] float64 matrix with ``nnz`` random nonzeros (fresh positions per seed)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.zeros(m * k, dtype=torch.float64)
    a[torch.randperm(m * k, generator=g)[:nnz]] = torch.randn(nnz, generator=g, dtype=torch.float64)
    a = a.reshape(m, k)
    if empty_row and m > 2:
        a[m // 2] = 0
    return a


# (m, k, nnz, p): the users' shapes scaled down (bag-of-words 3 x 214,000 with 92 nonzeros; 20,000^2 with
# 10-100,000 nonzeros times 20,000 x 200), and edges: 1 x N, N x 1, zero nnz, a full matrix, sizes off the SIMD width.
SHAPES = [(3, 2140, 92, 4), (400, 400, 80, 20), (400, 400, 2000, 7), (1, 50, 10, 3), (50, 1, 10, 3),
          (9, 7, 0, 5), (6, 5, 30, 33), (37, 45, 300, 1), (5, 8, 12, 0)]
IDS = [f"{m}x{k}-nnz{n}-p{p}" for m, k, n, p in SHAPES]


def _check(what, got, a64, b64, dtype):
    exact, magnitude = a64 @ b64, a64.abs() @ b64.abs()
    terms = max(int((a64 != 0).sum(1).max()) if a64.numel() else 0, int((a64 != 0).sum(0).max()) if a64.numel()
                else 0)
    axes.assert_within_bound(what, got, exact, magnitude, max(terms, 1), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_mm_both_sides_and_layouts(metal, shape, dtype):
    """A @ D, D @ A, A^T @ D and D @ A^T for A in CSR and in CSC, against float64 dense of the rounded inputs."""
    m, k, nnz, p = shape
    a64 = random_sparse(m, k, nnz, seed=m + k + nnz + p).to(dtype).double()
    g = torch.Generator().manual_seed(p)
    right, left = torch.randn(k, p, generator=g).to(dtype), torch.randn(p, m, generator=g).to(dtype)
    for layout in ("csr", "csc"):
        a = a64.to(dtype).to_sparse_csr() if layout == "csr" else a64.t().contiguous().to(dtype).to_sparse_csc().t()
        assert a.shape == (m, k)
        _check(f"{layout} @ D", sparse_mps.mm(a, right, metal), a64, right.double(), dtype)
        _check(f"D @ {layout}", sparse_mps.mm(left, a, metal), left.double(), a64, dtype)
        _check(f"{layout}^T @ D", sparse_mps.mm(a.t(), left.t(), metal), a64.t(), left.double().t(), dtype)
        _check(f"D @ {layout}^T", sparse_mps.mm(right.t(), a.t(), metal), right.double().t(), a64.t(), dtype)


@pytest.mark.parametrize("shape", SHAPES[:4], ids=IDS[:4])
def test_mm_and_addmm_match_torch_cpu_sparse(metal, shape):
    """float32 against torch's own CPU CSR kernels, addmm with beta/alpha and a broadcast input; beta=0 drops NaN."""
    m, k, nnz, p = shape
    a = random_sparse(m, k, nnz, seed=7 * m + k).float().to_sparse_csr()
    d = torch.randn(k, p)
    torch.testing.assert_close(sparse_mps.mm(a, d, metal), torch.mm(a, d), rtol=1e-5, atol=1e-5)
    c = torch.randn(p)
    torch.testing.assert_close(sparse_mps.addmm(c, a, d, beta=0.5, alpha=-2.0, kernels=metal),
                               torch.addmm(c, a, d, beta=0.5, alpha=-2.0), rtol=1e-5, atol=1e-5)
    nan = torch.full((m, p), float("nan"))
    torch.testing.assert_close(sparse_mps.addmm(nan, a, d, beta=0, kernels=metal), torch.mm(a, d), rtol=1e-5,
                               atol=1e-5)


def _opinfo_samples(name):
    pytest.importorskip("expecttest")  # torch.testing._internal imports it
    from torch.testing._internal.common_methods_invocations import op_db

    (op,) = [o for o in op_db if o.name == name]
    return list(op.sample_inputs("cpu", torch.float32))


def test_sampled_addmm_on_torch_opinfo_samples(metal):
    """torch's own OpInfo samples of sparse.sampled_addmm (including 0-sized ones), against torch's CPU result."""
    for s in _opinfo_samples("sparse.sampled_addmm"):
        ref = torch.sparse.sampled_addmm(s.input, *s.args, **s.kwargs)
        got = sparse_mps.sampled_addmm(s.input, *s.args, **s.kwargs, kernels=metal)
        assert got.layout == torch.sparse_csr and torch.equal(got.crow_indices(), ref.crow_indices())
        torch.testing.assert_close(got.to_dense(), ref.to_dense(), rtol=1e-5, atol=1e-5)


def test_mm_on_torch_opinfo_samples(metal):
    """torch's OpInfo samples of sparse.mm (the 'sum' reduction, which is plain torch.sparse.mm)."""
    for s in _opinfo_samples("sparse.mm"):
        if s.args[1] != "sum":
            continue
        torch.testing.assert_close(sparse_mps.mm(s.input, s.args[0], metal), torch.sparse.mm(s.input, s.args[0]),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_sampled_addmm_against_float64(metal, shape, dtype):
    m, k, nnz, d = shape
    mask64 = random_sparse(m, k, nnz, seed=m * k + d)
    mask = mask64.to(dtype).to_sparse_csr()
    g = torch.Generator().manual_seed(d)
    u, v = torch.randn(m, d, generator=g).to(dtype), torch.randn(d, k, generator=g).to(dtype)
    got = sparse_mps.sampled_addmm(mask, u, v, beta=0, kernels=metal)
    pattern = mask.to_dense() != 0
    exact, mag = (u.double() @ v.double()) * pattern, (u.double().abs() @ v.double().abs()) * pattern
    assert torch.equal(got.col_indices(), mask.col_indices()) and torch.equal(got.crow_indices(), mask.crow_indices())
    axes.assert_within_bound("sampled", got.to_dense(), exact, mag, max(d, 1), dtype)
    # beta and alpha: combined in float32 from the kernel's rounded product, rounded once more
    scaled = sparse_mps.sampled_addmm(mask, u, v, beta=0.5, alpha=2.0, kernels=metal)
    expected = (2.0 * got.values().float() + 0.5 * mask.values().float()).to(dtype)
    assert torch.equal(scaled.values(), expected)


@pytest.mark.parametrize("seed", [0, 1])
def test_torch_api_and_autograd_through_our_kernels(seed):
    """torch.mm, torch.sparse.mm, @, matmul, addmm, sparse.addmm, sampled_addmm, F.linear and mv, with CSR and CSC
    on either side, forward and gradients to the dense operand and the sparse values (torch's own derivative
    formulas, and the gradients' layouts), with our kernels registered for SparseCsrCPU in a fresh process, against
    torch's CPU kernels."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "_sparse_mps_emulation.py"), str(seed)], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert int(r.stdout.split("calls ")[-1]) >= 11


EXPECTED = {("aten::mm", "SparseCsrMPS"), ("aten::addmm", "SparseCsrMPS"), ("aten::mv", "SparseCsrMPS"),
            ("aten::sparse_sampled_addmm", "SparseCsrMPS"), ("aten::sparse_mask", "SparseCsrMPS"),
            ("aten::crow_indices", "SparseCsrMPS"), ("aten::values", "SparseCsrMPS"), ("aten::clone", "SparseCsrMPS"),
            ("aten::_to_sparse_csr", "MPS"), ("aten::_to_sparse_csr", "SparseMPS"),
            ("aten::_convert_indices_from_coo_to_csr", "MPS")}


def test_registrations_by_name():
    """Every kernel the products and torch's formulas need on MPS has a kernel for its key after import (ours, or
    torch's own on a torch that has one)."""
    for name, key in EXPECTED | set(sparse_mps_ops.registered()):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key), (name, key)


def test_cpu_and_cuda_keys_untouched():
    """The registrations of torch's CPU and CUDA keys are the same with and without importing the package."""
    code = ("import json, sys, torch\n"
            "keys = ['CPU', 'CUDA', 'SparseCPU', 'SparseCUDA', 'SparseCsrCPU', 'SparseCsrCUDA']\n"
            "get = lambda: {k: sorted(torch._C._dispatch_get_registrations_for_dispatch_key(k)) for k in keys}\n"
            "before = get()\n"
            "import torch_sparse_metal\n"
            "after = get()\n"
            "print(json.dumps({k: sorted(set(after[k]) ^ set(before[k])) for k in keys}))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    diff = json.loads(r.stdout.strip().splitlines()[-1])
    assert all(not [op for op in v if op.startswith("aten::")] for v in diff.values()), diff


def test_refusals_name_the_op_and_what_to_do(metal):
    a = torch.eye(3).to_sparse_csr()
    d = torch.ones(3, 2)
    cases = [
        (lambda: sparse_mps.mm(a.double(), d.double(), metal), "torch.mm", "float64"),
        (lambda: sparse_mps.mm(a.to(torch.complex64), d.to(torch.complex64), metal), "torch.mm", "complex"),
        (lambda: sparse_mps.mm(a, a, metal), "torch.mm", "to_dense"),
        (lambda: sparse_mps.mm(torch.eye(3).expand(2, 3, 3).to_sparse_csr(), d, metal), "torch.mm", "batch"),
        (lambda: sparse_mps.mm(torch.ones(3, 3, 2).to_sparse_csr(dense_dim=1), d, metal), "torch.mm", "dense dims"),
        (lambda: sparse_mps.mm(torch.eye(4).to_sparse_bsr((2, 2)), torch.ones(4, 2), metal), "torch.mm", "to_sparse"),
        (lambda: sparse_mps.sampled_addmm(a.to_sparse_csc(), d, d.t(), kernels=metal), "sampled_addmm",
         "to_sparse_csr"),
        (lambda: sparse_mps.addmm(a, a, d, kernels=metal), "torch.addmm", "dense input"),
    ]
    for fn, op, hint in cases:
        with pytest.raises(RefusedError, match="on MPS") as e:
            fn()
        assert op in str(e.value) and hint in str(e.value), str(e.value)
    for name, instead in sparse_mps_ops.REFUSED.items():
        with pytest.raises(RefusedError, match=f"aten::{name}.*on MPS"):
            sparse_mps_ops._refusal(name, instead)()


def test_conversions_on_the_device_match_torch():
    """dense -> CSR, COO -> CSR and both index conversions, as torch's CPU kernels give them."""
    dense = random_sparse(7, 5, 12, seed=3).float()
    got, ref = sparse_mps.dense_to_csr(dense), dense.to_sparse_csr()
    for f in ("crow_indices", "col_indices", "values"):
        assert torch.equal(getattr(got, f)(), getattr(ref, f)()), f
    got = sparse_mps.coo_to_csr(dense.to_sparse_coo())
    assert torch.equal(got.to_dense(), dense) and torch.equal(got.crow_indices(), ref.crow_indices())
    rows = ref.to_sparse_coo().indices()[0]
    for out_int32 in (False, True):
        assert torch.equal(sparse_mps.indices_coo_to_csr(rows, 7, out_int32=out_int32),
                           torch._convert_indices_from_coo_to_csr(rows, 7, out_int32=out_int32))
        for transpose in (False, True):
            assert torch.equal(
                sparse_mps.indices_csr_to_coo(ref.crow_indices(), ref.col_indices(), out_int32=out_int32,
                                            transpose=transpose),
                torch._convert_indices_from_csr_to_coo(ref.crow_indices(), ref.col_indices(), out_int32=out_int32,
                                                       transpose=transpose))
    empty = sparse_mps.dense_to_csr(torch.zeros(3, 4))
    assert empty._nnz() == 0 and empty.crow_indices().tolist() == [0, 0, 0, 0]


def test_topology_cache_follows_in_place_index_changes(metal):
    a = torch.tensor([[0.0, 2.0], [3.0, 0.0]]).to_sparse_csr()
    d = torch.tensor([[1.0], [10.0]])
    assert sparse_mps.mm(a, d, metal).tolist() == [[20.0], [3.0]]
    a.col_indices().copy_(torch.tensor([0, 1]))  # same storage, new version
    assert sparse_mps.mm(a, d, metal).tolist() == [[2.0], [30.0]]


def test_benchmark_smoke_run_on_the_cpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sparse_mps_bench.py"), "--device", "cpu",
                        "--quick", "--reps", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(r.stdout)["rows"]
    assert {row["method"] for row in rows} == {"csr", "coo", "dense", "cpu_csr"}
    assert all(row["fwd_ms"] > 0 and row["fwd_bwd_ms"] > 0 for row in rows)


def test_example_trains_on_the_cpu():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "sparse_mps_train.py"), "--device", "cpu",
                        "--steps", "60"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    accuracies = [float(line.rsplit(" ", 1)[1]) for line in r.stdout.splitlines() if "accuracy" in line]
    assert len(accuracies) == 2 and min(accuracies) > 0.7, r.stdout
