"""torch's own sparse API on the MPS path, reached as users reach it: below autograd, through the kernels that
torch_sparse_metal.sparse_mps_ops registers, with the real Metal kernels under the MSL-on-CPU executor standing in for
torch's CPU kernels (``sparse_mps_ops.on_cpu_keys``); every reference is torch's own CPU kernel (computed before the
block) or float64 dense math. And the registration itself: what the import registers, the switch that turns it off,
and that nothing torch has a kernel for is replaced."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from _helpers import run_python_json

import torch_sparse_metal  # noqa: F401  (registers the MPS kernels)
from torch_sparse_metal import sparse_mps_ops
from torch_sparse_metal.backends.mps import MetalCsrLinear
from torch_sparse_metal.sparse_mps import RefusedError
from tsm_dev.msl import compile_shader

warnings.filterwarnings("ignore", message="Sparse (CS[RC] tensor support is in beta|invariant checks)")


class Counting:
    """The Metal kernels under the executor, counting their calls (a test that compared torch with itself would
    pass)."""

    def __init__(self) -> None:
        self.inner, self.calls = MetalCsrLinear(compile_shader, device_type="cpu", poison=True), 0

    def forward(self, *args):
        self.calls += 1
        return self.inner.forward(*args)

    def backward(self, *args):
        self.calls += 1
        return self.inner.backward(*args)


@pytest.fixture
def metal():
    kernels = Counting()
    yield kernels
    assert kernels.calls > 0, "no call reached the Metal kernels"


def pattern(m: int, k: int, per_row: list[int], g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR index arrays ``(crow, col)`` of an ``[m, k]`` matrix with ``per_row[i]`` entries in row ``i`` at fresh
    random columns (sorted, distinct, as torch's invariants ask)."""
    crow = torch.tensor([0, *per_row]).cumsum(0)
    col = torch.cat([torch.randperm(k, generator=g)[:n].sort().values for n in per_row])
    return crow, col


def dense_of(crow: torch.Tensor, col: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The float64 dense matrix of CSR arrays, built from the arrays alone (no sparse kernel of torch's)."""
    rows = torch.repeat_interleave(torch.arange(shape[0]), crow[1:] - crow[:-1])
    out = torch.zeros(shape, dtype=torch.float64)
    out[rows, col] = values.double()
    return out


def products(a: torch.Tensor, right: torch.Tensor, left: torch.Tensor, u: torch.Tensor, v: torch.Tensor):
    """What users compute with a CSR ``a``: both sides of ``mm``, ``torch.sparse.mm`` and the sampled product."""
    return {"a @ right": torch.mm(a, right), "left @ a": left @ a, "sparse.mm": torch.sparse.mm(a, right),
            "sampled": torch.sparse.sampled_addmm(a, u, v, beta=0.5).to_dense()}


def expected(dense: torch.Tensor, right: torch.Tensor, left: torch.Tensor, u: torch.Tensor, v: torch.Tensor):
    stored = dense != 0
    return {"a @ right": dense @ right.double(), "left @ a": left.double() @ dense,
            "sparse.mm": dense @ right.double(),
            "sampled": torch.where(stored, (u.double() @ v.double()) + 0.5 * dense, torch.zeros_like(dense))}


def assert_products(got, want, what):
    for name in want:
        torch.testing.assert_close(got[name].double(), want[name], rtol=1e-5, atol=1e-5, msg=f"{what}: {name}")


WRITES = ["col_indices().copy_", "through the tensor it was built from", "through .data below autograd",
          "a new CSR from refilled buffers"]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("write", WRITES)
def test_a_changed_pattern_is_what_the_next_product_uses(metal, write, seed):
    """The topology of a CSR operand is the one its index arrays hold at the call: whichever way they were rewritten
    in place since the previous call (same storage, same data pointer, same number of entries), torch.mm, D @ A,
    torch.sparse.mm and sampled_addmm through the registered kernels compute with the new pattern."""
    g = torch.Generator().manual_seed(seed)
    m, k, p = 9, 11, 4
    per_row = torch.randint(0, 5, (m,), generator=g).tolist()
    per_row[m // 2] = 0  # an empty row
    crow, col = pattern(m, k, per_row, g)
    values = torch.randn(int(crow[-1]), generator=g) + 2.0
    right, left = torch.randn(k, p, generator=g), torch.randn(p, m, generator=g)
    u, v = torch.randn(m, 3, generator=g), torch.randn(3, k, generator=g)
    crow2, col2 = pattern(m, k, per_row[::-1], g)  # the same count of entries, another pattern
    assert not torch.equal(col2, col) or not torch.equal(crow2, crow)
    a = torch.sparse_csr_tensor(crow, col, values, (m, k))
    with sparse_mps_ops.on_cpu_keys(metal):
        assert_products(products(a, right, left, u, v), expected(dense_of(crow, col, values, (m, k)), right, left,
                                                                 u, v), "first pattern")
        if write == "col_indices().copy_":
            a.crow_indices().copy_(crow2)
            a.col_indices().copy_(col2)
        elif write == "through the tensor it was built from":
            crow.copy_(crow2)
            col.copy_(col2)
        elif write == "through .data below autograd":
            a.crow_indices().data.copy_(crow2)
            a.col_indices().data.copy_(col2)
        else:
            crow.copy_(crow2)
            col.copy_(col2)
            a = torch.sparse_csr_tensor(crow, col, values, (m, k))
        assert a.col_indices().data_ptr() == col.data_ptr() or write == "col_indices().copy_"
        assert_products(products(a, right, left, u, v), expected(dense_of(crow2, col2, values, (m, k)), right, left,
                                                                 u, v), f"after a write {write}")


def test_a_changed_batched_pattern_is_what_the_next_sampled_product_uses(metal):
    g = torch.Generator().manual_seed(5)
    b, m, k, d = 3, 6, 7, 2
    crow, col = (torch.stack(t) for t in zip(*[pattern(m, k, [2] * m, g) for _ in range(b)]))
    inp = torch.sparse_csr_tensor(crow, col, torch.randn(b, 2 * m, generator=g), (b, m, k))
    u, v = torch.randn(b, m, d, generator=g), torch.randn(b, d, k, generator=g)
    first = torch.sparse.sampled_addmm(inp, u, v).to_dense()
    _, col2 = (torch.stack(t) for t in zip(*[pattern(m, k, [2] * m, g) for _ in range(b)]))
    with sparse_mps_ops.on_cpu_keys(metal):
        torch.testing.assert_close(torch.sparse.sampled_addmm(inp, u, v).to_dense(), first, rtol=1e-5, atol=1e-5)
        col.copy_(col2)
    second = torch.sparse.sampled_addmm(inp, u, v).to_dense()  # torch's CPU kernel on the rewritten indices
    assert not torch.equal(first, second)
    with sparse_mps_ops.on_cpu_keys(metal):
        torch.testing.assert_close(torch.sparse.sampled_addmm(inp, u, v).to_dense(), second, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batched", [False, True])
def test_sampled_addmm_keeps_nan_and_inf_of_the_mask_as_torch_cpu(metal, batched):
    """beta = 0 (and alpha = 0) drop no term of torch.sparse.sampled_addmm: NaN and infinity stored in the mask, or
    in mat1 / mat2, reach the result exactly as with torch's CPU kernel."""
    nan, inf = float("nan"), float("inf")
    dense = torch.tensor([[nan, 0.0, inf, 1.0], [0.0, -inf, 0.0, 2.0], [3.0, 0.0, 0.0, 0.0]])
    u, v = torch.randn(3, 5), torch.randn(5, 4)
    u[2, 1] = nan  # row 2 of the product is NaN
    if batched:
        dense, u, v = dense.expand(2, 3, 4).clone(), torch.stack((u, u.flip(0))), torch.stack((v, v))
    mask = dense.to_sparse_csr()  # NaN and infinity are nonzero: stored
    for beta, alpha in [(0, 1), (0, 0), (0, 2.5), (1, 0), (0.5, 1), (1, 1)]:
        ref = torch.sparse.sampled_addmm(mask, u, v, beta=beta, alpha=alpha)
        with sparse_mps_ops.on_cpu_keys(metal):
            got = torch.sparse.sampled_addmm(mask, u, v, beta=beta, alpha=alpha)
        assert torch.equal(got.col_indices(), ref.col_indices())
        torch.testing.assert_close(got.values(), ref.values(), rtol=1e-5, atol=1e-5, equal_nan=True,
                                   msg=f"beta={beta} alpha={alpha}")
        assert torch.equal(got.values().isnan(), ref.values().isnan()) and torch.equal(got.values().isinf(),
                                                                                      ref.values().isinf())


def test_values_with_strides_are_accepted_as_torch_cpu_does(metal):
    """A compressed tensor whose values are a strided view (torch accepts it): every product, the CSR on either side
    and as a CSC, the sampled product and F.linear, as torch's CPU kernels compute them."""
    g = torch.Generator().manual_seed(3)
    m, k = 7, 5
    crow, col = pattern(m, k, [2, 0, 3, 1, 5, 2, 1], g)
    wide = torch.randn(int(crow[-1]), 3, generator=g)
    a = torch.sparse_csr_tensor(crow, col, wide[:, 1], (m, k))
    assert not a.values().is_contiguous()
    csc = torch.sparse_csc_tensor(crow[:6], col[:int(crow[5])] % m, wide[:int(crow[5]), 2], (m, k))
    right, left, u, v = (torch.randn(s, generator=g) for s in ((k, 3), (4, m), (m, 2), (2, k)))
    calls = {"a @ right": lambda t: t @ right, "left @ a": lambda t: left @ t,
             "F.linear": lambda t: F.linear(u.t(), t.t()),
             "a^T @ left^T": lambda t: t.t() @ left.t(), "addmm": lambda t: torch.addmm(right[:, :1], t.t(), u),
             "sampled": lambda t: torch.sparse.sampled_addmm(t, u, v, beta=0.5, alpha=2.0).to_dense(),
             "mv": lambda t: t @ right[:, 0]}
    for name, call in calls.items():
        for what, t in (("csr", a), ("csc", csc)):
            if name == "sampled" and what == "csc":
                continue  # torch's CPU kernel takes a CSR mask only (refused here too)
            ref = call(t)
            with sparse_mps_ops.on_cpu_keys(metal):
                got = call(t)
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=f"{what} {name}")


def test_addmv_is_computed_as_torch_cpu_does(metal):
    """torch.addmv(input, A, x) with a CSR or CSC A: beta / alpha, an input broadcast from one element or a scalar,
    beta = 0 ignoring NaN in the input, and the gradients to every operand (their layouts too), against torch's CPU
    kernels."""
    g = torch.Generator().manual_seed(11)
    m, k = 6, 8
    crow, col = pattern(m, k, [3, 0, 2, 4, 1, 2], g)
    a = torch.sparse_csr_tensor(crow, col, torch.randn(int(crow[-1]), generator=g), (m, k))
    x = torch.randn(k, generator=g)
    nan_input = torch.full((m,), float("nan"))
    cases = [(torch.randn(m, generator=g), a, 0.5, -2.0), (torch.randn(1, generator=g), a, 1, 1),
             (torch.tensor(3.0), a, 2, 0.25), (nan_input, a, 0, 1.5),
             (torch.randn(m, generator=g), a.to_dense().to_sparse_csc(), 1, 3)]
    for inp, mat, beta, alpha in cases:
        ref = torch.addmv(inp, mat, x, beta=beta, alpha=alpha)
        with sparse_mps_ops.on_cpu_keys(metal):
            got = torch.addmv(inp, mat, x, beta=beta, alpha=alpha)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        assert not got.isnan().any()

    def grads():
        inp_, a_, x_ = (t.detach().clone().requires_grad_() for t in (torch.randn(m, generator=g), a, x))
        torch.addmv(inp_, a_, x_, beta=0.5, alpha=2.0).mul(torch.arange(m) - 2.0).sum().backward()
        return inp_.grad, a_.grad, x_.grad

    g.manual_seed(12)
    ref = grads()
    g.manual_seed(12)
    with sparse_mps_ops.on_cpu_keys(metal):
        got = grads()
    for r, o in zip(ref, got):
        assert r.layout == o.layout
        torch.testing.assert_close(o.to_dense(), r.to_dense(), rtol=1e-5, atol=1e-5)


def test_addmv_refuses_what_torch_cpu_refuses():
    metal = Counting()
    a = torch.eye(3)[:, :2].contiguous().to_sparse_csr()
    bad = [(torch.ones(4), a, torch.ones(2)), (torch.ones(3), a, torch.ones(3)), (torch.ones(3, 1), a, torch.ones(2)),
           (torch.ones(3), a, torch.ones(2, dtype=torch.float64))]
    for inp, mat, vec in bad:
        with pytest.raises(RuntimeError):
            torch.addmv(inp, mat, vec)  # torch's CPU kernel
        with sparse_mps_ops.on_cpu_keys(metal), pytest.raises(RuntimeError):  # torch's checks, or ours
            torch.addmv(inp, mat, vec)
    with sparse_mps_ops.on_cpu_keys(metal), \
            pytest.raises(RefusedError, match="aten::addmv.out.*torch.addmv without out="):
        torch.addmv(torch.ones(3), a, torch.ones(2), out=torch.empty(3))
    assert metal.calls == 0  # refused before any work


def test_batched_csr_errors_name_the_operation_called(metal):
    """A batched CSR where only 2-D products exist: the error names the torch call that reached the kernel and the
    batched operand (not the dense one), and says what to do; the backward of a batched sampled_addmm names it."""
    b = torch.zeros(2, 3, 3)
    b[:, 0, 1], b[:, 2, 0] = 1.0, 2.0
    batched = b.to_sparse_csr()
    cases = [(lambda: torch.sparse.mm(batched, torch.ones(2, 3, 1)), "torch.sparse.mm"),
             (lambda: torch.sparse.mm(batched, torch.ones(3, 1)), "torch.sparse.mm"),
             (lambda: torch.mm(batched, torch.ones(3, 1)), "torch.mm"),
             (lambda: torch.mm(torch.ones(1, 3), batched), "torch.mm"),
             (lambda: torch.addmm(torch.ones(3, 1), batched, torch.ones(3, 1)), "torch.addmm"),
             (lambda: torch.addmv(torch.ones(3), batched, torch.ones(3)), "torch.addmv")]
    for call, op in cases:
        with sparse_mps_ops.on_cpu_keys(metal), pytest.raises(RefusedError) as e:
            call()
        assert op in str(e.value) and "(2, 3, 3)" in str(e.value) and "loop over the batch" in str(e.value), e.value
    u = torch.randn(2, 3, 2, requires_grad=True)
    with sparse_mps_ops.on_cpu_keys(metal):
        out = torch.sparse.sampled_addmm(batched, u, torch.randn(2, 2, 3))
        with pytest.raises(RefusedError, match="backward of a batched torch.sparse.sampled_addmm.*loop over the batch"):
            out.values().sum().backward()


# ------------------------------------------------------------------------------------------------ the registration
REGISTRATIONS = ("import json, torch\n"
                 "keys = ['SparseCsrMPS', 'SparseMPS', 'MPS', 'CPU', 'CUDA', 'SparseCPU', 'SparseCsrCPU']\n"
                 "get = lambda: {k: sorted(op for op in torch._C._dispatch_get_registrations_for_dispatch_key(k)\n"
                 "                         if op.startswith('aten::')) for k in keys}\n"
                 "before = get()\n")


def test_the_switch_off_registers_nothing_and_register_adds_only_what_torch_lacks():
    """TORCH_SPARSE_METAL_SPARSE_MPS=0: importing the package adds no kernel to torch's ops (its own ops are its own)
    on any key. register() then adds exactly
    the kernels it lists, each for an (op, key) that had no kernel of torch's (and no CompositeImplicitAutograd
    decomposition), for the MPS keys only; unregister() leaves every key as before."""
    code = REGISTRATIONS + (
        "import os\n"
        "os.environ['TORCH_SPARSE_METAL_SPARSE_MPS'] = '0'\n"
        "from torch_sparse_metal import sparse_mps_ops\n"
        "after_import = get()\n"
        "implicit = {f'aten::{n}' for n, _ in sparse_mps_ops.entries()\n"
        "            if sparse_mps_ops._exists(n) and sparse_mps_ops._has_kernel(n, 'CompositeImplicitAutograd')}\n"
        "listed, again = sparse_mps_ops.registered(), sparse_mps_ops.register()\n"
        "registered = get()\n"
        "sparse_mps_ops.unregister()\n"
        "print(json.dumps({'before': before, 'after_import': after_import, 'listed_off': listed, 'on': again,\n"
        "                  'idempotent': sparse_mps_ops.register() == again, 'registered': registered,\n"
        "                  'after_unregister': (sparse_mps_ops.unregister(), get())[1], 'implicit': sorted(implicit),\n"
        "                  'listed_after': sparse_mps_ops.registered()}))\n")
    r = run_python_json(code)
    assert r["after_import"] == r["before"] and r["listed_off"] == [] and r["listed_after"] == []
    assert r["idempotent"] and len(r["on"]) == len(sparse_mps_ops.entries())
    added = {(op, key) for key in r["before"] for op in set(r["registered"][key]) - set(r["before"][key])}
    assert added == {tuple(e) for e in r["on"]}
    for op, key in added:
        assert key in ("SparseCsrMPS", "SparseMPS", "MPS") and op not in r["before"][key] and op not in r["implicit"]
    assert all(r["registered"][k] == r["before"][k] for k in ("CPU", "CUDA", "SparseCPU", "SparseCsrCPU"))
    assert r["after_unregister"] == r["before"]


def test_the_switch_rejects_a_value_it_cannot_read():
    code = ("import json, os\n"
            "os.environ['TORCH_SPARSE_METAL_SPARSE_MPS'] = 'sometimes'\n"
            "try:\n"
            "    import torch_sparse_metal\n"
            "    print(json.dumps('imported'))\n"
            "except ValueError as e:\n"
            "    print(json.dumps(str(e)))\n")
    assert "TORCH_SPARSE_METAL_SPARSE_MPS='sometimes' is not a boolean" in run_python_json(code)


def test_on_cpu_keys_runs_the_mps_path_with_the_switch_off():
    """The CPU-key harness stands in what the import would register, registered or not (the self-check's CI run)."""
    code = ("import json, os, torch\n"
            "os.environ['TORCH_SPARSE_METAL_SPARSE_MPS'] = 'off'\n"
            "from torch_sparse_metal import sparse_mps, sparse_mps_ops\n"
            "a = torch.tensor([[0.0, 2.0], [3.0, 0.0]]).to_sparse_csr()\n"
            "with sparse_mps_ops.on_cpu_keys(sparse_mps.OPS) as replaced:\n"
            "    y = torch.addmv(torch.zeros(2), a, torch.ones(2))\n"
            "print(json.dumps([sparse_mps_ops.registered(), ['aten::addmv', 'SparseCsrCPU'] in map(list, replaced),\n"
            "                  y.tolist()]))\n")
    assert run_python_json(code) == [[], True, [2.0, 3.0]]
