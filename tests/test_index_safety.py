"""Malformed index tensors given straight to the CPU ops raise a clear error before any kernel runs, instead of
reading or writing outside their tensors. Each case corrupts one index array of a valid topology."""

from __future__ import annotations

import pytest
import torch

import torch_sparse_metal  # noqa: F401  (loads the ops)
from torch_sparse_metal import CSRTopology

OPS = torch.ops.torch_sparse_metal


def _args():
    topo = CSRTopology.random(9, 6, 0.4, generator=torch.Generator().manual_seed(0))
    names = ("row_ptr", "dst", "src", "col_ptr", "src_by_dst", "perm")
    return {"x": torch.randn(4, 9), "w": torch.randn(topo.nnz), "go": torch.randn(4, 6),
            **{n: t.clone() for n, t in zip(names, topo.kernel_args())}}


def _set(name: str, index: int, value: int):
    def corrupt(a):
        a[name][index] = value
    return corrupt


FORWARD = [
    ("col_ptr does not start at 0", _set("col_ptr", 0, 1), "col_ptr is not a CSR pointer array"),
    ("col_ptr decreases", _set("col_ptr", 2, -1), "col_ptr is not a CSR pointer array"),
    ("col_ptr ends past nnz", _set("col_ptr", -1, 10_000), "col_ptr is not a CSR pointer array"),
    ("src_by_dst past in_features", _set("src_by_dst", 3, 9), r"src_by_dst\[3\] = 9 is outside \[0, in_features"),
    ("src_by_dst negative", _set("src_by_dst", 0, -1), r"src_by_dst\[0\] = -1 is outside"),
    ("perm past nnz", _set("perm", 1, 1 << 20), r"perm\[1\] = 1048576 is outside \[0, nnz"),
]
BACKWARD = [
    ("row_ptr ends past nnz", _set("row_ptr", -1, 10_000), "row_ptr is not a CSR pointer array"),
    ("row_ptr decreases", _set("row_ptr", 3, -5), "row_ptr is not a CSR pointer array"),
    ("dst past out_features", _set("dst", 2, 6), r"dst\[2\] = 6 is outside \[0, out_features = 6\)"),
    ("dst negative", _set("dst", 0, -3), r"dst\[0\] = -3 is outside"),
    ("grad_out narrower than dst", lambda a: a.__setitem__("go", a["go"][:, :3].contiguous()),
     "3 columns but the topology has out_features=6"),
]


@pytest.mark.parametrize(("name", "corrupt", "message"), FORWARD, ids=[c[0] for c in FORWARD])
def test_forward_refuses_bad_indices(name, corrupt, message):
    a = _args()
    corrupt(a)
    with pytest.raises(RuntimeError, match=message):
        OPS.csr_linear(a["x"], a["w"], a["row_ptr"], a["dst"], a["src"], a["col_ptr"], a["src_by_dst"], a["perm"],
                       "auto")


@pytest.mark.parametrize("strategy", ["fused_atomic", "atomic_free"])
@pytest.mark.parametrize(("name", "corrupt", "message"), BACKWARD, ids=[c[0] for c in BACKWARD])
def test_backward_refuses_bad_indices(name, corrupt, message, strategy):
    a = _args()
    corrupt(a)
    with pytest.raises(RuntimeError, match=message):
        OPS.csr_linear_backward(a["go"], a["x"], a["w"], a["row_ptr"], a["dst"], a["src"], a["col_ptr"],
                                a["src_by_dst"], a["perm"], strategy)


def test_valid_topology_still_passes():
    a = _args()
    y = OPS.csr_linear(a["x"], a["w"], a["row_ptr"], a["dst"], a["src"], a["col_ptr"], a["src_by_dst"], a["perm"],
                       "auto")
    gx, gw = OPS.csr_linear_backward(a["go"], a["x"], a["w"], a["row_ptr"], a["dst"], a["src"], a["col_ptr"],
                                a["src_by_dst"], a["perm"], "fused_atomic")
    assert y.shape == (4, 6) and gx.shape == (4, 9) and gw.shape == a["w"].shape
