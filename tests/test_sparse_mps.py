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
from _helpers import run_python_json

import torch_sparse_metal  # noqa: F401  (registers the MPS kernels)
from torch_sparse_metal import sparse_mps, sparse_mps_ops
from torch_sparse_metal.backends.mps import MetalCsrLinear
from torch_sparse_metal.sparse_mps import RefusedError
from torch_sparse_metal_tools.testing import axes
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
            ("aten::_to_sparse_csr", "MPS"), ("aten::_to_sparse_csr", "SparseMPS"), ("aten::_to_sparse_csc", "MPS"),
            ("aten::_to_sparse_csc", "SparseMPS"), ("aten::_to_sparse_csc", "SparseCsrMPS"),
            ("aten::_convert_indices_from_coo_to_csr", "MPS"), ("aten::_convert_indices_from_csr_to_coo", "MPS")}


def test_registrations_by_name():
    """Every kernel the products, conversions and torch's formulas need on MPS has a kernel for its key after import
    (ours, or torch's own on a torch that has one); every entry of sparse_mps_ops was registered or skipped with a
    reason, and on this torch (no MPS kernels in a Linux build) none was skipped."""
    for name, key in EXPECTED | set(sparse_mps_ops.registered()):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, key), (name, key)
    entries = {(f"aten::{n}", k) for n, k in sparse_mps_ops.entries()}
    assert EXPECTED <= entries and set(sparse_mps_ops.registered()) | set(sparse_mps_ops.skipped()) == entries
    assert sparse_mps_ops.skipped() == {}


def test_cpu_and_cuda_keys_untouched():
    """The registrations of torch's CPU and CUDA keys are the same with and without importing the package."""
    code = ("import json, sys, torch\n"
            "keys = ['CPU', 'CUDA', 'SparseCPU', 'SparseCUDA', 'SparseCsrCPU', 'SparseCsrCUDA']\n"
            "get = lambda: {k: sorted(torch._C._dispatch_get_registrations_for_dispatch_key(k)) for k in keys}\n"
            "before = get()\n"
            "import torch_sparse_metal\n"
            "after = get()\n"
            "print(json.dumps({k: sorted(set(after[k]) ^ set(before[k])) for k in keys}))\n")
    diff = run_python_json(code)
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
        with pytest.raises(RefusedError, match=f"aten::{name}.*on MPS") as e:
            sparse_mps_ops.kernel(name, sparse_mps_ops.KEY)()
        assert instead in str(e.value)


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


# --------------------------------------------------------------------------- conversions and batched sampled_addmm
def _compressed_arrays(t):
    if t.layout == torch.sparse_csr:
        return t.crow_indices(), t.col_indices(), t.values()
    return t.ccol_indices(), t.row_indices(), t.values()


def _batch_of(shape, nnz, seed, dtype=torch.float64):
    """A dense [*batch, m, k] tensor whose matrices share one random pattern (torch needs equal counts per batch) of
    ``nnz`` entries, with an empty row where m > 2, and fresh values per matrix (at least 1 in magnitude: nonzero in
    an integer dtype too)."""
    g = torch.Generator().manual_seed(seed)
    pattern = random_sparse(*shape[-2:], nnz, seed) != 0
    values = torch.randn(*shape, generator=g, dtype=torch.float64)
    return ((values.sign() + values) * pattern).to(dtype)


# (shape, nnz): plain, empty rows, no entries, 1 x N, N x 1, batched (one and two batch dims), empty matrices
CONVERSIONS = [((9, 7), 20), ((9, 7), 0), ((1, 13), 5), ((13, 1), 4), ((3, 6, 5), 9), ((2, 3, 4, 6), 7),
               ((2, 0, 4), 0), ((2, 4, 0), 0), ((4, 4), 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64], ids=str)
@pytest.mark.parametrize("shape,nnz", CONVERSIONS, ids=[f"{s}-nnz{n}" for s, n in CONVERSIONS])
def test_dense_to_csr_and_csc_match_torch(shape, nnz, dtype):
    """dense.to_sparse_csr() / .to_sparse_csc() (aten::_to_sparse_csr/_csc, key MPS): torch's CPU arrays, bitwise."""
    dense = _batch_of(shape, nnz, seed=sum(shape) + nnz).to(dtype)
    for ours, theirs in ((sparse_mps.dense_to_csr, dense.to_sparse_csr), (sparse_mps.dense_to_csc,
                                                                         dense.to_sparse_csc)):
        got, ref = ours(dense), theirs()
        assert got.layout == ref.layout and got.shape == ref.shape
        for g, r in zip(_compressed_arrays(got), _compressed_arrays(ref)):
            assert g.dtype == r.dtype and torch.equal(g, r), (ours.__name__, g, r)


def test_dense_conversions_refuse_as_torch_does():
    with pytest.raises(RuntimeError, match="same number of specified elements per batch"):
        x = torch.zeros(2, 3, 3)
        x[0, 0, 0] = 1
        sparse_mps.dense_to_csr(x)
    with pytest.raises(RuntimeError, match="product of batch dimensions to be non-zero"):
        sparse_mps.dense_to_csc(torch.zeros(0, 3, 3))
    for bad in (torch.ones(4), torch.ones(2, 2)):
        with pytest.raises(RefusedError, match="Tensor.to_sparse_csc on MPS.*dense dims"):
            sparse_mps.dense_to_csc(bad, dense_dim=1 if bad.dim() == 2 else None)


COO = [c for c in CONVERSIONS if len(c[0]) == 2]


@pytest.mark.parametrize("shape,nnz", COO, ids=[f"{s}-nnz{n}" for s, n in COO])
def test_coo_to_csc_matches_torch(shape, nnz):
    dense = _batch_of(shape, nnz, seed=3 * nnz + 1).float()
    coo = dense.to_sparse_coo()
    got, ref = sparse_mps.coo_to_csc(coo), coo.to_sparse_csc()
    assert got.layout == torch.sparse_csc and got.shape == ref.shape
    assert all(torch.equal(g, r) for g, r in zip(_compressed_arrays(got), _compressed_arrays(ref)))
    uncoalesced = torch.sparse_coo_tensor(torch.tensor([[1, 0, 1], [0, 1, 0]]), torch.tensor([1.0, 2.0, 3.0]), (2, 2))
    assert sparse_mps.coo_to_csc(uncoalesced).to_dense().tolist() == [[0.0, 2.0], [4.0, 0.0]]
    batched = _batch_of((2, 3, 4), 3, seed=0).to_sparse_coo()  # torch's CPU kernels refuse this too
    for ours, theirs in ((sparse_mps.coo_to_csc, batched.to_sparse_csc), (sparse_mps.coo_to_csr,
                                                                         batched.to_sparse_csr)):
        with pytest.raises(RefusedError, match="2-D COO"):
            ours(batched)
        with pytest.raises(RuntimeError, match="sparse_dim"):
            theirs()


def test_batched_index_conversion_matches_torch():
    ref = _batch_of((2, 3, 5, 4), 6, seed=11).to_sparse_csr()
    for out_int32 in (False, True):
        for transpose in (False, True):
            args = (ref.crow_indices(), ref.col_indices())
            assert torch.equal(sparse_mps.indices_csr_to_coo(*args, out_int32=out_int32, transpose=transpose),
                               torch._convert_indices_from_csr_to_coo(*args, out_int32=out_int32,
                                                                      transpose=transpose))


def test_csr_csc_flips_route_through_our_index_kernels(monkeypatch):
    """csr.to_sparse_csc() and csc.to_sparse_csr() on MPS are torch's own SparseCsrCPU kernels (by redispatch),
    which convert indices through aten::_convert_indices_from_csr_to_coo / _coo_to_csr: on MPS, ours. With ours
    standing in for torch's CPU kernels they must give torch's arrays, batched too, and be called."""
    calls = []
    for name in ("indices_csr_to_coo", "indices_coo_to_csr"):
        real = getattr(sparse_mps, name)
        monkeypatch.setattr(sparse_mps, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or
                            _real(*a, **k))
    cases = [_batch_of(s, n, seed=5 + n) for s, n in (((9, 7), 20), ((9, 7), 0), ((1, 13), 5), ((3, 6, 5), 9))]
    refs = [(d.to_sparse_csr().to_sparse_csc(), d.to_sparse_csc().to_sparse_csr()) for d in cases]
    with sparse_mps_ops.on_cpu_keys(sparse_mps.OPS):
        got = [(d.to_sparse_csr().to_sparse_csc(), d.to_sparse_csc().to_sparse_csr()) for d in cases]
    assert {"indices_csr_to_coo", "indices_coo_to_csr"} <= set(calls)
    for pair, ref_pair in zip(got, refs):
        for g, r in zip(pair, ref_pair):
            assert g.layout == r.layout and all(torch.equal(x, y) for x, y in zip(_compressed_arrays(g),
                                                                                  _compressed_arrays(r)))


def test_on_cpu_keys_puts_torchs_kernels_back():
    a = random_sparse(6, 5, 9, seed=2).float().to_sparse_csr()
    d = torch.randn(5, 3)
    keys = ("CPU", "SparseCPU", "SparseCsrCPU")
    before = {k: sorted(torch._C._dispatch_get_registrations_for_dispatch_key(k)) for k in keys}

    class Wrong:
        def forward(self, x, weight, *topology):
            return sparse_mps.OPS.forward(x, weight, *topology) + 1

    ref = (a.to_dense() @ d).t()
    with sparse_mps_ops.on_cpu_keys(Wrong()) as replaced:
        assert ("aten::mm", "SparseCsrCPU") in replaced and ("aten::_to_sparse_csc", "CPU") in replaced
        assert torch.allclose(torch.mm(d.t(), a.t()), ref + 1)  # ours, through torch's API
        with pytest.raises(RefusedError, match="aten::bmm"):
            torch.bmm(_batch_of((2, 3, 3), 2, seed=0).float().to_sparse_csr(), torch.ones(2, 3, 1))
    assert torch.allclose(torch.mm(d.t(), a.t()), ref)  # torch's again
    assert {k: sorted(torch._C._dispatch_get_registrations_for_dispatch_key(k)) for k in keys} == before


BATCHED = [((3, 7, 6), (3,), 12, 4), ((7, 6), (3,), 12, 4), ((2, 3, 5, 4), (2, 3), 6, 5), ((5, 4), (2, 2), 0, 3),
           ((2, 1, 9), (2,), 4, 2), ((2, 9, 1), (2,), 3, 1), ((2, 6, 6), (2,), 10, 0), ((0, 4, 4), (0,), 5, 3)]
BATCHED_IDS = [f"in{s}-b{b}-nnz{n}-d{d}" for s, b, n, d in BATCHED]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape,batch,nnz,d", BATCHED, ids=BATCHED_IDS)
def test_batched_sampled_addmm_matches_torch_cpu(metal, shape, batch, nnz, d, dtype):
    """torch.sparse.sampled_addmm with a batch: a [*B, m, k] CSR input (or a 2-D one for every batch) and
    [*B, m, d] @ [*B, d, k]; one block-diagonal kernel call, against torch's CPU kernel in float64 on the same
    rounded inputs (its indices exactly, values within the dtype's bound), beta/alpha too."""
    m, k = shape[-2:]
    if 0 in shape[:-2]:
        inp = torch.sparse_csr_tensor(torch.zeros(0, m + 1, dtype=torch.long), torch.zeros(0, nnz, dtype=torch.long),
                                      torch.zeros(0, nnz), (0, m, k)).to(dtype)
    else:
        inp = _batch_of(shape, nnz, seed=m * k + nnz + d).to(dtype).to_sparse_csr()
    g = torch.Generator().manual_seed(d + 17)
    u = torch.randn(*batch, m, d, generator=g).to(dtype)
    v = torch.randn(*batch, d, k, generator=g).to(dtype)
    ref = torch.sparse.sampled_addmm(inp.to(torch.float64), u.double(), v.double(), beta=0, alpha=1)
    got = sparse_mps.sampled_addmm(inp, u, v, beta=0, kernels=metal)
    assert got.layout == torch.sparse_csr and got.shape == ref.shape and got.dtype == dtype
    assert torch.equal(got.crow_indices(), ref.crow_indices()) and torch.equal(got.col_indices(), ref.col_indices())
    pattern = ref.to_dense() != 0 if ref.values().numel() else torch.zeros(ref.shape, dtype=torch.bool)
    mask = (inp.to_dense() != 0).expand(ref.shape) if inp.values().numel() else pattern
    magnitude = (u.double().abs() @ v.double().abs()) * mask
    axes.assert_within_bound("batched sampled", got.to_dense(), (u.double() @ v.double()) * mask, magnitude,
                             max(d, 1), dtype)
    scaled = sparse_mps.sampled_addmm(inp, u, v, beta=0.5, alpha=-2.0, kernels=metal)
    base = inp.values().expand(got.values().shape)
    assert torch.equal(scaled.values(), (-2.0 * got.values().float() + 0.5 * base.float()).to(dtype))


def test_batched_sampled_addmm_float32_matches_torch_exactly_enough(metal):
    inp = _batch_of((4, 20, 30), 90, seed=8).float().to_sparse_csr()
    u, v = torch.randn(4, 20, 16), torch.randn(4, 16, 30)
    torch.testing.assert_close(sparse_mps.sampled_addmm(inp, u, v, beta=0.3, alpha=1.7, kernels=metal).to_dense(),
                               torch.sparse.sampled_addmm(inp, u, v, beta=0.3, alpha=1.7).to_dense(),
                               rtol=1e-5, atol=1e-5)


def test_batched_sampled_addmm_refuses_as_torch_does(metal):
    inp = _batch_of((2, 3, 4), 5, seed=1).float().to_sparse_csr()
    cases = [(inp, torch.ones(3, 3, 2), torch.ones(3, 2, 4), "same batch shape"),  # input batch != mats' batch
             (inp, torch.ones(2, 3, 2), torch.ones(2, 2, 5), "shape of input"),
             (inp, torch.ones(2, 3, 2), torch.ones(3, 2, 4), "same batch shape"),
             (inp, torch.ones(3, 2), torch.ones(2, 4), "same batch shape")]  # torch: self batched, mats not
    for a, u, v, message in cases:
        with pytest.raises(RuntimeError, match=message):
            sparse_mps.sampled_addmm(a, u, v, kernels=metal)
        with pytest.raises(RuntimeError):
            torch.sparse.sampled_addmm(a, u, v)  # torch's CPU kernel refuses these too
    with pytest.raises(RefusedError, match="float64"):
        sparse_mps.sampled_addmm(inp.double(), torch.ones(2, 3, 2).double(), torch.ones(2, 2, 4).double(),
                                 kernels=metal)


def test_batched_sampled_addmm_through_torchs_api(metal):
    """torch.sparse.sampled_addmm with a batched CSR reaches our kernel through the dispatcher (forward); its backward
    is refused naming the op (torch's CPU kernels have none either)."""
    inp = _batch_of((2, 5, 6), 8, seed=4).float().to_sparse_csr()
    u, v = torch.randn(2, 5, 3), torch.randn(2, 3, 6)
    ref = torch.sparse.sampled_addmm(inp, u, v, beta=0.5)
    with sparse_mps_ops.on_cpu_keys(metal):
        got = torch.sparse.sampled_addmm(inp, u, v, beta=0.5)
        u.requires_grad_()
        out = torch.sparse.sampled_addmm(inp, u, v)
        with pytest.raises(RefusedError, match="on MPS.*loop over the batch"):
            out.values().sum().backward()
    torch.testing.assert_close(got.to_dense(), ref.to_dense(), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError):  # torch's own CPU backward
        torch.sparse.sampled_addmm(inp, u, v).values().sum().backward()
