"""Self-check of the Metal backend: ``python -m torch_sparse_metal_tools.selfcheck [--json report.json]``.

On a Mac with MPS it runs every op and backward strategy on MPS, those of the vector layout (``SparseLinear(block=V)``,
``shaders/vector_csr_linear.metal``, on SIMD-group matrices) included, and compares each result with a float64 dense
reference and with the CPU backend: outputs are NaN-poisoned before the kernels run (an element no kernel
writes shows), inputs are views at a storage offset (as a model's activations often are), and the deterministic
paths must repeat bit for bit. It says which path computed the results of each op family and dtype: the Metal
kernels, or the reference path where they cannot run here (``backends/mps_reference.py``), and each check that the
kernels ran fails where the reference path did. Then it names the GPU and the pipelines (SIMD width, thread limit,
threadgroup memory of each kernel), prints the configuration ``auto`` runs at each size of the timing table (the
forward's variant P, the backward's strategy and P: tuned on this Mac at first use, or cached from earlier use;
:mod:`torch_sparse_metal.tuning`), and a timing table at the sizes of the published M1 Pro figures (22K-61K
edges in a 1024 x 1024 layer; docs/metal.md), with the benchmark's timer (:mod:`torch_sparse_metal.timing`:
synchronised wall clock, the methods of a layer interleaved): ours (the host's time inside the call beside it),
dense ``nn.Linear`` math on MPS, and ``torch.sparse`` on MPS where the installed torch supports it (probed; it
says plainly where it does not).
``--json`` writes all of it to a file to attach to an issue.

Without MPS there is no Metal to check, and it says so (exit status 2). From a checkout of the repository,
``python -m tsm_dev.selfcheck`` (same options) hands in the MSL-on-CPU executor (:class:`Executor`), a development
tool that is not installed: the same checks then run on the CPU through the same host code, with no timings
(executor timings say nothing about Metal) and the static rule's configurations in place of tuned ones. Exit
status: 0 when every check passed, 1 when one failed, 2 when nothing could be checked.

``--model`` prints instead the executor's memory-traffic model of every kernel and variant P, in float32 and
float16, at the same sizes (docs/metal.md, "Traffic model"): computed on the CPU, the same on any machine; it too
needs the executor (``python -m tsm_dev.selfcheck --model``).

Example::

    $ python -m torch_sparse_metal_tools.selfcheck --json report.json   # checks, pipelines, tuning, timing table, JSON
    $ python -m torch_sparse_metal_tools.selfcheck --no-bench           # all but the timing table
    $ python -m tsm_dev.selfcheck --model --json m.json           # the traffic model's tables, from a checkout
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import platform
import subprocess
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torch_sparse_metal import devices, tuning
from torch_sparse_metal.backends.metal import CALLS_BY_PATH, KERNEL_DTYPES, MetalUnavailable
from torch_sparse_metal.contract import STRATEGY_SPECS, VECTOR_BLOCKS
from torch_sparse_metal.strategy import CONCRETE as STRATEGIES
from torch_sparse_metal.strategy import STATIC, tuned_strategies
from torch_sparse_metal.timing import Timer, Timing
from torch_sparse_metal_tools.argtypes import number, positive_int
from torch_sparse_metal_tools.bench import torch_sparse_ops
from torch_sparse_metal_tools.cli import check_output_file, wait_passively
from torch_sparse_metal_tools.progress import heartbeat
from torch_sparse_metal_tools.testing.reference import reference_outputs, reference_vector_outputs

#: (in_features, out_features, density, batch) checked on every backend: a char-level-sized layer, odd sizes that
#: are no multiple of the threadgroup, batch 1 and 0, no edges, all edges, and both batch tilings (<= 32, > 32).
CHECK_CASES = [
    (1024, 1024, 0.03, 128),
    (300, 257, 0.05, 33),
    (37, 45, 0.3, 1),
    (64, 33, 0.0, 3),
    (50, 70, 1.0, 0),
    (129, 97, 0.2, 32),
]
#: Edge counts and M1 Pro fused / atomic-free backward ms, as published (docs/metal.md).
PUBLISHED_M1_PRO = [(22_000, 10.8, 81.0), (30_000, 12.6, 100.0), (39_000, 12.8, 117.3), (42_000, 12.0, 124.6),
           (61_000, 17.3, 159.5)]
#: (in_features, groups, density, batch) of the vector layout, checked for every block V: a group's fan-in that is no
#: multiple of the 8-vector staging, batch 1 and 0, no vectors, and batch tails of the 8-row tiles.
VECTOR_CHECK_CASES = [
    (300, 9, 0.1, 37),
    (37, 3, 0.5, 1),
    (64, 4, 0.0, 5),
    (50, 2, 1.0, 0),
]
#: Layer of the timing table: a char-level model's hidden layer, in = out = 1024, batch 128 sequences.
BENCH_FEATURES = 1024
BENCH_BATCH = 128
#: Elements in front of every input view, so that kernels see a nonzero storage offset.
INPUT_OFFSET = 3


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def hardware() -> dict[str, Any]:
    """The machine: chip (Apple silicon: the GPU's name too), GPU core count where macOS reports it, OS, torch."""
    info: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(),
                            "chip": devices.cpu_model()}
    if sys.platform == "darwin":
        info["os"] = f"macOS {platform.mac_ver()[0]}"
        try:
            displays = json.loads(_run(["system_profiler", "-json", "SPDisplaysDataType"]) or "{}")
            gpu = (displays.get("SPDisplaysDataType") or [{}])[0]
            info["gpu"] = gpu.get("sppci_model")
            info["gpu_cores"] = gpu.get("sppci_cores")
        except (ValueError, AttributeError, IndexError):
            pass
    else:
        info["os"] = f"{platform.system()} {platform.release()}"
    return info


def hardware_name(info: dict[str, Any] | None = None) -> str:
    """E.g. ``"Apple M1 Pro (16 GPU cores), macOS 14.5"``."""
    info = info or hardware()
    cores = f" ({info['gpu_cores']} GPU cores)" if info.get("gpu_cores") else ""
    return f"{info['chip']}{cores}, {info['os']}"


@dataclass
class Report:
    """PASS/FAIL lines, kept for the JSON report."""

    checks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failures(self) -> int:
        return sum(not c["ok"] for c in self.checks)

    def _add(self, name: str, ok: bool, detail: str, **extra: Any) -> None:
        self.checks.append({"check": name, "ok": ok, **extra})
        print(f"  {'PASS' if ok else 'FAIL'}  {name:<66} {detail}")

    def close(self, name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        """``got`` matches ``ref`` (any dtype) within float32 rounding of a sum, and holds no NaN (poison)."""
        got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
        if got.shape != ref.shape:
            self._add(name, False, f"shape {tuple(got.shape)} != {tuple(ref.shape)}", max_err=None)
            return
        err = (got - ref).abs().max().item() if got.numel() else 0.0
        scale = max(1.0, ref.abs().max().item()) if ref.numel() else 1.0
        ok = bool(torch.isfinite(got).all()) and err <= 1e-4 * scale
        self._add(name, ok, f"max|err| {err:.2e}", max_err=err)

    def identical(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Bitwise equal (NaN-poisoned outputs compare unequal, so an unwritten element fails here too)."""
        ok = torch.equal(a.cpu(), b.cpu())
        self._add(name, ok, "bitwise equal" if ok else "differs between two runs")

    def error(self, name: str, exc: BaseException) -> None:
        self._add(name, False, f"{type(exc).__name__}: {exc}", max_err=None)

    def ran_kernels(self, name: str, calls: Counter, reached: int | None = None) -> None:
        """The claim that the kernels computed a block's results: it holds only where calls reached them
        (``reached``, counted by the caller; by default the Metal hosts' calls) and none of the Metal hosts' calls
        ran the reference path instead (``calls``: :func:`calls_by_path` over the block, kept in the report)."""
        reached = sum(calls.values()) if reached is None else reached
        ok = reached > 0 and not any(path == "reference" for _, _, path in calls)
        self._add(name, ok, f"{reached} call(s); {_describe_ran(calls)}", ran=ran_rows(calls))


def at_offset(t: torch.Tensor, device: str) -> torch.Tensor:
    """A contiguous view of ``t`` on ``device`` that starts INPUT_OFFSET elements into its storage."""
    buf = torch.full((t.numel() + INPUT_OFFSET,), float("nan"), dtype=t.dtype, device=device)
    view = buf[INPUT_OFFSET:].view(t.shape)
    view.copy_(t)
    return view


def _check_case(device: str, metal: Any, report: Report, tag: str, x: torch.Tensor, w: torch.Tensor,
                go: torch.Tensor, topo: Any, reference: tuple[torch.Tensor, ...]) -> None:
    """One layer through ``metal``, either layout (``w`` ``[nnz]``, or ``[vectors, V]`` over a topology over vectors;
    ``tag`` starts with the layout), against the float64 ``reference`` ``(y, grad_x, grad_w)`` and the CPU backend;
    repeatability, bitwise where the strategy is deterministic."""
    ops = torch.ops.torch_sparse_metal
    prefix, _, tag = tag.rpartition("|")
    dev = topo.to(device)
    xd, wd, god = at_offset(x, device), at_offset(w, device), at_offset(go, device)
    y64, gx64, gw64 = reference
    y = metal.forward(xd, wd, *dev.kernel_args())
    report.close(f"{prefix}forward vs float64 {tag}", y, y64)
    report.close(f"{prefix}forward vs CPU     {tag}", y, ops.csr_linear(x, w, *topo.kernel_args(), "auto"))
    report.identical(f"{prefix}forward repeats    {tag}", y, metal.forward(xd, wd, *dev.kernel_args()))
    for s in STRATEGIES:
        gx, gw = metal.backward(god, xd, wd, *dev.kernel_args(), s)
        cpu_gx, cpu_gw = ops.csr_linear_backward(go, x, w, *topo.kernel_args(), s)
        report.close(f"{prefix}{s:<12} grad_x vs float64 {tag}", gx, gx64)
        report.close(f"{prefix}{s:<12} grad_w vs float64 {tag}", gw, gw64)
        report.close(f"{prefix}{s:<12} grad_x vs CPU {tag}", gx, cpu_gx)
        report.close(f"{prefix}{s:<12} grad_w vs CPU {tag}", gw, cpu_gw)
        again = metal.backward(god, xd, wd, *dev.kernel_args(), s)
        report.identical(f"{prefix}{s:<12} grad_x repeats {tag}", gx, again[0])
        if STRATEGY_SPECS[s].deterministic:  # the others sum grad_w with atomics in no fixed order
            report.identical(f"{prefix}{s:<12} grad_w repeats {tag}", gw, again[1])


def run_checks(device: str, metal: Any, report: Report, cases: list[tuple[int, int, float, int]] = CHECK_CASES
               ) -> None:
    """Every op and strategy through ``metal`` (a poisoning MetalCsrLinear on ``device``) against a float64 dense
    reference and the CPU backend; repeatability of the deterministic paths (:func:`_check_case`)."""
    from torch_sparse_metal import CSRTopology, sparse_linear

    for n_in, n_out, density, batch in cases:
        g = torch.Generator().manual_seed(n_in * 31 + batch)
        topo = CSRTopology.random(n_in, n_out, density, generator=g)
        x, go = torch.randn(batch, n_in, generator=g), torch.randn(batch, n_out, generator=g)
        w = torch.randn(topo.nnz, generator=g)
        tag = f"in={n_in} out={n_out} d={density} N={batch} E={topo.nnz}"
        reference = reference_outputs(go, x, w, topo)
        try:
            before = calls_by_path()
            _check_case(device, metal, report, f"|{tag}", x, w, go, topo, reference)
            if device == "mps":  # the registered MPS kernels, through the op and its autograd rule
                xd, wd, god, dev = at_offset(x, device), at_offset(w, device), at_offset(go, device), topo.to(device)
                for s in STRATEGIES:
                    xr, wr = xd.clone().requires_grad_(), wd.clone().requires_grad_()
                    out = sparse_linear(xr, wr, dev, backward=s)
                    out.backward(god)
                    report.close(f"sparse_linear+autograd {s:<12} y      {tag}", out, reference[0])
                    report.close(f"sparse_linear+autograd {s:<12} grad_x {tag}", xr.grad, reference[1])
                    report.close(f"sparse_linear+autograd {s:<12} grad_w {tag}", wr.grad, reference[2])
            report.ran_kernels(f"ran the Metal kernels {tag}", calls_by_path(before))
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the run goes on
            report.error(tag, exc)


def run_vector_checks(device: str, metal: Any, report: Report,
                      cases: list[tuple[int, int, float, int]] = VECTOR_CHECK_CASES) -> None:
    """The vector layout's ops and strategies through ``metal`` (a poisoning MetalCsrLinear, or its
    MetalVectorCsrLinear, on ``device``), every block V, against float64 and the CPU backend; repeatability of the
    deterministic paths."""
    from torch_sparse_metal import CSRTopology

    for block in VECTOR_BLOCKS:
        for n_in, groups, density, batch in cases:
            g = torch.Generator().manual_seed(n_in * 31 + groups * 7 + block)
            topo = CSRTopology.random(n_in, groups, density, generator=g)  # the topology over vectors
            x, go = torch.randn(batch, n_in, generator=g), torch.randn(batch, groups * block, generator=g)
            w = torch.randn(topo.nnz, block, generator=g)
            tag = f"V={block} in={n_in} groups={groups} d={density} N={batch} vectors={topo.nnz}"
            try:
                before = calls_by_path()
                _check_case(device, metal, report, f"vector |{tag}", x, w, go, topo,
                            reference_vector_outputs(go, x, w, topo))
                report.ran_kernels(f"vector ran the Metal kernels {tag}", calls_by_path(before))
            except Exception as exc:  # noqa: BLE001 - every failure is reported, the run goes on
                report.error(tag, exc)


# ------------------------------------------------------------------------------------------ torch.sparse on MPS
#: Value dtypes of the torch.sparse checks (those of the Metal kernels).
SPARSE_API_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: How far a torch.sparse result may be from torch's CPU result in float64 (computed from the same rounded inputs),
#: relative to the largest magnitude of that result (at least 1): a few roundings in the dtype.
SPARSE_API_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def sparse_api_cases(seed: int = 0) -> dict[str, tuple[Callable[..., Any], torch.Tensor, torch.Tensor | None,
                                                       tuple[torch.Tensor, ...]]]:
    """The torch.sparse calls the self-check runs: name -> ``(fn(a, d, *more), a, d, more)``, ``a`` a compressed
    float64 CPU tensor (CSR or CSC, an empty row, random nonzeros), ``d`` a dense float64 operand or None, ``more``
    dense constants; ``fn`` is torch's API, and ``a`` and ``d`` get gradients where the name has no ``(forward)``.

    Example:
        >>> fn, a, d, more = sparse_api_cases()["torch.mm(csr, D)"]
        >>> a.layout, tuple(fn(a, d, *more).shape)
        (torch.sparse_csr, (7, 5))
    """
    import torch.nn.functional as F  # noqa: N812

    g = torch.Generator().manual_seed(seed)
    m, k, p = 7, 9, 5

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    dense = rand(m, k) * (torch.rand(m, k, generator=g) < 0.35)
    dense[2] = 0  # an empty row
    csr, csc = dense.to_sparse_csr(), dense.t().contiguous().to_sparse_csc()  # csc: [k, m]
    batch = rand(2, m, k) * (dense != 0)  # a batch of two matrices with one pattern (equal nnz, as torch needs)
    return {
        "torch.mm(csr, D)": (torch.mm, csr, rand(k, p), ()),
        "D @ csr": (lambda a, d: d @ a, csr, rand(p, m), ()),
        "csc @ D": (lambda a, d: a @ d, csc, rand(m, p), ()),
        "D @ csc": (lambda a, d: d @ a, csc, rand(p, k), ()),
        "torch.sparse.mm(csr, D)": (torch.sparse.mm, csr, rand(k, p), ()),
        "torch.addmm(C, csr, D)": (lambda a, d, c: torch.addmm(c, a, d, beta=0.5, alpha=2.0), csr, rand(k, p),
                                   (rand(m, p),)),
        "torch.addmm(C, D, csr)": (lambda a, d, c: torch.addmm(c, d, a, beta=0.5, alpha=2.0), csr, rand(p, m),
                                   (rand(k),)),
        "F.linear(x, W_csr)": (lambda a, d: F.linear(d, a), csr, rand(3, k), ()),
        "F.linear(csr, W)": (lambda a, d: F.linear(a, d), csr, rand(p, k), ()),
        "csr @ v": (lambda a, d: a @ d, csr, rand(k), ()),
        "torch.sparse.sampled_addmm(csr, U, V)": (
            lambda a, d, v: torch.sparse.sampled_addmm(a, d, v, beta=0.3, alpha=1.5), csr, rand(m, 4), (rand(4, k),)),
        "torch.sparse.sampled_addmm batched (forward)": (
            lambda a, d, v: torch.sparse.sampled_addmm(a, d, v, beta=0.5), batch.to_sparse_csr(), rand(2, m, 4),
            (rand(2, 4, k),)),
        "dense.to_sparse_csr() (forward)": (lambda a, d: d.to_sparse_csr(), csr, dense, ()),
        "dense.to_sparse_csc() (forward)": (lambda a, d: d.to_sparse_csc(), csr, dense, ()),
        "batched dense.to_sparse_csr() (forward)": (lambda a, d: d.to_sparse_csr(), csr, batch, ()),
        "csr.to_sparse_csc() (forward)": (lambda a, d: a.to_sparse_csc(), csr, None, ()),
        "csc.to_sparse_csr() (forward)": (lambda a, d: a.to_sparse_csr(), csc, None, ()),
        "coo.to_sparse_csr() (forward)": (lambda a, d: d.to_sparse().to_sparse_csr(), csr, dense, ()),
        "coo.to_sparse_csc() (forward)": (lambda a, d: d.to_sparse().to_sparse_csc(), csr, dense, ()),
    }


def _on(t: torch.Tensor | None, device: str, dtype: torch.dtype, grad: bool) -> torch.Tensor | None:
    """A fresh copy of ``t`` (dense or compressed) on ``device`` in ``dtype``, a leaf that requires grad if ``grad``
    (compressed tensors are built from their arrays: no conversion runs)."""
    if t is None:
        return None
    if t.layout == torch.strided:
        out = t.to(device=device, dtype=dtype, copy=True)
    else:
        csr = t.layout == torch.sparse_csr
        ptr, idx = (t.crow_indices(), t.col_indices()) if csr else (t.ccol_indices(), t.row_indices())
        out = torch.sparse_compressed_tensor(ptr.to(device, copy=True), idx.to(device, copy=True),
                                             t.values().to(device=device, dtype=dtype, copy=True), size=t.shape,
                                             layout=t.layout)
    return out.requires_grad_(grad)


def _sparse_api_run(fn: Callable[..., Any], a: torch.Tensor, d: torch.Tensor | None, more: tuple[torch.Tensor, ...],
                    device: str, dtype: torch.dtype, grad: bool, rounding: torch.dtype | None = None) -> dict[str, Any]:
    """``fn(a, d, *more)`` on ``device`` in ``dtype`` and, with ``grad``, the gradients of a weighted sum of its
    result (weights rounded to ``rounding``, default ``dtype``) to ``a`` and ``d``: each result on the CPU
    (compressed ones with their index arrays)."""
    a_dev, d_dev = _on(a, device, dtype, grad), _on(d, device, dtype, grad and d is not None)
    out = fn(a_dev, d_dev, *(_on(t, device, dtype, False) for t in more))
    res = {"out": _to_cpu(out)}
    if grad:
        flat = out.values() if out.layout != torch.strided else out.reshape(-1)
        weights = torch.linspace(-1, 1, flat.numel(), dtype=torch.float64).to(rounding or dtype).to(device, dtype)
        (flat * weights).sum().backward()
        res["grad values"], res["grad dense"] = _to_cpu(a_dev.grad), _to_cpu(d_dev.grad if d_dev is not None else None)
    return res


def _to_cpu(t: torch.Tensor | None) -> dict[str, Any] | None:
    if t is None:
        return None
    t = t.detach().cpu()
    if t.layout == torch.strided:
        return {"layout": t.layout, "dense": t.double()}
    csr = t.layout == torch.sparse_csr
    ptr, idx = (t.crow_indices(), t.col_indices()) if csr else (t.ccol_indices(), t.row_indices())
    return {"layout": t.layout, "dense": t.to_dense().double(), "indices": (ptr, idx), "values": t.values()}


def _compare(report: Report, name: str, got: dict[str, Any] | None, ref: dict[str, Any] | None,
             dtype: torch.dtype, exact: bool) -> None:
    """One result against torch's CPU result: same layout (and index arrays), values within the dtype's tolerance
    (``exact``: conversions, bitwise), no NaN (poison)."""
    if got is None or ref is None:
        report._add(name, got is None and ref is None, "no result" if got is None else "torch gives none")
        return
    if got["layout"] != ref["layout"] or got["dense"].shape != ref["dense"].shape:
        report._add(name, False, f"{got['layout']} {tuple(got['dense'].shape)}, torch gives {ref['layout']} "
                                 f"{tuple(ref['dense'].shape)}", max_err=None)
        return
    if "indices" in ref and not all(torch.equal(x, y) for x, y in zip(got["indices"], ref["indices"])):
        report._add(name, False, "index arrays differ from torch's", max_err=None)
        return
    if exact:
        ok = torch.equal(got["values"], ref["values"]) if "values" in ref else torch.equal(got["dense"], ref["dense"])
        report._add(name, ok, "bitwise equal" if ok else "values differ from torch's", max_err=0.0 if ok else None)
        return
    err = (got["dense"] - ref["dense"]).abs().max().item() if got["dense"].numel() else 0.0
    scale = max(1.0, ref["dense"].abs().max().item()) if ref["dense"].numel() else 1.0
    ok = bool(torch.isfinite(got["dense"]).all()) and err <= SPARSE_API_TOLERANCE[dtype] * scale
    report._add(name, ok, f"max|err| {err:.2e}", max_err=err)


class _Counting:
    """Counts the calls of the kernels it wraps (the executor's), to show that torch's API reached them."""

    def __init__(self, inner: Any):
        self.inner, self.calls = inner, 0

    def forward(self, *args: Any) -> torch.Tensor:
        self.calls += 1
        return self.inner.forward(*args)

    def backward(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        return self.inner.backward(*args)


def run_sparse_api_checks(device: str, report: Report, kernels: Any = None,
                          dtypes: tuple[torch.dtype, ...] = SPARSE_API_DTYPES, seed: int = 0) -> dict[str, Any]:
    """torch's own sparse API on ``device`` (issue #39): :func:`sparse_api_cases` in each dtype, forward and the
    gradients to the dense operand and to the compressed operand's values, against torch's CPU kernels in float64
    on the same rounded inputs (conversions: torch's CPU result in the dtype, bitwise). On MPS it runs what
    ``import torch_sparse_metal`` registered; with ``kernels`` (the executor's, on the CPU) it computes the
    references first, then runs the same calls with those registrations standing in for torch's CPU kernels
    (:func:`torch_sparse_metal.sparse_mps_ops.on_cpu_keys`). Each product's "ran the kernels" check holds only where
    its calls reached the kernels (``kernels``, or on MPS the registered Metal hosts) and no Metal host ran the
    reference path for them (:meth:`Report.ran_kernels`). Returns what was registered and skipped, for the report.

    Example (the extension's CPU ops as the kernels, one dtype):
        >>> from torch_sparse_metal import sparse_mps
        >>> report = Report()
        >>> _ = run_sparse_api_checks("cpu", report, sparse_mps.OPS, dtypes=(torch.float32,))  # doctest: +ELLIPSIS
          PASS  torch.sparse float32  torch.mm(csr, D) out ...
        >>> report.failures
        0
    """
    from torch_sparse_metal import sparse_mps_ops

    info = {"registered": [list(r) for r in sparse_mps_ops.registered()],
            "skipped": {f"{op} {key}": why for (op, key), why in sparse_mps_ops.skipped().items()}}
    if info["skipped"]:
        print("torch.sparse on MPS: torch's own kernels (or no such op) for " + ", ".join(info["skipped"]))
    cases = sparse_api_cases(seed)
    references: dict[tuple[str, torch.dtype], Any] = {}
    for dtype in dtypes:  # torch's CPU kernels (float64; conversions in the dtype), before anything stands in
        for name, (fn, a, d, more) in cases.items():
            forward = "(forward)" in name
            try:
                rounded = [_on(t, "cpu", dtype, False) for t in (a, d, *more)]  # the inputs the device gets
                references[(name, dtype)] = _sparse_api_run(fn, *rounded[:2], tuple(rounded[2:]), "cpu", dtype
                                                            if forward and "to_sparse" in name else torch.float64,
                                                            not forward, rounding=dtype)
            except Exception as exc:  # noqa: BLE001 - a reference torch cannot compute is reported
                references[(name, dtype)] = exc
    counting = _Counting(kernels) if kernels is not None else None
    with sparse_mps_ops.on_cpu_keys(counting) if counting is not None else contextlib.nullcontext():
        for dtype in dtypes:
            for name, (fn, a, d, more) in cases.items():
                tag = f"torch.sparse {str(dtype).removeprefix('torch.'):<8} {name}"
                ref, forward, before = references[(name, dtype)], "(forward)" in name, counting and counting.calls
                calls_before = calls_by_path()
                try:
                    if isinstance(ref, Exception):
                        raise RuntimeError(f"torch's CPU reference failed: {ref}")
                    got = _sparse_api_run(fn, a, d, more, device, dtype, not forward)
                except Exception as exc:  # noqa: BLE001 - every failure is reported, the run goes on
                    report.error(tag, exc)
                    continue
                exact = forward and "to_sparse" in name
                for what in ("out", "grad dense", "grad values"):
                    if what in ref:
                        _compare(report, f"{tag} {what}", got[what], ref[what], dtype, exact)
                if "to_sparse" not in name:  # a product: its results must come from the kernels
                    report.ran_kernels(f"{tag} ran the kernels", calls_by_path(calls_before),
                                       None if counting is None else counting.calls - before)
    return info


def pipelines(metal: Any) -> list[dict[str, Any]]:
    """Each kernel's pipeline limits as the device reports them (the host sizes threadgroups from these), every
    layout's; a family and dtype whose kernels cannot run here has none (:func:`paths` says why)."""
    rows = []
    for host in metal.layouts.values():
        for dtype in KERNEL_DTYPES:  # one library per family and dtype
            if host.runs_reference(dtype):
                continue
            try:
                fns = {name: host.pipeline(name, dtype) for name in host.kernel_names(dtype)}
            except MetalUnavailable:  # remembered by the host, named by paths()
                continue
            rows += [{"kernel": name, "thread_execution_width": int(fn.thread_execution_width),
                      "max_threads_per_threadgroup": int(fn.max_threads_per_threadgroup),
                      "static_thread_group_memory_length": int(getattr(fn, "static_thread_group_memory_length", 0))}
                     for name, fn in fns.items()]
    return rows


def paths(metal: Any) -> dict[str, dict[str, str]]:
    """Which path each layout's ops run for each dtype: ``"metal"`` (the kernels) or ``"reference"`` (torch's own
    ops: asked for with TORCH_SPARSE_METAL_METAL=reference, or the family's kernels of that dtype cannot run here,
    with the error). Compiles each library that has not been yet and creates its pipelines, so that a pipeline that
    cannot be created shows here rather than at a call."""
    out: dict[str, dict[str, str]] = {}
    for layout, host in metal.layouts.items():
        for dtype in KERNEL_DTYPES:
            with warnings.catch_warnings():  # the one fall-back warning is for users' runs; here it is the report
                warnings.simplefilter("ignore")
                ref = host.runs_reference(dtype)
            if not ref:
                try:
                    for name in host.kernel_names(dtype):
                        host.pipeline(name, dtype)
                except MetalUnavailable:  # remembered by the host: its calls of this dtype run the reference path
                    ref = True
            why = f" ({host.failures[dtype]})" if dtype in host.failures else ""
            out.setdefault(layout, {})[str(dtype).removeprefix("torch.")] = ("reference" + why) if ref else "metal"
    return out


def calls_by_path(since: Counter | None = None) -> Counter:
    """The Metal hosts' calls in this process by ``(family, dtype, path)`` (:data:`.backends.metal.CALLS_BY_PATH`;
    path ``"metal"``: the kernels ran, ``"reference"``: the reference path did), those since ``since`` (an earlier
    result) where given."""
    now = Counter(CALLS_BY_PATH)
    return now - since if since is not None else now


def ran_rows(calls: Counter) -> list[dict[str, Any]]:
    """``calls`` (:func:`calls_by_path`) as the report's rows: family, dtype, path, calls.

    Example:
        >>> ran_rows(Counter({("csr_linear.metal", torch.bfloat16, "reference"): 3}))
        [{'family': 'csr_linear.metal', 'dtype': 'bfloat16', 'path': 'reference', 'calls': 3}]
    """
    return [{"family": family, "dtype": str(dtype).removeprefix("torch."), "path": path, "calls": n}
            for (family, dtype, path), n in sorted(calls.items(), key=lambda kv: (kv[0][0], str(kv[0][1]), kv[0][2]))]


def _describe_ran(calls: Counter) -> str:
    """E.g. ``"Metal kernels: csr_linear.metal float32 x5; reference path: csr_linear.metal bfloat16 x5"``."""
    parts = []
    for path, label in (("metal", "Metal kernels"), ("reference", "reference path")):
        rows = [r for r in ran_rows(calls) if r["path"] == path]
        if rows:
            parts.append(f"{label}: " + ", ".join(f"{r['family']} {r['dtype']} x{r['calls']}" for r in rows))
    return "; ".join(parts) or "no call reached the Metal hosts"


def tuner_choices(backend: Any, device: str, tune: bool, features: int = BENCH_FEATURES, batch: int = BENCH_BATCH,
                  edges: list[int] | None = None) -> list[dict[str, Any]]:
    """The configuration ``auto`` runs for each layer of the timing table on ``device``, printed and returned:
    the forward's P and the backward's strategy and P, each ``"cached"`` (this machine's earlier decision),
    ``"tuned"`` (timed now through ``backend``, a MetalCsrLinear, and cached as a first use would) or
    ``"static"`` (the static rule: without ``tune``, or with tuning off)."""
    from torch_sparse_metal import CSRTopology

    tune = tune and tuning.enabled()
    edges = [e for e, _, _ in PUBLISHED_M1_PRO] if edges is None else edges
    print(f"\nauto's configuration on {device}, layer {features}x{features}, batch {batch} "
          f"({'tuned on this machine, or cached from earlier use' if tune else 'the static rule: nothing is tuned'})")
    print(f"{'edges':>7}  {'forward':<20} {'backward':<34} from (forward / backward)")
    rows = []
    for count in edges:
        g = torch.Generator().manual_seed(count)
        topo = CSRTopology.random(features, features, count / features**2, generator=g).to(device)
        x, w = torch.randn(batch, features, generator=g).to(device), torch.randn(topo.nnz, generator=g).to(device)
        row = _tuner_row(backend, tune, topo, x, w, torch.randn(batch, features, generator=g).to(device))
        rows.append(row)
        print(f"{topo.nnz:>7}  {tuning.label(row['forward']):<20} {tuning.label(row['backward']):<34} "
              f"{row['forward_from']} / {row['backward_from']}")
    return rows


def _tuner_row(backend: Any, tune: bool, topo: Any, x: torch.Tensor, w: torch.Tensor, go: torch.Tensor
               ) -> dict[str, Any]:
    """One layer of :func:`tuner_choices`: each op's configuration and where it came from."""
    from torch_sparse_metal.backends.mps import values_per_lane

    sizes = (topo.in_features, topo.out_features, topo.nnz, x.shape[0])
    static = {"values_per_lane": values_per_lane(x.shape[0])}
    ops = {"forward": ((), lambda _c: backend.forward(x, w, *topo.kernel_args()), static),
           "backward": (tuned_strategies(x.device.type),
                        lambda c: backend.backward(go, x, w, *topo.kernel_args(), c["strategy"]),
                        {"strategy": STATIC.value, **static})}
    row: dict[str, Any] = {"edges": topo.nnz}
    for op, (strategies, run, rule) in ops.items():
        bucket, candidates = tuning.bucket_key(x.dtype, *sizes, op), tuning.candidates(x.device.type, strategies)
        known = tuning.cached(x.device, bucket, candidates) if tune else None
        chosen = known or (tuning.choose(x.device, bucket, candidates, run) if tune else None)
        row[op], row[f"{op}_from"] = (chosen, "cached" if known else "tuned") if chosen else (rule, "static")
    return row


# ------------------------------------------------------------------------------------------------ timing
def time_ms(fn: Callable[[], object], device: str, reps: int) -> tuple[float, float]:
    """Deprecated (use :class:`torch_sparse_metal.timing.Timer`): ``(nan, median synchronised wall ms)``."""
    warnings.warn("selfcheck.time_ms is deprecated: use torch_sparse_metal.timing.Timer", DeprecationWarning,
                  stacklevel=2)
    return math.nan, Timer(torch.device(device), reps).many({"fn": fn})["fn"].ms


def _bench_row(metal: Any, device: str, reps: int, topo: Any, x: torch.Tensor, w: torch.Tensor,
               go: torch.Tensor) -> dict[str, Any]:
    """One line of the timing table: ours, the reference path (torch's own ops: what a failed compile falls back to,
    and what a user would otherwise write by hand), dense and torch.sparse on one layer, interleaved in one timer
    run; each method's ``(ms, host ms)``, None where torch.sparse cannot run here."""
    from torch_sparse_metal.backends import mps_reference
    from torch_sparse_metal.ops._csr_linear import check_backward, check_forward

    dense = torch.zeros(topo.out_features, topo.in_features, device=device)
    dense[topo.dst.long(), topo.src.long()] = w
    fns = {"ours_fwd": lambda: metal.forward(x, w, *topo.kernel_args())}
    for s in STRATEGIES:
        fns[f"ours_{s}"] = functools.partial(metal.backward, go, x, w, *topo.kernel_args(), s)
    index = topo.kernel_args()
    forward_sizes = check_forward(x, w, *index)
    backward_sizes = check_backward(go, x, w, *index, STRATEGIES[0])
    fns["reference_fwd"] = lambda: mps_reference.forward(x, w, index, forward_sizes)
    fns["reference_bwd"] = lambda: mps_reference.backward(go, x, w, index, backward_sizes)
    fns["dense_fwd"] = lambda: x @ dense.t()
    fns["dense_bwd"] = lambda: (go.t() @ x, go @ dense)
    sp_fwd, sp_bwd, note = torch_sparse_ops(topo, w, x, go)  # probed: varies by torch version
    fns.update({k: f for k, f in (("torch_sparse_fwd", sp_fwd), ("torch_sparse_bwd", sp_bwd)) if f is not None})
    times: dict[str, Timing] = Timer(torch.device(device), reps).many(fns)
    row: dict[str, Any] = {"edges": topo.nnz, "density": topo.density, "torch_sparse": note}
    for key in (*fns, "torch_sparse_fwd", "torch_sparse_bwd"):
        row[key] = (times[key].ms, times[key].host_ms) if key in times else None
    return row


def _cell(v: tuple[float, float] | None, which: slice = slice(0, 2)) -> str:
    return "n/a" if v is None else "/".join(f"{t:.3f}" for t in v[which])


def bench(metal: Any, device: str, reps: int, features: int = BENCH_FEATURES, batch: int = BENCH_BATCH,
          seed_cases: list[tuple[int, float, float]] = PUBLISHED_M1_PRO) -> list[dict[str, Any]]:
    """Table like the published M1 Pro figures, on ``device``: ours (device and wall ms), dense and torch.sparse on
    the same device."""
    from torch_sparse_metal import CSRTopology

    rows: list[dict[str, Any]] = []
    print(f"\nTimings on {device}, layer {features}x{features}, batch {batch}, float32, median of {reps} interleaved "
          "rounds, ms (synchronised wall clock; ours: wall / the host's time inside the call)")
    print(f"{'edges':>7} {'ours fwd':>15} {'fused bwd':>15} {'a-free bwd':>15} {'reference fwd/bwd':>17} "
          f"{'dense fwd/bwd':>15} {'torch.sparse fwd/bwd':>21}   published M1 Pro fused / a-free")
    wall = slice(0, 1)
    for edges, s_fused, s_free in seed_cases:
        g = torch.Generator().manual_seed(edges)
        topo = CSRTopology.random(features, features, edges / features**2, generator=g).to(device)
        x = torch.randn(batch, features, generator=g).to(device)
        w = torch.randn(topo.nnz, generator=g).to(device)
        go = torch.randn(batch, features, generator=g).to(device)
        row = _bench_row(metal, device, reps, topo, x, w, go)
        rows.append(row)
        reference = _cell(row["reference_fwd"], wall) + "/" + _cell(row["reference_bwd"], wall)
        dense = _cell(row["dense_fwd"], wall) + "/" + _cell(row["dense_bwd"], wall)
        sparse = _cell(row["torch_sparse_fwd"], wall) + "/" + _cell(row["torch_sparse_bwd"], wall)
        print(f"{topo.nnz:>7} {_cell(row['ours_fwd']):>15} {_cell(row['ours_fused_atomic']):>15} "
              f"{_cell(row['ours_atomic_free']):>15} {reference:>17} {dense:>15} {sparse:>21}   "
              f"{s_fused:>6.1f} / {s_free:.1f}")
    print(f"torch.sparse on {device}: {rows[-1]['torch_sparse'] if rows else 'not probed'}")
    print("(dense and torch.sparse: wall ms; the published figures timed whole training steps: compare ratios)")
    return rows


#: ``--model-edges``: an edge count the timing table's layer can hold.
_edge_count = number(int, lambda v: 1 <= v <= BENCH_FEATURES**2, "a positive integer",
                     f"an edge count from 1 to {BENCH_FEATURES**2:,} (a {BENCH_FEATURES}x{BENCH_FEATURES} layer)")


#: The command's name in its usage and help, and what it does (``python -m tsm_dev.selfcheck`` names itself).
PROG = "python -m torch_sparse_metal_tools.selfcheck"
DESCRIPTION = ("Self-check of torch_sparse_metal's Metal kernels on MPS: every op, strategy, dtype and layout against "
               "a float64 reference and the CPU backend, which path computed them, the pipelines, auto's "
               "configuration and a timing table.")


def build_parser(prog: str = PROG, description: str = DESCRIPTION) -> argparse.ArgumentParser:
    """The command line of ``prog``; every value is checked as it is parsed (a usage error, exit status 2).

    Example:
        >>> build_parser().parse_args(["--model", "--model-edges", "100", "2000"]).model_edges
        [100, 2000]
        >>> build_parser("python -m tsm_dev.selfcheck").format_usage().split("[")[0]
        'usage: python -m tsm_dev.selfcheck '
    """
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--no-bench", action="store_true", help="skip the timing table")
    parser.add_argument("--reps", type=positive_int, default=20, help="timed rounds per measurement (default 20)")
    parser.add_argument("--json", type=Path, default=None, help="write the whole report to this file")
    parser.add_argument("--model", action="store_true",
                        help="print the traffic model of every kernel at the published sizes instead of checking")
    parser.add_argument("--model-edges", type=_edge_count, nargs="+", default=[e for e, _, _ in PUBLISHED_M1_PRO],
                        help="edge counts of the model's layers (default: the published ones)")
    return parser


@dataclass(frozen=True)
class Executor:
    """What runs the checks where there is no MPS: the repository's MSL-on-CPU executor and its traffic model,
    handed in by ``python -m tsm_dev.selfcheck``, so that the installed package never imports the development
    tools. ``compile_shader`` stands in for ``torch.mps.compile_shader`` on CPU tensors and raises ``error`` where
    it cannot compile (no C++ compiler); ``model_rows`` and ``format_tables`` are ``tsm_dev.traffic_model``'s."""

    compile_shader: Callable[[str], Any]
    error: type[Exception]
    model_rows: Callable[..., list[dict[str, Any]]]
    format_tables: Callable[[list[dict[str, Any]]], list[str]]


#: Where a user without MPS is sent for the executor.
_FROM_A_CHECKOUT = ("The MSL-on-CPU executor is a development tool of the repository (tsm_dev), not installed: from a "
                    "checkout of torch_sparse_metal, run `python -m tsm_dev.selfcheck{}`.")


def main(argv: list[str] | None = None, executor: Executor | None = None, *, prog: str = PROG,
         description: str = DESCRIPTION) -> int:
    """Run the self-check (or ``--model``), with ``executor`` where MPS is missing; returns the exit status. Bad
    arguments and a --json file that cannot be written are usage errors (exit status 2) before anything runs.
    ``prog`` and ``description``: the command as its usage and help name it (:func:`build_parser`)."""
    parser = build_parser(prog, description)
    args = parser.parse_args(argv)
    if args.json is not None:
        check_output_file(parser, args.json, "--json")
    warnings.filterwarnings("ignore", message=".*[Ss]parse")  # torch.sparse's beta and invariant-check notices
    with heartbeat("self-check"):  # compiling the shaders for the executor can take a while without a line
        return traffic_model(args.model_edges, args.json, executor=executor) if args.model else _check(args, executor)


def _check(args: argparse.Namespace, executor: Executor | None) -> int:
    """The checks, pipelines, tuning and timing table of :func:`main`."""
    from torch_sparse_metal.backends import mps

    info = hardware()
    report = Report()
    result: dict[str, Any] = {"hardware": info, "checks": report.checks}
    if torch.backends.mps.is_available():
        print(f"torch_sparse_metal self-check on MPS ({hardware_name(info)}, torch {torch.__version__}): Metal "
              "kernels vs a float64 dense reference and the CPU backend")
        device = "mps"
        metal = mps.MetalCsrLinear(lambda src: torch.mps.compile_shader(src), "mps", poison=True,
                                   check_platform=mps.check_mps_support)
    else:
        print("MPS is not available on this machine, so Metal itself is NOT being tested here.")
        if executor is None:
            print(_FROM_A_CHECKOUT.format("") + " Nothing was checked.")
            return _finish(args.json, result, "NOTHING CHECKED", 2)
        print("Running the same checks with the MSL-on-CPU executor (the repository's tsm_dev.msl), which compiles "
              "the unchanged shaders/*.metal as C++ and runs them on CPU tensors through the same host code.\n"
              "No timings are printed: executor timings say nothing about Metal.")
        device = "cpu"
        metal = mps.MetalCsrLinear(executor.compile_shader, device_type="cpu", poison=True)
        try:
            metal.library  # noqa: B018 - compile now, to report a missing compiler clearly
        except RuntimeError as exc:  # the host's compile error, raised from the executor's own
            if not isinstance(exc.__cause__, executor.error):
                raise
            print(f"Cannot run the executor here ({exc.__cause__}); nothing was checked.")
            return _finish(args.json, result, "NOTHING CHECKED", 2)
    result["target"] = "mps" if device == "mps" else "msl-executor"
    start = calls_by_path()
    try:
        result["paths"] = paths(metal)
        for layout, by_dtype in result["paths"].items():
            print(f"{layout} ops run: " + ", ".join(f"{d} {v.split(' (')[0]}" for d, v in by_dtype.items()))
    except Exception as exc:  # noqa: BLE001 - reported like a check, the run goes on
        report.error("paths", exc)
    run_checks(device, metal, report)
    run_vector_checks(device, metal, report)
    print("\ntorch.sparse on MPS (torch's own API through these kernels) vs torch's CPU kernels" +
          ("" if device == "mps" else ", the MPS registrations standing in for torch's CPU kernels"))
    try:
        result["torch_sparse"] = run_sparse_api_checks(device, report, None if device == "mps" else metal)
    except Exception as exc:  # noqa: BLE001 - reported like a check, the run goes on
        report.error("torch.sparse on MPS", exc)
    result["ran"] = ran_rows(calls_by_path(start))
    print("\nWhat computed the checked results (calls of each family and dtype):")
    print("\n".join(f"  {r['family']:<24} {r['dtype']:<9} "
                    f"{'Metal kernels' if r['path'] == 'metal' else 'REFERENCE PATH, not the Metal kernels':<38} "
                    f"{r['calls']}" for r in result["ran"]) or "  nothing")
    try:
        result["pipelines"] = pipelines(metal)
        widths = sorted({(p["thread_execution_width"], p["max_threads_per_threadgroup"]) for p in result["pipelines"]})
        print(f"\npipelines (SIMD width, max threads per threadgroup): {widths}")
    except Exception as exc:  # noqa: BLE001 - a report without pipeline limits is still worth sending
        report.error("pipeline limits", exc)
    try:  # on MPS through the instance the op dispatches to; the executor's timings would say nothing about Metal
        result["tuning"] = tuner_choices(mps.default() if device == "mps" else metal, device, tune=device == "mps")
    except Exception as exc:  # noqa: BLE001 - reported like a check, the run goes on
        report.error("auto's configuration", exc)
    if device == "mps" and not args.no_bench and not report.failures:
        result["timings"] = bench(metal, device, args.reps)
    if not report.checks:
        return _finish(args.json, result, "NOTHING CHECKED", 2)
    verdict = "FAIL" if report.failures else "PASS"
    print(f"\n{verdict}: {report.failures} of {len(report.checks)} check(s) failed")
    return _finish(args.json, result, verdict, 1 if report.failures else 0)


def traffic_model(edges: list[int], path: Path | None, features: int = BENCH_FEATURES, batch: int = BENCH_BATCH,
                  executor: Executor | None = None) -> int:
    """The traffic model's tables (every kernel, P = 1 and 4, float32 and float16) at the timing table's sizes,
    computed through ``executor``."""
    from torch_sparse_metal.backends.mps import VALUES_PER_LANE

    if executor is None:
        print("The traffic model runs on the executor. " + _FROM_A_CHECKOUT.format(" --model") +
              " Nothing was modelled.")
        return _finish(path, {"hardware": hardware()}, "NOTHING MODELLED", 2)

    print(f"Traffic model of the Metal kernels (MSL-on-CPU executor), layer {features}x{features}, batch {batch}, "
          f"edges {', '.join(map(str, edges))}: counts, not timings; docs/metal.md says what they mean")
    result: dict[str, Any] = {"hardware": hardware(), "features": features, "batch": batch}
    try:
        rows = executor.model_rows(edges, [torch.float32, torch.float16], VALUES_PER_LANE, features, batch)
    except executor.error as exc:
        print(f"Cannot run the executor here ({exc}); nothing was modelled.")
        return _finish(path, result, "NOTHING MODELLED", 2)
    print("\n".join(executor.format_tables(rows)))
    result["model"] = rows
    return _finish(path, result, "MODELLED", 0)


def _finish(path: Path | None, result: dict[str, Any], verdict: str, status: int) -> int:
    result["verdict"] = verdict
    if path is not None:
        path.write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {path} (attach it to an issue)")
    return status


if __name__ == "__main__":
    wait_passively()
    sys.exit(main())
