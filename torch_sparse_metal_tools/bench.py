"""Benchmark of the csr_linear ops against dense matmuls and torch.sparse, on any device, in one run.

``python -m torch_sparse_metal_tools.bench --device {cpu,cuda,mps} [--cases ...] [--dtypes ...] [--out DIR] [--reps N]``

For every case (in_features, out_features, density, batch) it times, side by side: our forward and both backward
strategies (``torch.ops.torch_sparse_metal.csr_linear`` / ``csr_linear_backward``, layout conversions included),
the dense ``nn.Linear`` matmuls (and TF32 on CUDA), and torch.sparse CSR (``torch.sparse.mm`` forward;
``sampled_addmm`` + ``mm`` backward, with the transposed dense operands prepared outside the timing, which favours
torch.sparse), in each value dtype of ``--dtypes`` (default float32; the float32 baselines are always timed too,
the targets being stated against them). Timing: the package's one timer (:class:`torch_sparse_metal.timing.Timer`):
on CUDA device events around each call while the host runs ahead, as in a training loop, with the host's own time
per call beside it; on MPS and CPU each call's synchronised wall time, host included. Warm-up, then the median of
up to ``--reps`` rounds, the methods and dtypes of a case interleaved (so machine noise hits them alike and the
ratios are same-run). It prints
a table with ratios to each baseline and to the roofline floor (where the device's peak rates are known), each
ratio the median of its rounds' ratios with their interquartile range, marked inconclusive where that range holds 1
and too noisy where it spans more than 1.5x, and a closing line where the machine was too noisy to conclude (a
noisy machine can turn a clear lead into a toss-up between two runs: the range shows it), and writes
``<out>/<device>.json`` (each row with its ``dtype`` and host times; our rows with their ``speedup`` over the
baselines, ranges and verdicts included) and, with matplotlib, a PNG plot per case group. ``--out`` defaults to
a new folder ``bench-<device>-<date>-<time>`` in the current directory; files of an earlier run are replaced only
with ``--overwrite``.

Example:
    >>> rows = run_cases([Case(256, 128, 0.05, 32)], device="cpu", reps=3)  # doctest: +SKIP
    >>> sorted({r["method"] for r in rows})[:2]  # doctest: +SKIP
    ['atomic_free', 'dense_fp32']
    >>> run_cases([Case(256, 128, 0.05, 32)], "cpu", 3, dtypes=(torch.bfloat16,))[0]["speedup"]  # doctest: +SKIP
    {'torch_sparse_fp32': {'inconclusive': [], 'noisy': [], 'fwd': 1.9, 'fwd_iqr': [1.8, 2.0], 'bwd': 4.1, ...}, ...}
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

import torch_sparse_metal  # noqa: F401  (loads the ops)
from torch_sparse_metal import devices
from torch_sparse_metal.contract import DTYPES, supported_dtypes
from torch_sparse_metal.strategy import CONCRETE
from torch_sparse_metal.timing import Timer, Timing
from torch_sparse_metal.topology import CSRTopology
from torch_sparse_metal_tools.argtypes import check_writable, positive_int
from torch_sparse_metal_tools.cli import device_type, print_openmp_note, wait_passively
from torch_sparse_metal_tools.progress import heartbeat

OPS = torch.ops.torch_sparse_metal
#: Short dtype names, as in the dense baselines' method names (``dense_fp32``, ``dense_bf16``, ...).
SHORT = {torch.float32: "fp32", torch.float64: "fp64", torch.float16: "fp16", torch.bfloat16: "bf16"}

#: Peak rates used for the roofline floor: (fp32 non-tensor FLOP/s, memory bytes/s, source).
PEAKS: dict[str, tuple[float, float, str]] = {
    "H200": (67e12, 4.8e12, "NVIDIA H200 datasheet (SXM): 67 TFLOP/s FP32, 4.8 TB/s HBM3e"),
    "H100": (67e12, 3.35e12, "NVIDIA H100 datasheet (SXM): 67 TFLOP/s FP32, 3.35 TB/s HBM3"),
    "M1 Pro": (5.2e12, 200e9, "Apple M1 Pro: 16-core GPU ~5.2 TFLOP/s FP32, 200 GB/s unified memory"),
}


@dataclass(frozen=True)
class Case:
    """One problem: a ``[batch, in] -> [batch, out]`` layer with ``round(density * in * out)`` edges."""

    in_features: int
    out_features: int
    density: float
    batch: int
    group: str = "custom"

    def __str__(self) -> str:
        """The case in words, as the benchmark prints it.

        Example:
            >>> print(Case(1024, 512, 0.05, 256, "cpu"))
            1024x512, density 0.05, batch 256 (group cpu)
        """
        return (f"{self.in_features}x{self.out_features}, density {self.density:g}, batch {self.batch} "
                f"(group {self.group})")


#: The case groups :func:`cases` knows (``all``: seed, design, density and batch).
CASE_GROUPS = ("seed", "design", "density", "batch", "all", "cpu")


def cases(names: Iterable[str]) -> list[Case]:
    """The named case groups: ``seed``, ``design``, ``density``, ``batch`` (or ``all``), and ``cpu``; a ValueError
    names any other.

    Example:
        >>> [(c.in_features, c.density, c.batch) for c in cases(["cpu"])][:2]
        [(1024, 0.05, 256), (4096, 0.05, 256)]
    """
    out: list[Case] = []
    names = set(names)
    unknown = sorted(names - set(CASE_GROUPS))
    if unknown:
        raise ValueError(f"unknown case group(s) {', '.join(unknown)}: choose from {', '.join(CASE_GROUPS)}")
    if "all" in names:
        names = {"seed", "design", "density", "batch"}
    if "seed" in names:  # the published M1 Pro sizes (docs/metal.md): 22K to 61K edges, 1024-wide, batch 256
        out += [Case(1024, 1024, e / 1024**2, 256, "seed") for e in (22_000, 30_000, 39_000, 42_000, 61_000)]
    if "design" in names:  # the H200 reference sizes of docs/cuda.md
        out += [
            Case(1024, 1024, 0.05, 256, "design"),
            Case(4096, 4096, 0.05, 1024, "design"),
            Case(4096, 4096, 0.01, 1024, "design"),
            Case(16384, 16384, 0.01, 4096, "design"),
        ]
    if "cpu" in names:  # the CPU reference sizes of the README's CPU table (2-core machine)
        out += [
            Case(1024, 1024, 0.05, 256, "cpu"),
            Case(4096, 4096, 0.05, 256, "cpu"),
            Case(4096, 4096, 0.01, 256, "cpu"),
        ]
    if "density" in names:
        out += [Case(4096, 4096, d, 1024, "density") for d in (0.5, 0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002, 0.001)]
    if "batch" in names:
        out += [Case(4096, 4096, 0.05, b, "batch") for b in (1, 8, 32, 64, 128, 256, 512, 1024, 2048, 4096)]
    return out


def _peaks(device: torch.device) -> tuple[float, float, str] | None:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    elif device.type == "mps":
        name = "M1 Pro"  # the machine of the published figures; other Macs: add a row to PEAKS
    else:
        return None
    return next((v for k, v in PEAKS.items() if k in name), None)


def floor_ms(case: Case, nnz: int, element: int, peaks: tuple[float, float, str] | None) -> tuple[float, float]:
    """Roofline floor (forward, backward) in ms: max(FLOPs / peak, fewest bytes / bandwidth)."""
    if peaks is None:
        return math.nan, math.nan
    flops_peak, bandwidth, _ = peaks
    b, i, o = case.batch, case.in_features, case.out_features
    index = 4 * (nnz + i + o)
    fwd_bytes = element * (b * i + b * o + nnz) + index  # x, y, weight
    bwd_bytes = element * (2 * b * i + b * o + 2 * nnz) + index  # x, grad_out, grad_x, weight, grad_w
    fwd = max(2 * nnz * b / flops_peak, fwd_bytes / bandwidth)
    bwd = max(4 * nnz * b / flops_peak, bwd_bytes / bandwidth)
    return fwd * 1e3, bwd * 1e3


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name when it has none), at most 120 characters."""
    return (str(exc).splitlines() or [type(exc).__name__])[0][:120]


def torch_sparse_ops(topo: CSRTopology, w: torch.Tensor, x: torch.Tensor, go: torch.Tensor, probe: bool = True
                     ) -> tuple[Callable[[], object] | None, Callable[[], object] | None, str]:
    """torch's own sparse path for this layer on the tensors' device, the weight as one CSR matrix, probed at run
    time (torch has no CSR matmul on MPS through 2.15: it varies by version): ``(forward, backward, note)``.

    Forward: ``torch.sparse.mm`` of the CSR weight. Backward: ``sampled_addmm`` (CSR) for grad_w and
    ``torch.sparse.mm`` of the transposed CSR weight for grad_x, with the transposed dense operands prepared here,
    outside any timing (which favours torch.sparse). All in the tensors' dtype: what the installed torch cannot do
    on this device in that dtype is None, and the note says why (naming a dtype other than float32). With
    ``probe=False`` the two callables are returned unprobed (the caller runs and judges them) and the note only
    names them.

    Example:
        >>> topo = CSRTopology.random(8, 6, 0.5, generator=torch.Generator().manual_seed(0))
        >>> fwd, bwd, note = torch_sparse_ops(topo, torch.randn(topo.nnz), torch.randn(3, 8), torch.randn(3, 6))
        >>> note
        'forward: torch.sparse.mm (CSR); backward: sampled_addmm + torch.sparse.mm (CSR)'
    """
    shape = (topo.out_features, topo.in_features)
    at = "" if w.dtype == torch.float32 else f" in {str(w.dtype).removeprefix('torch.')}"
    xt, got = x.t().contiguous(), go.t().contiguous()
    try:
        coo = torch.sparse_coo_tensor(torch.stack([topo.dst.long(), topo.src.long()]), w, shape).coalesce()
        csr, csr_t = coo.to_sparse_csr(), coo.t().coalesce().to_sparse_csr()
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        return None, None, f"no sparse CSR tensors{at}: {first_line(exc)}"
    forward = functools.partial(torch.sparse.mm, csr, xt)

    def backward() -> object:
        return torch.sparse.sampled_addmm(csr, got, x, beta=0.0), torch.sparse.mm(csr_t, got)

    if not probe:
        return forward, backward, "forward: torch.sparse.mm (CSR); backward: sampled_addmm + torch.sparse.mm (CSR)"
    fwd_why, bwd_why = refusal(forward), refusal(backward)
    notes = ["forward: torch.sparse.mm (CSR)" if fwd_why is None else f"no forward{at} ({fwd_why})",
             "backward: sampled_addmm + torch.sparse.mm (CSR)" if bwd_why is None else f"no backward{at} ({bwd_why})"]
    return forward if fwd_why is None else None, backward if bwd_why is None else None, "; ".join(notes)


def refusal(fn: Callable[[], object]) -> str | None:
    """None when ``fn`` runs, else the first line of why not (a design or dtype this device cannot run)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - any refusal is reported, not timed
        return first_line(exc)
    return None


def _dtype_fns(topo: CSRTopology, x: torch.Tensor, go: torch.Tensor, w: torch.Tensor, dense: torch.Tensor,
               ours: bool, designs: dict[str, object]) -> tuple[dict[str, Callable[[], object]], str]:
    """The timed callables of one dtype, keyed ``method/stage`` (ours only with ``ours``), and torch.sparse's note."""
    args = topo.kernel_args()
    fns: dict[str, Callable[[], object]] = {}
    if ours:
        fns["ours/fwd"] = lambda: OPS.csr_linear(x, w, *args, "auto")
        for s in CONCRETE:
            fns[f"{s.value}/bwd"] = lambda s=s.value: OPS.csr_linear_backward(go, x, w, *args, s)
        for label, design in designs.items():
            design_fns = {f"{label}/fwd": lambda m=design: m.forward(x, w, *args)}
            for s in CONCRETE:
                design_fns[f"{label}/{s.value}/bwd"] = lambda m=design, s=s.value: m.backward(go, x, w, *args, s)
            why = next(filter(None, map(refusal, design_fns.values())), None)
            if why:
                print(f"  {label} in {x.dtype}: not timed ({why})")
            else:
                fns.update(design_fns)
    fns["dense/fwd"] = lambda: x @ dense.t()
    fns["dense/bwd"] = lambda: (go.t() @ x, go @ dense)
    sparse_fwd, sparse_bwd, note = torch_sparse_ops(topo, w, x, go)
    if sparse_fwd is not None:
        fns["torch_sparse/fwd"] = sparse_fwd
    if sparse_bwd is not None:
        fns["torch_sparse/bwd"] = sparse_bwd
    return fns, note


def quartiles(values: list[float]) -> tuple[float, float]:
    """The first and third quartile of ``values`` (both the value itself for one).

    Example:
        >>> quartiles([1.0, 2.0, 3.0, 4.0, 5.0])
        (2.0, 4.0)
    """
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


#: A ratio whose interquartile range spans more than this factor (third quartile over first) is too noisy to read:
#: the middle half of the rounds disagree by more than that, so the machine's load, not the kernels, set it.
NOISY_SPREAD = 1.5


def paired_ratio(base: list[float], mine: list[float]) -> tuple[float, list[float], list[str]]:
    """The speedup ``base / mine`` of two methods timed in the same rounds: ``(median, [q1, q3], verdicts)`` of the
    per-round ratios (rounds paired in order; the median lies inside its own range). The verdicts are
    ``"inconclusive"`` where the range holds 1 (faster in some rounds, slower in others) and ``"noisy"`` where it
    spans more than :data:`NOISY_SPREAD`.

    Example:
        >>> paired_ratio([2.0, 4.0, 2.2], [1.0, 1.0, 1.1])
        (2.0, [2.0, 3.0], [])
        >>> paired_ratio([1.0, 9.0, 1.0, 1.0], [1.0, 1.0, 2.0, 0.5])[2]
        ['inconclusive', 'noisy']
    """
    if not base or len(base) != len(mine):
        raise ValueError(f"paired rounds needed: {len(base)} base and {len(mine)} timings")
    ratios = [b / m for b, m in zip(base, mine)]
    low, high = quartiles(ratios)
    verdicts = ["inconclusive"] * (low <= 1.0 <= high) + ["noisy"] * (high > NOISY_SPREAD * low)
    return statistics.median(ratios), [low, high], verdicts


def _speedups(rows: list[dict], rounds: dict[tuple[str, str], dict[str, list[float]]]) -> None:
    """Adds to each of our rows of one case its ``speedup`` (baseline ms / ours ms, same run) over torch.sparse
    fp32, dense fp32 (and TF32) and dense in the row's own dtype: per stage the median of the per-round ratios and
    their interquartile range (``fwd_iqr``, ``bwd_iqr``; :func:`paired_ratio`), ``inconclusive``, the stages whose
    range holds 1 (ours may be faster or slower), and ``noisy``, those whose range is too wide to read. Without
    per-round times a stage's ratio is the ratio of the medians and its range None.
    ``rounds``: each row's per-round ms by (method, dtype) and stage."""
    by = {(r["method"], r["dtype"]): r for r in rows}
    ours = {s.value for s in CONCRETE}
    for row in rows:
        if row["method"] not in ours:
            continue
        bases = {"torch_sparse_fp32": ("torch_sparse", "float32"), "dense_fp32": ("dense_fp32", "float32"),
                 "dense_tf32": ("dense_tf32", "float32")}
        short = SHORT[getattr(torch, row["dtype"])]
        bases[f"dense_{short}"] = (f"dense_{short}", row["dtype"])
        row["speedup"] = {}
        for label, key in bases.items():
            if key not in by:
                continue
            entry: dict[str, object] = {"inconclusive": [], "noisy": []}
            for k in ("fwd", "bwd"):
                base, mine = rounds[key].get(k), rounds[(row["method"], row["dtype"])].get(k)
                if not base or not mine:
                    entry[k] = by[key][f"{k}_ms"] / row[f"{k}_ms"]
                    entry[f"{k}_iqr"] = None
                    continue
                entry[k], entry[f"{k}_iqr"], verdicts = paired_ratio(base, mine)
                for verdict in verdicts:
                    entry[verdict].append(k)
            row["speedup"][label] = entry


def case_operands(case: Case, device: torch.device
                  ) -> tuple[CSRTopology, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float32 operands of one case on ``device``: ``(topology, x, grad_out, weight, dense weight)``, the
    topology seeded, the values fresh."""
    g = torch.Generator().manual_seed(0)
    topo = CSRTopology.random(case.in_features, case.out_features, case.density, generator=g).to(device)
    x = torch.randn(case.batch, case.in_features, device=device)
    go = torch.randn(case.batch, case.out_features, device=device)
    w = torch.randn(topo.nnz, device=device) * 0.05
    dense = torch.zeros(case.out_features, case.in_features, device=device)
    dense[topo.dst.long(), topo.src.long()] = w
    return topo, x, go, w, dense


def run_case(case: Case, device: torch.device, timer: Timer, designs: dict[str, object] | None = None,
             dtypes: Iterable[torch.dtype] = (torch.float32,)) -> list[dict]:
    """Time every method on one case in each of ``dtypes``, all in one round-robin; returns one row per method
    and dtype. ``designs``: other implementations of the two ops, timed beside ours and recorded as
    ``<strategy>/<label>`` (label -> an object with ``forward(x, weight, *topology)`` and ``backward(grad_out, x,
    weight, *topology, strategy)``, e.g. a kernel design under development). The float32 baselines are timed
    whatever ``dtypes``."""
    topo, x, go, w, dense = case_operands(case, device)
    nnz = topo.nnz
    ours = [d for d in dtypes if d in supported_dtypes(device.type)]
    for d in dict.fromkeys(dtypes):
        if d not in ours:
            print(f"  {d} on {device}: no csr_linear kernels (contract.h), not timed")
    rows: list[dict] = []
    rounds: dict[tuple[str, str], dict[str, list[float]]] = {}

    def add(method: str, dtype: torch.dtype, fwd: str, bwd: str, **extra: object) -> None:
        """A row from the timings of the callables ``fwd`` and ``bwd`` (keys of ``ms``, without the dtype)."""
        name = str(dtype).removeprefix("torch.")
        rounds[(method, name)] = {stage: [t for t, _ in samples[f"{key}@{dtype}"]]
                                  for stage, key in (("fwd", fwd), ("bwd", bwd)) if f"{key}@{dtype}" in samples}
        timings = {"fwd": ms.get(f"{fwd}@{dtype}"), "bwd": ms.get(f"{bwd}@{dtype}")}
        rows.append(
            {
                "in_features": case.in_features,
                "out_features": case.out_features,
                "density": case.density,
                "batch": case.batch,
                "nnz": nnz,
                "group": case.group,
                "dtype": name,
                "method": method,
                **{f"{stage}_{field}": getattr(t, field) if t else math.nan
                   for stage, t in timings.items() for field in ("ms", "host_ms")},
                **extra,
            }
        )

    fns: dict[str, Callable[[], object]] = {}
    notes: dict[torch.dtype, str] = {}
    timed = list(dict.fromkeys([*ours, torch.float32]))  # the float32 baselines, always
    for d in timed:
        d_fns, notes[d] = _dtype_fns(topo, x.to(d), go.to(d), w.to(d), dense.to(d), d in ours, designs or {})
        if "torch_sparse/fwd" not in d_fns or "torch_sparse/bwd" not in d_fns:
            print(f"  torch.sparse on {device}: {notes[d]}")
        fns.update({f"{k}@{d}": f for k, f in d_fns.items()})

    old_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # dense_fp32 on CUDA cores; bf16/fp16 use tensor cores anyway
    try:
        samples = timer.samples(fns)
        if device.type == "cuda":  # the same dense matmuls with TF32, timed as a group of their own
            torch.backends.cuda.matmul.allow_tf32 = True
            tf32 = {k: fns[f"dense/{k}@{torch.float32}"] for k in ("fwd", "bwd")}
            samples.update({f"dense_tf32/{k}@{torch.float32}": v for k, v in timer.samples(tf32).items()})
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old_tf32
    ms = {k: _timing(v) for k, v in samples.items()}
    for d in timed:
        if d in ours:
            for s in CONCRETE:
                add(s.value, d, "ours/fwd", f"{s.value}/bwd")
        add(f"dense_{SHORT[d]}", d, "dense/fwd", "dense/bwd")
        if f"dense_tf32/fwd@{d}" in ms:
            add("dense_tf32", d, "dense_tf32/fwd", "dense_tf32/bwd")
        if f"torch_sparse/fwd@{d}" in ms or f"torch_sparse/bwd@{d}" in ms:
            add("torch_sparse", d, "torch_sparse/fwd", "torch_sparse/bwd", note=notes[d])
        for label in designs or {}:
            if f"{label}/fwd@{d}" in ms:
                for s in CONCRETE:
                    add(f"{s.value}/{label}", d, f"{label}/fwd", f"{label}/{s.value}/bwd")
    _speedups(rows, rounds)
    return rows


def _timing(samples: list[tuple[float, float]]) -> Timing:
    """The :class:`Timing` of one callable's ``(ms, host ms)`` rounds, as :meth:`Timer.many` gives it."""
    times = [t for t, _ in samples]
    return Timing(statistics.median(times), statistics.median(h for _, h in samples), max(times) - min(times))


def run_cases(
    selected: list[Case], device: str | torch.device = "cpu", reps: int = 50,
    designs: dict[str, object] | None = None, graphs: bool = False, dtypes: Iterable[torch.dtype] = (torch.float32,),
) -> list[dict]:
    """Time every case on ``device``; rows carry the device name, the torch version and the timing mode."""
    dev = torch.device(device)
    timer = Timer(dev, reps, budget_s=0.25, graphs=graphs)
    name = devices.get(dev.type).describe(dev)  # the machine: GPU, or CPU model, threads and kernel set
    rows: list[dict] = []
    for case in selected:
        print(f"case {case}", flush=True)
        with heartbeat(f"case {case}"):
            case_rows = run_case(case, dev, timer, designs, tuple(dtypes))
        for row in case_rows:
            row.update(device=name, torch=torch.__version__, timing=timer.mode)
            rows.append(row)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _host_bound(row: dict, stage: str) -> str:
    """A marker for a stage whose host time exceeds its device time: it would run at the host's pace."""
    host = row.get(f"{stage}_host_ms", math.nan)
    return f" (host-bound: {host:.4f} ms on the host)" if host > row[f"{stage}_ms"] else ""


def _cell(value: float, width: int, digits: int) -> str:
    """A table cell: the number, or '-' where the method has no such time on this device (not run, no floor)."""
    return f"{value:{width}.{digits}f}" if math.isfinite(value) else f"{'-':>{width}}"


def _times(value: float) -> str:
    return f"{value:.2f}x" if math.isfinite(value) else "-"


def _ratio(speedup: dict, stage: str) -> str:
    """A speedup with the interquartile range of its rounds' ratios, and whether that range holds 1 or is too wide.

    Example:
        >>> _ratio({"bwd": 1.1, "bwd_iqr": [0.7, 1.6], "inconclusive": ["bwd"], "noisy": ["bwd"]}, "bwd")
        '1.10x (IQR 0.70-1.60, inconclusive, too noisy)'
    """
    value, iqr = speedup[stage], speedup.get(f"{stage}_iqr")
    if not math.isfinite(value) or iqr is None:
        return _times(value)
    verdict = ", inconclusive" if stage in speedup["inconclusive"] else ""
    verdict += ", too noisy" if stage in speedup.get("noisy", ()) else ""
    return f"{_times(value)} (IQR {iqr[0]:.2f}-{iqr[1]:.2f}{verdict})"


def noise_verdict(rows: list[dict]) -> str | None:
    """One line for a run in which some ratios could not be read (:func:`paired_ratio`'s verdicts), saying how
    many and what to do; None when every ratio with a range is clear.

    Example:
        >>> clear = {"speedup": {"dense_fp32": {"fwd_iqr": [2, 3], "bwd_iqr": [2, 3], "inconclusive": [],
        ...                                     "noisy": []}}}
        >>> noise_verdict([clear]) is None
        True
        >>> noisy = {"speedup": {"dense_fp32": {"fwd_iqr": [2, 3], "bwd_iqr": [0.5, 2], "inconclusive": ["bwd"],
        ...                                     "noisy": ["bwd"]}}}
        >>> print(noise_verdict([clear, noisy]))  # doctest: +ELLIPSIS
        1 of 4 ratios could not be read (...): the machine was too noisy to conclude ...
    """
    total, unclear = 0, 0
    for row in rows:
        for entry in row.get("speedup", {}).values():
            for stage in ("fwd", "bwd"):
                if entry.get(f"{stage}_iqr") is None:
                    continue
                total += 1
                unclear += stage in entry["inconclusive"] or stage in entry.get("noisy", ())
    if not unclear:
        return None
    return (f"{unclear} of {total} ratios could not be read (their interquartile range holds 1 or spans more than "
            f"{NOISY_SPREAD:g}x): the machine was too noisy to conclude on those; run again with more --reps when "
            "it is quieter (other jobs, or OpenMP threads spinning: docs/training.md)")


def print_table(rows: list[dict], device: torch.device) -> None:
    """One line per (case, dtype, method): times and roofline gaps; then per dtype our times (best backward
    strategy) and their ratios to torch.sparse fp32, dense fp32 (and TF32) and dense in that dtype, same run, each
    the median of its rounds' ratios with their interquartile range, "inconclusive" where that range holds 1 and
    "too noisy" where it is too wide to read; then, if any ratio was unclear, a line saying the machine was too
    noisy to conclude on it (:func:`noise_verdict`). Where no peak rates are known (the CPU, unlisted GPUs) the
    roofline columns are left out; a stage a method did not run shows '-'."""
    peaks = _peaks(device)
    if peaks:
        print(f"roofline peaks: {peaks[2]}")
    if device.type == "cuda":
        print("dense_fp32 runs without TF32 (CUDA cores); dense_tf32, dense_bf16 and dense_fp16 use tensor cores")
    keys = sorted(
        {(r["in_features"], r["out_features"], r["density"], r["batch"]) for r in rows},
        key=lambda k: (k[0], k[2], k[3]),
    )
    print("ratios: baseline ms / ours ms (above 1: ours is faster), the median of the per-round ratios with their "
          "interquartile range (IQR); inconclusive: the range holds 1, ours may be faster or slower; too noisy: the "
          f"range spans more than {NOISY_SPREAD:g}x")
    floors = f"  {'fwd/floor':>9} {'bwd/floor':>9}" if peaks else ""
    print(f"{'case':>28} {'dtype':>9} {'method':>20} {'fwd ms':>9} {'bwd ms':>9}{floors}  {'host fwd':>8} "
          f"{'host bwd':>8}")
    for key in keys:
        group = [r for r in rows if (r["in_features"], r["out_features"], r["density"], r["batch"]) == key]
        case = Case(key[0], key[1], key[2], key[3])
        label = f"{key[0]}x{key[1]} d={key[2]:g} B={key[3]}"
        for r in group:
            gaps = ""
            if peaks:
                f_floor, b_floor = floor_ms(case, r["nnz"], getattr(torch, r["dtype"]).itemsize, peaks)
                gaps = f"  {_cell(r['fwd_ms'] / f_floor, 9, 1)} {_cell(r['bwd_ms'] / b_floor, 9, 1)}"
            print(f"{label:>28} {r['dtype']:>9} {r['method']:>20} {_cell(r['fwd_ms'], 9, 4)} "
                  f"{_cell(r['bwd_ms'], 9, 4)}{gaps}  {_cell(r['fwd_host_ms'], 8, 4)} {_cell(r['bwd_host_ms'], 8, 4)}")
        for dtype in dict.fromkeys(r["dtype"] for r in group):
            ours = [r for r in group if r["dtype"] == dtype and "speedup" in r]
            if not ours:
                continue
            best = min(ours, key=lambda r: r["bwd_ms"])
            ratios = [f"{dtype}: ours fwd {best['fwd_ms']:.4f} ms{_host_bound(best, 'fwd')}, "
                      f"bwd {best['bwd_ms']:.4f} ms{_host_bound(best, 'bwd')} (best bwd={best['method']})"]
            ratios += [f"vs {base}: fwd {_ratio(v, 'fwd')} bwd {_ratio(v, 'bwd')}"
                       for base, v in best["speedup"].items()]
            print(f"{'':>28} " + "; ".join(ratios))
    verdict = noise_verdict(rows)
    if verdict is not None:
        print(verdict)


def plot_series(rows: list[dict], stage: str) -> dict[str, list[dict]]:
    """The lines of a plot of ``stage`` (``"fwd"`` or ``"bwd"``): label -> rows with a time for it, in the order
    of the rows (the table's order). Our forward is one line (every backward strategy's row carries the same
    forward), as is each design's; a dtype other than float32 is named in the label.

    Example:
        >>> rows = [{"method": m, "dtype": "float32", "fwd_ms": 1.0} for m in ("fused_atomic", "atomic_free")]
        >>> list(plot_series(rows, "fwd")), list(plot_series(rows, "bwd"))
        (['ours'], [])
    """
    ours = {s.value for s in CONCRETE}
    series: dict[str, list[dict]] = {}
    seen = set()
    for row in rows:
        if not math.isfinite(row.get(f"{stage}_ms", math.nan)):
            continue
        method, dtype = row["method"], row.get("dtype", "float32")
        strategy, _, design = method.partition("/")
        if stage == "fwd" and strategy in ours:  # the forward does not depend on the backward strategy
            method = design or "ours"
        label = method if dtype == "float32" or method.startswith("dense_") else f"{method} ({dtype})"
        case = (row.get("in_features"), row.get("out_features"), row.get("density"), row.get("batch"))
        if (label, case) not in seen:
            seen.add((label, case))
            series.setdefault(label, []).append(row)
    return series


#: Line styles of a plot's series, in turn: every series differs from the others in marker or line style, so
#: that lines on top of each other stay distinguishable.
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")
LINESTYLES = ("-", "--", "-.", ":")
#: The benchmark plots' one colour map (matplotlib's tab20, dark shades first): series take its colours in the
#: order of the table, so a series has the same colour in every panel of a figure.
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7",
          "#dbdb8d", "#9edae5")


def series_colors(keys: Iterable[object]) -> dict[object, str]:
    """A colour of :data:`COLORS` for each distinct key, in order (cycling past 20).

    Example:
        >>> series_colors(["ours", "dense_fp32", "ours"])
        {'ours': '#1f77b4', 'dense_fp32': '#ff7f0e'}
    """
    return {key: COLORS[i % len(COLORS)] for i, key in enumerate(dict.fromkeys(keys))}


#: Axes a group can sweep, with how a plot labels them.
SWEEP_AXES = {"density": "density", "batch": "batch", "in_features": "features (in)"}


def _sweep_axis(rows: list[dict]) -> str | None:
    """The one case field that varies across ``rows`` with the others fixed (``density`` for ``seed``), else
    None (a group of unrelated cases: plotted one case beside the next)."""
    fields = ("in_features", "out_features", "density", "batch")
    varying = [f for f in fields if len({r[f] for r in rows}) > 1]
    return varying[0] if len(varying) == 1 and varying[0] in SWEEP_AXES else None


def _fixed(row: dict, axis: str) -> str:
    """The case fields a sweep holds fixed, in words."""
    parts = [f"{row['in_features']}x{row['out_features']}"] if axis != "in_features" else []
    parts += [f"density {row['density']:g}"] * (axis != "density") + [f"batch {row['batch']}"] * (axis != "batch")
    return ", ".join(parts)


def _case_label(row: dict) -> str:
    return f"{row['in_features']}x{row['out_features']}\nd={row['density']:g} B={row['batch']}"


def plot(rows: list[dict], out: Path, stem: str) -> list[Path]:
    """PNG plots, one per case group (``<stem>_<group>.png``): forward and backward ms per method, log scale,
    against the group's swept axis (density, batch) or case by case. Returns the files written; none without
    matplotlib (it says so)."""
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no plots (pip install 'torch_sparse_metal[train]')")
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for group in dict.fromkeys(r.get("group", "custom") for r in rows):
        sel = [r for r in rows if r.get("group", "custom") == group]
        axis = _sweep_axis(sel)
        labels = list(dict.fromkeys(map(_case_label, sel)))
        styles = series_colors([*plot_series(sel, "fwd"), *plot_series(sel, "bwd")])  # one colour per series
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax, stage, title in ((axes[0], "fwd", "forward"), (axes[1], "bwd", "backward")):
            for label, mine in plot_series(sel, stage).items():
                i = list(styles).index(label)
                xs = [r[axis] for r in mine] if axis else [labels.index(_case_label(r)) for r in mine]
                pts = sorted(zip(xs, (r[f"{stage}_ms"] for r in mine)))
                ax.plot([p[0] for p in pts], [p[1] for p in pts], label=label, marker=MARKERS[i % len(MARKERS)],
                        linestyle=LINESTYLES[i % len(LINESTYLES)], color=styles[label], markerfacecolor="none",
                        alpha=0.85)
            if axis:
                ax.set_xscale("log")
                ax.set_xlabel(f"{SWEEP_AXES[axis]} ({_fixed(sel[0], axis)})")
            else:
                ax.set_xticks(range(len(labels)), labels, fontsize=7)
                ax.set_xlabel(f"case ({group})")
            ax.set_yscale("log")
            ax.set_ylabel("ms (median)")
            ax.set_title(f"{title}, {sel[0].get('device', '')}")
            ax.grid(True, which="both", alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7)
        fig.tight_layout()
        path = out / f"{stem}_{group}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _dtype_names() -> list[str]:
    return [str(d).removeprefix("torch.") for d in DTYPES]


def _dtypes(text: str) -> tuple[torch.dtype, ...]:
    """``--dtypes``: comma-separated names of the contract's dtypes (``float32,bfloat16``)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in _dtype_names()]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown dtype(s) {unknown}: choose from {', '.join(_dtype_names())}")
    return tuple(dict.fromkeys(getattr(torch, n) for n in names))


def _file_stem(text: str) -> str:
    """``--name``: a file stem, written inside ``--out`` (no folders)."""
    if not text or Path(text).name != text or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"expected a file name without folders, got {text!r}")
    return text


def _device_name(text: str) -> str:
    """``--device``: a device of this machine (:func:`torch_sparse_metal_tools.cli.device_type`), kept as its name (the
    commands built on this parser compare it with names)."""
    return str(device_type()(text))


def build_parser(prog: str = "python -m torch_sparse_metal_tools.bench") -> argparse.ArgumentParser:
    """The command line; every value is checked as it is parsed (a usage error, exit status 2).

    Example:
        >>> build_parser().parse_args(["--device", "cpu", "--cases", "cpu", "--reps", "5"]).cases
        ['cpu']
    """
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", type=_device_name, default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu, cuda, cuda:N or mps: a device of this machine (default: cuda where there is one)")
    parser.add_argument(
        "--cases", nargs="+", default=None, choices=CASE_GROUPS, metavar="GROUP",
        help=f"case groups: {', '.join(CASE_GROUPS)} (default: cpu on the CPU, else seed design density batch)",
    )
    parser.add_argument("--out", type=Path, default=None,
                        help="folder of the JSON and PNGs (default: a new folder bench-<name>-<date>-<time> in the "
                             "current directory)")
    parser.add_argument("--overwrite", action="store_true", help="replace files of an earlier run in --out")
    parser.add_argument("--reps", type=positive_int, default=50, help="repetitions per method, at most (default 50)")
    parser.add_argument("--name", type=_file_stem, default=None,
                        help="file stem of the JSON and PNGs (default: device kind)")
    parser.add_argument("--dtypes", default="float32", type=_dtypes,
                        help=f"comma-separated value dtypes ({', '.join(_dtype_names())}; default float32); the "
                        "float32 baselines are timed whatever this says")
    parser.add_argument("--graphs", action="store_true",
                        help="CUDA: time CUDA-graph replays (device time without launch gaps; torch.sparse eager)")
    return parser


def _outputs(parser: argparse.ArgumentParser, args: argparse.Namespace, device: torch.device,
             selected: list[Case]) -> tuple[Path, list[Path]]:
    """The output folder and the files the run will write there, checked before any timing: the folder can be
    written, and no file of an earlier run is replaced without --overwrite."""
    stem = args.name or ("h200" if device.type == "cuda" and "H200" in torch.cuda.get_device_name(device)
                         else device.type)
    out = args.out if args.out is not None else Path(f"bench-{stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    described = f"--out {out}" if args.out is not None else f"the default output folder {out} (give --out)"
    files = [out / f"{stem}.json"]
    if importlib.util.find_spec("matplotlib") is not None:
        files += [out / f"{stem}_{group}.png" for group in dict.fromkeys(c.group for c in selected)]
    existing = [f.name for f in files if f.exists()]
    if existing and not args.overwrite:
        parser.error(f"{described} already holds {', '.join(existing)}: give another --out or --name, or pass "
                     "--overwrite to replace them")
    check_writable(parser, out, described)  # made again when the results are written
    return out, files


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark. Bad arguments, an unavailable device and an output folder holding an earlier run's
    files are usage errors (exit status 2), found before any timing."""
    parser = build_parser()
    run(parser, parser.parse_args(argv))


def run(parser: argparse.ArgumentParser, args: argparse.Namespace,
        designs: Callable[[], dict[str, object]] | None = None) -> list[dict]:
    """The benchmark of parsed ``args``: checks (usage errors through ``parser``), timing, table, JSON and plots;
    returns the rows. ``designs()``, called after the checks, gives other implementations to time beside ours
    (:func:`run_case`)."""
    warnings.filterwarnings("ignore", message=".*[Ss]parse")  # torch.sparse's beta and invariant-check notices
    device = torch.device(args.device)
    if args.graphs and device.type != "cuda":
        parser.error(f"--graphs: CUDA graphs replay CUDA work; this run is on {device.type} (leave --graphs out)")
    missing = [str(d).removeprefix("torch.") for d in args.dtypes if d not in supported_dtypes(device.type)]
    if missing:
        there = ", ".join(str(d).removeprefix("torch.") for d in supported_dtypes(device.type))
        parser.error(f"--dtypes {','.join(missing)}: no csr_linear kernels for it on {device.type}; there: {there}")
    groups = args.cases or (["cpu"] if device.type == "cpu" else ["seed", "design", "density", "batch"])
    selected = cases(groups)
    out, files = _outputs(parser, args, device, selected)
    print_openmp_note(device)
    rows = run_cases(selected, device, args.reps, designs() if designs else None, args.graphs, args.dtypes)
    print_table(rows, device)
    out.mkdir(parents=True, exist_ok=True)
    files[0].write_text(json.dumps(rows, indent=1))
    for path in plot(rows, out, files[0].stem):
        print(f"wrote {path}")
    print(f"wrote {files[0]}")
    return rows


if __name__ == "__main__":
    wait_passively()
    main()
