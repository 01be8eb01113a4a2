"""Run in a separate process by tests/test_sparse_mps.py: torch's own sparse API and derivative formulas on CPU
tensors, first with torch's CPU kernels (the reference), then with our product kernels (over the MSL-on-CPU executor)
registered for SparseCsrCPU in place of torch's: the path an MPS tensor takes through SparseCsrMPS. Exits 1 on a
mismatch, printing it; prints the number of kernel calls of ours."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import torch_sparse_metal  # noqa: F401
from torch_sparse_metal.backends.mps import MetalCsrLinear
from torch_sparse_metal.sparse_mps_ops import register_products
from tsm_dev.msl import compile_shader

warnings.filterwarnings("ignore")


class Counting:
    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def forward(self, *a):
        self.calls += 1
        return self.inner.forward(*a)

    def backward(self, *a):
        self.calls += 1
        return self.inner.backward(*a)


def cases():
    g = torch.Generator().manual_seed(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    m, k, p = 7, 9, 5
    dense_a = torch.randn(m, k, generator=g) * (torch.rand(m, k, generator=g) < 0.3)
    dense_a[2] = 0  # an empty row
    b, x = torch.randn(k, p, generator=g), torch.randn(p, m, generator=g)
    c, u, v = torch.randn(m, p, generator=g), torch.randn(m, 4, generator=g), torch.randn(4, k, generator=g)
    xin, vec = torch.randn(3, k, generator=g), torch.randn(k, generator=g)
    csr = dense_a.to_sparse_csr()
    csc = dense_a.t().contiguous().to_sparse_csc()  # [k, m]
    return {
        "torch.mm(csr, dense)": (lambda a, d: torch.mm(a, d), csr, b),
        "torch.sparse.mm(csr, dense)": (lambda a, d: torch.sparse.mm(a, d), csr, b),
        "csr @ dense": (lambda a, d: a @ d, csr, b),
        "torch.matmul(dense, csr)": (lambda a, d: torch.matmul(d, a), csr, x),
        "csc @ dense": (lambda a, d: a @ d, csc, c),
        "dense @ csr.t()": (lambda a, d: d @ a.t(), csr, xin),
        "torch.addmm(dense, csr, dense)": (lambda a, d: torch.addmm(c, a, d, beta=0.5, alpha=2.0), csr, b),
        "torch.sparse.addmm(dense, csr, dense)": (lambda a, d: torch.sparse.addmm(c, a, d, beta=0.5, alpha=2.0),
                                                  csr, b),
        "F.linear(x, W_csr)": (lambda a, d: F.linear(d, a), csr, xin),
        "csr @ vector": (lambda a, d: a @ d, csr, vec),
        "torch.sparse.sampled_addmm": (lambda a, d: torch.sparse.sampled_addmm(a, d, v, beta=0.3, alpha=1.5), csr, u),
    }


def run(fn, a, d):
    a = a.detach().clone().requires_grad_()
    d = d.detach().clone().requires_grad_()
    out = fn(a, d)
    dense_out = out.to_dense() if out.layout != torch.strided else out
    weights = torch.linspace(-1, 1, dense_out.numel()).reshape(dense_out.shape)
    loss = (out.values() * torch.linspace(-1, 1, out._nnz())).sum() if out.layout != torch.strided \
        else (dense_out * weights).sum()
    loss.backward()
    ga = a.grad.to_dense() if a.grad is not None and a.grad.layout != torch.strided else a.grad
    return dense_out.detach(), ga, d.grad, (a.grad.layout if a.grad is not None else None)


def main() -> int:
    refs = {name: run(*case) for name, case in cases().items()}
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import sparse_mps_train

    example_refs = (sparse_mps_train.train_gcn("cpu", 3, nodes=120),
                    sparse_mps_train.train_bag_of_words("cpu", 3, docs=32, vocab=500))
    kernels = Counting(MetalCsrLinear(compile_shader, device_type="cpu", poison=True))
    lib = register_products("SparseCsrCPU", kernels, only_missing=False)  # noqa: F841 (kept alive)
    bad = 0
    for name, case in cases().items():
        before = kernels.calls
        got = run(*case)
        if kernels.calls == before:
            print(f"FAIL {name}: our kernels did not run")
            bad += 1
        for what, r, o in zip(("out", "grad sparse", "grad dense"), refs[name][:3], got[:3]):
            if (r is None) != (o is None) or (r is not None and not torch.allclose(r, o, rtol=1e-4, atol=1e-5)):
                print(f"FAIL {name} {what}: {r} vs {o}")
                bad += 1
        if refs[name][3] != got[3]:
            print(f"FAIL {name}: grad layout {got[3]}, torch gives {refs[name][3]}")
            bad += 1
    # the example's models, trained through our kernels: the same losses as with torch's (same seed)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import sparse_mps_train

    before = kernels.calls
    ours = (sparse_mps_train.train_gcn("cpu", 3, nodes=120), sparse_mps_train.train_bag_of_words("cpu", 3, docs=32,
                                                                                                 vocab=500))
    if kernels.calls == before or abs(ours[0] - example_refs[0]) > 0.02 or abs(ours[1] - example_refs[1]) > 0.02:
        print(f"FAIL example: {ours} vs torch's {example_refs}, {kernels.calls - before} calls")
        bad += 1
    print(f"calls {kernels.calls}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
