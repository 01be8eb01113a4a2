"""Attacks on the raw ops (``torch.ops.torch_sparse_metal.*``, the ``ops`` wrappers, ``sparse_linear`` given a
hand-built topology): one malformed argument each, on the CPU.

These are the calls that could read or write outside their tensors if a guard regressed, so the tests run them
through :mod:`.isolated` (a crash fails one case). ``CASES`` maps a case name to ``(expected, pattern)``:
``expected`` is ``"raise"`` (an exception whose message matches ``pattern``) or ``"exact"`` (the call returns the
float64 reference of the uncorrupted topology: the corruption is one the op must tolerate, e.g. strides).
:func:`run` is the child's entry: it performs the case and returns the largest error against that reference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from torch_sparse_metal import ops
from torch_sparse_metal.contract import INT32_MAX, TOPOLOGY_ARGS
from torch_sparse_metal.functional import sparse_linear
from torch_sparse_metal.topology import CSRTopology
from torch_sparse_metal_tools.testing.reference import reference_backward, reference_forward

__all__ = ["CASES", "run"]

INT32_MIN = -INT32_MAX - 1
N_IN, N_OUT, BATCH = 9, 6, 4
# Entry points: the raw forward op, its wrapper, sparse_linear (forward and backward through autograd), and the
# raw backward op with each strategy.
FORWARD_CALLS = ("op", "wrapper", "sparse_linear")
BACKWARD_CALLS = ("op_backward:fused_atomic", "op_backward:atomic_free")
# The arrays each direction's CPU kernels read, and what the values index.
READ_BY = {"forward": {"col_ptr": "nnz", "src_by_dst": "in", "perm": "nnz"},
           "backward": {"row_ptr": "nnz", "dst": "out"}}


def _problem() -> tuple[CSRTopology, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    topo = CSRTopology.random(N_IN, N_OUT, 0.4, generator=g)
    return topo, {"x": torch.randn(BATCH, N_IN, generator=g), "w": torch.randn(topo.nnz, generator=g),
                  "go": torch.randn(BATCH, N_OUT, generator=g)}


def _values(array: str, limit: str, nnz: int) -> dict[str, Callable[[torch.Tensor], None]]:
    """Value corruptions of one index array (in place), by name."""
    if limit == "nnz" and array.endswith("ptr"):  # a CSR pointer array
        mid = lambda v: lambda t: t.__setitem__(len(t) // 2, v)  # noqa: E731
        return {"starts at 1": lambda t: t.__setitem__(0, 1), "negative entry": mid(-1),
                "INT32_MAX entry": mid(INT32_MAX), "INT32_MIN entry": mid(INT32_MIN),
                "ends past nnz": lambda t: t.__setitem__(-1, nnz + 1),
                "ends before nnz": lambda t: t.__setitem__(-1, 0),
                "decreases": lambda t: t.__setitem__(slice(1, -1), t[1:-1].flip(0)) if t[1:-1].unique().numel() > 1
                else t.__setitem__(1, nnz), "all INT32_MAX": lambda t: t.fill_(INT32_MAX)}
    bound = {"nnz": nnz, "in": N_IN, "out": N_OUT}[limit]
    at = lambda v: lambda t: t.__setitem__(len(t) // 2, v)  # noqa: E731
    return {"-1": at(-1), "= limit": at(bound), "limit + 1000": at(bound + 1000), "INT32_MIN": at(INT32_MIN),
            "INT32_MAX": at(INT32_MAX), "all -1": lambda t: t.fill_(-1)}


# Metadata corruptions of any index array: (new tensor from the valid one, pattern naming the problem).
META = {
    "int64": (lambda t: t.long(), "{a} must be int32"),
    "float32": (lambda t: t.float(), "{a} must be int32"),
    "truncated": (lambda t: t[:-1].clone(), "{a}"),
    "extended": (lambda t: torch.cat([t, t[-1:] + 1]), "{a}"),
    "2-D": (lambda t: t[None].clone(), "{a}"),
    "strided view": (lambda t: torch.stack([t, t], 1)[:, 0], "{a} must be contiguous"),
    "meta device": (lambda t: t.to("meta"), "{a} is on meta but x is on cpu"),
}


def _cases() -> dict[str, tuple[str, str]]:
    cases: dict[str, tuple[str, str]] = {}
    nnz = _problem()[0].nnz
    for direction, calls in (("forward", FORWARD_CALLS), ("backward", BACKWARD_CALLS)):
        for array, limit in READ_BY[direction].items():
            for what in _values(array, limit, nnz):
                pattern = (f"{array} is not a CSR pointer array" if array.endswith("ptr")
                           else rf"{array}\[\d+\] = -?\d+ is outside \[0, ")
                for call in calls:
                    cases[f"{call}|{array}|{what}"] = ("raise", pattern)
    for array in TOPOLOGY_ARGS:
        for what, (_, pattern) in META.items():
            for call in ("op", "op_backward:fused_atomic"):
                # col_ptr's length is out_features: the backward names the mismatch with grad_out's width
                named = "col_ptr|out_features=" if array == "col_ptr" and what in ("truncated", "extended") else array
                cases[f"{call}|{array}|{what}"] = ("raise", pattern.format(a=named))
    for call in ("op_backward:fused_atomic", "op_backward:atomic_free"):
        cases[f"{call}|grad_out|narrow"] = ("raise", "grad_out has 3 columns but the topology has out_features=6")
        cases[f"{call}|grad_out|wide"] = ("raise", "grad_out has 9 columns but the topology has out_features=6")
        cases[f"{call}|grad_out|batch"] = ("raise", "grad_out must be \\[batch, out_features\\] with batch=4")
        cases[f"{call}|grad_out|float64"] = ("raise", "grad_out has dtype Double but x has dtype Float")
        cases[f"{call}|strategy|auto"] = ("raise", "strategy|auto")
        cases[f"{call}|weight|strided"] = ("exact", "")
        cases[f"{call}|weight|expanded"] = ("exact", "")
        cases[f"{call}|x|transposed"] = ("exact", "")
    for call in ("op", "op_backward:fused_atomic"):
        for what in ("short", "long"):  # a topology whose arrays agree: the weight is named, with both sizes
            cases[f"{call}|weight|{what}"] = ("raise", r"weight has shape \[\d+\], \d+ values, but the topology has "
                                                        r"\d+ edges")
        cases[f"{call}|weight|2-D"] = ("raise", "weight must be .* in a layout of csr_linear")
        cases[f"{call}|weight|float64"] = ("raise", "weight has dtype Double but x has dtype Float")
        cases[f"{call}|x|int32"] = ("raise", "x must be one of")
        cases[f"{call}|x|3-D"] = ("raise", "x must be 2-D")
    cases["op|weight|strided"] = ("exact", "")
    cases["op|weight|expanded"] = ("exact", "")
    cases["op|weight|expanded, autograd"] = ("exact", "")
    return cases


CASES = _cases()


def _corrupted(topo: CSRTopology, t: dict, array: str, what: str) -> tuple[dict, dict]:
    args = {n: a.clone() for n, a in zip(TOPOLOGY_ARGS, topo.kernel_args())}
    if array in args and what in META:
        args[array] = META[what][0](args[array])
    elif array in args:
        limit = READ_BY["forward"].get(array) or READ_BY["backward"][array]
        _values(array, limit, topo.nnz)[what](args[array])
    else:
        t = dict(t)
        k = topo.nnz
        t.update({
            ("grad_out", "narrow"): {"go": t["go"][:, :3].contiguous()},
            ("grad_out", "wide"): {"go": torch.randn(BATCH, 9)},
            ("grad_out", "batch"): {"go": t["go"][:2].contiguous()},
            ("grad_out", "float64"): {"go": t["go"].double()},
            ("weight", "strided"): {"w": torch.stack([t["w"], -t["w"]], 1)[:, 0]},
            ("weight", "expanded"): {"w": t["w"][:1].expand(k)},
            ("weight", "expanded, autograd"): {"w": t["w"][:1].expand(k)},
            ("weight", "short"): {"w": t["w"][:-1].contiguous()},
            ("weight", "long"): {"w": torch.cat([t["w"], t["w"][:1]])},
            ("weight", "2-D"): {"w": t["w"][None].clone()},
            ("weight", "float64"): {"w": t["w"].double()},
            ("x", "transposed"): {"x": t["x"].t().contiguous().t()},
            ("x", "int32"): {"x": t["x"].int()},
            ("x", "3-D"): {"x": t["x"][None].clone()},
        }.get((array, what), {}))
    return args, t


def run(name: str) -> float:
    """Perform case ``name``; returns the largest error against the uncorrupted topology's float64 reference."""
    call, array, what = name.split("|")
    topo, t = _problem()
    args, t = _corrupted(topo, t, array, what)
    index = [args[n] for n in TOPOLOGY_ARGS]
    strategy = "auto" if what == "auto" else call.partition(":")[2]
    if call.startswith("op_backward"):
        gx, gw = torch.ops.torch_sparse_metal.csr_linear_backward(t["go"], t["x"], t["w"], *index, strategy)
        rx, rw = reference_backward(t["go"], t["x"], t["w"], topo)
        return max(float((gx.double() - rx).abs().max()), float((gw.double() - rw).abs().max()))
    hand_built = dataclasses.replace(topo, **{n: args[n] for n in TOPOLOGY_ARGS})
    w = t["w"]
    if what == "expanded, autograd":  # the registered autograd rule hands the op's own weight to the backward
        x = t["x"].clone().requires_grad_()
        y = torch.ops.torch_sparse_metal.csr_linear(x, w, *index, "auto")
        (gx,) = torch.autograd.grad(y, x, t["go"])
        return float((gx.double() - reference_backward(t["go"], t["x"], w, topo)[0]).abs().max())
    if call == "op":
        y = torch.ops.torch_sparse_metal.csr_linear(t["x"], w, *index, "auto")
    elif call == "wrapper":
        y = ops.csr_linear(t["x"], w, hand_built)
    else:
        w = t["w"].clone().requires_grad_()
        y = sparse_linear(t["x"], w, hand_built)
        y.backward(t["go"])
    return float((y.double() - reference_forward(t["x"], t["w"], topo)).abs().max())
