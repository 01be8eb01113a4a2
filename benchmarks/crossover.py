"""Where sparsity pays: our sparse layer against dense bf16 (and torch's sparse formats) across densities.

For each layer shape and density it times, in one round-robin per case (every method interleaved in each
repetition, medians over the repetitions, CUDA-graph replays on CUDA), the forward, the backward and the step
(forward + backward) of one layer ``[batch, in] -> [batch, out]``:

- ours: ``torch.ops.torch_sparse_metal.csr_linear`` (SparseLinear's op, ``auto``) and ``csr_linear_backward`` with
  each concrete strategy, plus ``ours_best`` (the faster backward of the two, per case);
- dense ``F.linear`` and its two backward matmuls, in float32 without TF32, float32 with TF32 and bfloat16, on a
  fully random dense weight (no zeros: a dense layer has none, and zeros can run faster);
- torch.sparse CSR (``torch.sparse.mm``; ``sampled_addmm`` + ``mm`` backward, bench.torch_sparse_ops), in each dtype;
- torch's BSR with blocks of 16 and 32, the same density of blocks (``torch.sparse.mm`` of the BSR weight; its
  transpose for grad_x and a block ``sampled_addmm`` for grad_w), in each dtype;
- with ``--blocks V,...`` (V > 1, from ``contract.VECTOR_BLOCKS``): the vector layout's own ops
  (``csr_linear`` and ``csr_linear_backward`` per concrete strategy) on a random topology of vectors
  (V consecutive outputs share each input, the same density of weights), beside the dense baselines and torch's BSR;
  those rows carry ``block`` = V (BSR rows keep their own ``block``) and form their own group (``... block V``);
- torch's semi-structured 2:4 (``torch.sparse.to_sparse_semi_structured``) at its fixed 50%, one case per shape,
  timed beside the dense baselines only.

A method torch refuses (or that fails) gets a row with the reason in ``note`` and no times; one whose single call
takes longer than ``--cap-s`` (measured, or predicted from the previous density by the edge count) is not timed, and
its row says so. Rows follow ``torch_sparse_metal_tools.bench``'s format (``fwd_ms``, ``bwd_ms``, host times,
``device``, ``torch``, ``timing``) plus ``step_ms``, ``vs_dense_bf16`` (dense bf16 ms / this method's ms, same run:
above 1 is faster than dense bf16) and, on one density per shape, our relative errors against float64 (``rel_err``).
The printed table gives the crossover density against dense bf16 per shape: the density where the speedup over
dense bf16 falls through 1, interpolated linearly in the speedup between the two measured densities around it
on a log density axis ("< 0.5%" / "> 25%" when it lies outside the measured range).

    python benchmarks/crossover.py --device cuda --out benchmarks/results --name crossover_h200
    python benchmarks/crossover.py --device cpu --shape 64x32x8 --densities 0.05,0.25 --reps 3   # a small check
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from torch_sparse_metal.contract import VECTOR_BLOCKS, supported_dtypes
from torch_sparse_metal.strategy import CONCRETE
from torch_sparse_metal.timing import Timer, Timing, synchronize, wall_ms
from torch_sparse_metal.topology import CSRTopology
from torch_sparse_metal_tools import bench
from torch_sparse_metal_tools.argtypes import available_device, check_writable, positive_int

OPS = bench.OPS
DENSITIES = (0.005, 0.01, 0.02, 0.05, 0.1, 0.25)
BLOCKS = (16, 32)
STAGES = ("fwd", "bwd")


@dataclass(frozen=True)
class Shape:
    """A layer ``[batch, in] -> [batch, out]``, named as the rows' ``group``."""

    name: str
    in_features: int
    out_features: int
    batch: int


#: The README's training configuration (d_model 256, ffn 4x, batch 16 x 256 tokens): its four SparseLinear shapes.
TRAIN_TOKENS = 16 * 256
SHAPE_GROUPS: dict[str, tuple[Shape, ...]] = {  # the default order: the design sizes first
    "4096": (Shape("4096x4096 B1024", 4096, 4096, 1024),),
    "16384": (Shape("16384x16384 B4096", 16384, 16384, 4096),),
    "train": (Shape("train qkv 256x768", 256, 768, TRAIN_TOKENS),
              Shape("train proj 256x256", 256, 256, TRAIN_TOKENS),
              Shape("train fc 256x1024", 256, 1024, TRAIN_TOKENS),
              Shape("train out 1024x256", 1024, 256, TRAIN_TOKENS)),
}


def parse_shape(text: str) -> Shape:
    """``--shape INxOUTxBATCH`` (e.g. ``64x32x8``).

    Example:
        >>> parse_shape("64x32x8")
        Shape(name='64x32 B8', in_features=64, out_features=32, batch=8)
    """
    try:
        i, o, b = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected INxOUTxBATCH (e.g. 64x32x8), got {text!r}") from None
    if min(i, o, b) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return Shape(f"{i}x{o} B{b}", i, o, b)


def parse_densities(text: str) -> tuple[float, ...]:
    """``--densities``: comma-separated densities in (0, 1], sorted."""
    try:
        values = sorted({float(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or not all(0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"densities must lie in (0, 1], got {text!r}")
    return tuple(values)


def parse_blocks(text: str) -> tuple[int, ...]:
    """``--blocks 1,16,32``: block 1 (csr_linear) and vector blocks of the vector ops, in the given order."""
    values = parse_vectors(text)
    allowed = (1, *VECTOR_BLOCKS)
    if any(v not in allowed for v in values):
        raise argparse.ArgumentTypeError(f"blocks must be among {allowed}, got {text!r}")
    return values


def parse_vectors(text: str) -> tuple[int, ...]:
    """``--vectors 1,8,16``: distinct positive vector lengths, in the given order."""
    try:
        values = tuple(dict.fromkeys(int(v) for v in text.split(",") if v.strip()))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"vector lengths must be positive, got {text!r}")
    return values


# ------------------------------------------------------------------------------------------------ operands
def random_topology(in_features: int, out_features: int, density: float, device: torch.device,
                    seed: int) -> CSRTopology:
    """``round(density * in * out)`` distinct edges drawn uniformly, drawn on ``device`` (a permutation of all
    positions: fast on a GPU even for 268M positions, where the host's draw takes seconds)."""
    nnz = CSRTopology.random_edge_count(in_features, out_features, density)
    gen = torch.Generator(device).manual_seed(seed)
    flat = torch.randperm(in_features * out_features, generator=gen, device=device)[:nnz].sort().values
    return CSRTopology.from_edges(flat // out_features, flat % out_features, in_features, out_features, sort=False)


def vector_topology(in_features: int, out_features: int, density: float, vector: int, device: torch.device,
                    seed: int) -> CSRTopology:
    """A V x 1 vector pattern: ``round(density * in * out / V)`` distinct (input, group of V consecutive outputs)
    pairs drawn uniformly, each expanded to its V edges (V = 1: :func:`random_topology`)."""
    if vector == 1:
        return random_topology(in_features, out_features, density, device, seed)
    if out_features % vector:
        raise ValueError(f"out_features ({out_features}) is not a multiple of the vector length {vector}")
    groups = out_features // vector
    count = max(1, round(density * in_features * groups))
    gen = torch.Generator(device).manual_seed(seed)
    flat = torch.randperm(in_features * groups, generator=gen, device=device)[:count].sort().values
    src = (flat // groups).repeat_interleave(vector)
    dst = ((flat % groups) * vector).repeat_interleave(vector) + torch.arange(vector, device=device).repeat(count)
    return CSRTopology.from_edges(src, dst, in_features, out_features, sort=False)


def block_pattern(rows: int, cols: int, block: int, density: float, device: torch.device, seed: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A random block pattern of a ``[rows, cols]`` matrix: ``round(density * blocks)`` blocks (at least one),
    as (block row, block column) pairs sorted row-major."""
    br, bc = rows // block, cols // block
    count = max(1, round(density * br * bc))
    gen = torch.Generator(device).manual_seed(seed)
    flat = torch.randperm(br * bc, generator=gen, device=device)[:count].sort().values
    return flat // bc, flat % bc


def bsr_from_blocks(brow: torch.Tensor, bcol: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]
                    ) -> torch.Tensor:
    """A BSR tensor from blocks sorted row-major: ``values[k]`` is the block at ``(brow[k], bcol[k])``."""
    block = values.shape[-1]
    crow = torch.zeros(shape[0] // block + 1, dtype=torch.int64, device=values.device)
    crow[1:] = torch.bincount(brow, minlength=shape[0] // block).cumsum(0)
    return torch.sparse_bsr_tensor(crow, bcol, values, shape)


def bsr_pair(brow: torch.Tensor, bcol: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """The BSR matrix of these blocks and its transpose, also BSR (built from the blocks, never densely)."""
    block = values.shape[-1]
    order = torch.argsort(bcol * (shape[0] // block) + brow)  # row-major in the transpose
    transposed = bsr_from_blocks(bcol[order], brow[order], values[order].transpose(1, 2).contiguous(), shape[::-1])
    return bsr_from_blocks(brow, bcol, values, shape), transposed


# ------------------------------------------------------------------------------------------------ methods
@dataclass
class Method:
    """One method in one dtype: its forward and backward callables (None: refused, ``note`` says why)."""

    name: str
    dtype: torch.dtype
    fwd: Callable[[], object] | None
    bwd: Callable[[], object] | None
    note: str = ""
    eager: bool = False  # never captured in a graph (the note says why)
    sparse: bool = True  # its cost grows with the edge count (used to predict the next density's time)
    fwd_key: str = ""  # the name whose forward this method shares (ours: one forward, timed once)
    nnz: int = 0
    extra: dict = field(default_factory=dict)


def first_runnable(candidates: Iterable[tuple[str, Callable[[], object]]]) -> tuple[str, Callable[[], object] | None,
                                                                                   str]:
    """The first candidate that runs: ``(its label, it, refusals of those before)``; ``(label, None, reasons)``
    when none runs."""
    reasons = []
    for label, fn in candidates:
        why = bench.refusal(fn)
        if why is None:
            return label, fn, "; ".join(reasons)
        reasons.append(f"{label}: {why}")
    return "", None, "; ".join(reasons)


def with_tf32(fn: Callable[[], object], allow: bool) -> Callable[[], object]:
    """``fn`` run with TF32 matmuls allowed or not (read when a graph is captured, so replays keep it)."""

    def call() -> object:
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = allow
        try:
            return fn()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old

    return call


def dense_methods(shape: Shape, device: torch.device, dtypes: Iterable[torch.dtype]) -> list[Method]:
    """Dense ``F.linear`` forward and its backward matmuls on a random dense weight: fp32 (no TF32), TF32, and each
    other dtype (bf16 always: the baseline)."""
    g = torch.Generator(device).manual_seed(7)
    w = torch.randn(shape.out_features, shape.in_features, generator=g, device=device) * 0.05
    x = torch.randn(shape.batch, shape.in_features, generator=g, device=device)
    go = torch.randn(shape.batch, shape.out_features, generator=g, device=device)
    out = []
    for dtype in dict.fromkeys([torch.float32, torch.bfloat16, *dtypes]):
        wd, xd, gd = w.to(dtype), x.to(dtype), go.to(dtype)
        fwd = lambda wd=wd, xd=xd: F.linear(xd, wd)  # noqa: E731
        bwd = lambda wd=wd, xd=xd, gd=gd: (gd.t() @ xd, gd @ wd)  # noqa: E731
        if dtype == torch.float32:
            out.append(Method("dense_fp32", dtype, with_tf32(fwd, False), with_tf32(bwd, False), sparse=False))
            if device.type == "cuda":
                out.append(Method("dense_tf32", dtype, with_tf32(fwd, True), with_tf32(bwd, True), sparse=False))
        else:
            out.append(Method(f"dense_{bench.SHORT[dtype]}", dtype, fwd, bwd, sparse=False))
    return out


def our_methods(topo: CSRTopology, x: torch.Tensor, go: torch.Tensor, w: torch.Tensor) -> list[Method]:
    """Our forward (``auto``) and one backward per concrete strategy, in the tensors' dtype."""
    args = topo.kernel_args()
    fwd = lambda: OPS.csr_linear(x, w, *args, "auto")  # noqa: E731
    out = []
    for s in CONCRETE:
        bwd = lambda s=s.value: OPS.csr_linear_backward(go, x, w, *args, s)  # noqa: E731
        out.append(Method(s.value, x.dtype, fwd, bwd, nnz=topo.nnz, fwd_key="ours"))
    return out


def vector_methods(topo: CSRTopology, x: torch.Tensor, go: torch.Tensor, w: torch.Tensor) -> list[Method]:
    """The vector ops on ``topo`` (a topology over vectors, ``w`` [vectors, V]): the forward (``auto``) and one
    backward per concrete strategy, named as ours (rows of a block case: ``block`` says which layout)."""
    args = topo.kernel_args()
    fwd = lambda: OPS.csr_linear(x, w, *args, "auto")  # noqa: E731
    out = []
    for s in CONCRETE:
        bwd = lambda s=s.value: OPS.csr_linear_backward(go, x, w, *args, s)  # noqa: E731
        out.append(Method(s.value, x.dtype, fwd, bwd, nnz=w.numel(), fwd_key="ours"))
    return out


def csr_method(topo: CSRTopology, x: torch.Tensor, go: torch.Tensor, w: torch.Tensor) -> Method:
    """torch.sparse CSR (bench.torch_sparse_ops, unprobed: the round-robin probes and judges each stage); eager,
    as in the benchmark: cuSPARSE allocates inside its calls."""
    fwd, bwd, note = bench.torch_sparse_ops(topo, w, x, go, probe=False)
    return Method("torch_sparse", x.dtype, fwd, bwd, note=note, eager=True, nnz=topo.nnz)


def bsr_method(shape: Shape, density: float, block: int, dtype: torch.dtype, x: torch.Tensor, go: torch.Tensor,
               device: torch.device) -> Method:
    """torch's BSR with ``block``-square blocks at the same density of blocks: forward ``W @ x^T``, backward
    ``W^T @ go^T`` (grad_x) and the block ``sampled_addmm`` (grad_w); transposed operands prepared outside timing,
    as for CSR. Refused (reason in the note) where the shape is not a multiple of the block or torch lacks a stage."""
    name = f"bsr{block}"
    if shape.in_features % block or shape.out_features % block:
        return Method(name, dtype, None, None, note=f"{shape.out_features}x{shape.in_features} is not a multiple "
                      f"of {block}x{block} blocks")
    brow, bcol = block_pattern(shape.out_features, shape.in_features, block, density, device, seed=11)
    g = torch.Generator(device).manual_seed(13)
    values = (torch.randn(brow.numel(), block, block, generator=g, device=device) * 0.05).to(dtype)
    oshape = (shape.out_features, shape.in_features)
    w, wt = bsr_pair(brow, bcol, values, oshape)
    xt, got = x.t().contiguous(), go.t().contiguous()
    extra = {"block": block, "actual_density": brow.numel() * block * block / (oshape[0] * oshape[1])}
    nnz = brow.numel() * block * block
    triton = importlib.util.find_spec("triton") is not None and device.type == "cuda"
    fwd_candidates = [("torch.sparse.mm", lambda: torch.sparse.mm(w, xt))]
    gx_candidates = [("torch.sparse.mm", lambda: torch.sparse.mm(wt, got))]
    gw_candidates = [("torch.sparse.sampled_addmm", lambda: torch.sparse.sampled_addmm(w, got, x, beta=0.0))]
    if triton:
        from torch.sparse import _triton_ops as tops
        fwd_candidates.append(("triton bsr_dense_mm", lambda: tops.bsr_dense_mm(w, xt)))
        gx_candidates.append(("triton bsr_dense_mm", lambda: tops.bsr_dense_mm(wt, got)))
        gw_candidates.append(("triton sampled_addmm", lambda: tops.sampled_addmm(w, got, x, beta=0.0)))
    f_label, fwd, f_why = first_runnable(fwd_candidates)
    x_label, grad_x, x_why = first_runnable(gx_candidates)
    w_label, grad_w, w_why = first_runnable(gw_candidates)
    notes = [f"forward: {f_label}" if fwd else f"no forward ({f_why})"]
    if grad_x and grad_w:
        bwd = lambda: (grad_w(), grad_x())  # noqa: E731
        notes.append(f"backward: {w_label} (grad_w) + {x_label} (grad_x)")
    else:
        bwd = None
        missing = [why for fn, why in ((grad_x, x_why), (grad_w, w_why)) if fn is None]
        notes.append(f"no backward ({'; '.join(missing)})")
    return Method(name, dtype, fwd, bwd, note="; ".join(notes), nnz=nnz, extra=extra)


def semi_structured_method(shape: Shape, dtype: torch.dtype, x: torch.Tensor, go: torch.Tensor,
                           device: torch.device) -> Method:
    """torch's 2:4 semi-structured weight (two of every four consecutive inputs of an output kept, 50%): forward
    ``F.linear(x, W)``; backward ``go @ W`` where torch runs it (grad_w of a 2:4 weight has no sparse kernel in
    torch). Refused, with torch's reason, where torch cannot build it (a CPU, a dtype, a shape)."""
    name = "semi_structured_2:4"
    g = torch.Generator(device).manual_seed(17)
    w = torch.randn(shape.out_features, shape.in_features, generator=g, device=device) * 0.05
    keep = torch.rand(shape.out_features, shape.in_features // 4, 4, generator=g, device=device).argsort(-1)[..., :2]
    mask = torch.zeros(shape.out_features, shape.in_features // 4, 4, dtype=torch.bool, device=device)
    mask.scatter_(-1, keep, True)
    w = (w * mask.reshape(shape.out_features, -1)).to(dtype) if shape.in_features % 4 == 0 else w.to(dtype)
    try:
        from torch.sparse import SparseSemiStructuredTensor, to_sparse_semi_structured
        try:
            ws = to_sparse_semi_structured(w)
            kind = type(ws).__name__
        except Exception:  # noqa: BLE001 - the default backend (cuSPARSELt) refused: CUTLASS's may not
            SparseSemiStructuredTensor._FORCE_CUTLASS = True
            try:
                ws = to_sparse_semi_structured(w)
            finally:
                SparseSemiStructuredTensor._FORCE_CUTLASS = False
            kind = type(ws).__name__ + " (forced: the default backend refused)"
    except Exception as exc:  # noqa: BLE001 - any refusal is a row
        return Method(name, dtype, None, None, note=f"to_sparse_semi_structured: {bench.first_line(exc)}",
                      nnz=w.numel() // 2)
    got = go.t().contiguous()
    f_label, fwd, f_why = first_runnable([("F.linear", lambda: F.linear(x, ws))])
    b_label, bwd, b_why = first_runnable([("go @ W", lambda: go @ ws), ("(W^T @ go^T)^T", lambda: ws.t() @ got)])
    note = [kind, f"forward: {f_label}" if fwd else f"no forward ({f_why})",
            f"backward: {b_label} (grad_x only: torch has no 2:4 grad_w)" if bwd else f"no backward ({b_why})"]
    return Method(name, dtype, fwd, bwd, note="; ".join(note), nnz=w.numel() // 2)


# ------------------------------------------------------------------------------------------------ timing
@dataclass
class Prepared:
    """A timed callable and how it is timed, or why it is not (``fn`` None)."""

    fn: Callable[[], object] | None
    timing: str
    note: str = ""
    seconds: float = math.nan  # one call, measured or predicted, where it was not timed for taking too long


def prepare(fn: Callable[[], object], device: torch.device, eager: bool, cap_s: float,
            predicted_s: float | None, predicted_from: str) -> Prepared:
    """Probe one callable (a refusal is a note), skip it when one call would take over ``cap_s`` (predicted, or
    measured on a second call, the first paying compilation), and capture it in a CUDA graph unless ``eager`` (a
    capture torch refuses falls back to eager, queued timing, and the note says why)."""
    base = "synchronised wall" if device.type != "cuda" else "events, host ahead"
    if predicted_s is not None and predicted_s > cap_s:
        return Prepared(None, base, f"not timed: predicted {predicted_s:.2f} s a call ({predicted_from}), over "
                                    f"--cap-s {cap_s:g}", predicted_s)
    try:
        took = wall_ms(fn, device) / 1e3
        if took > cap_s:
            took = wall_ms(fn, device) / 1e3
    except Exception as exc:  # noqa: BLE001 - any refusal is a row
        return Prepared(None, base, f"refused: {bench.first_line(exc)}")
    if took > cap_s:
        return Prepared(None, base, f"not timed: one call took {took:.2f} s, over --cap-s {cap_s:g}", took)
    if device.type != "cuda":
        return Prepared(fn, base)
    if eager:
        return Prepared(fn, base + " (eager: not captured)")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        synchronize(device)
        return Prepared(graph.replay, "graph replay")
    except Exception as exc:  # noqa: BLE001 - an op torch cannot capture is timed eagerly
        synchronize(device)
        return Prepared(fn, base, f"graph capture refused ({bench.first_line(exc)}): timed eagerly")


@dataclass
class Case:
    shape: Shape
    density: float
    structured: bool = False  # the 2:4 case: the structured method beside the dense baselines only
    vector: int = 1  # our topology's vector length V (V consecutive outputs share each input; 1: unstructured)
    block: int = 1  # the vector ops' block V (1: csr_linear)

    @property
    def group(self) -> str:
        """The rows' group: the shape's name, and the vector length or block when there is one."""
        return (self.shape.name + (f" V{self.vector}" if self.vector > 1 else "")
                + (f" block{self.block}" if self.block > 1 else ""))


def case_topology(case: Case, device: torch.device) -> CSRTopology | None:
    """Our topology of a case (None for the 2:4 case, which has none)."""
    if case.structured:
        return None
    if case.block > 1:  # a topology over vectors: in_features -> groups
        if case.shape.out_features % case.block:
            raise ValueError(f"out_features ({case.shape.out_features}) is not a multiple of the block {case.block}")
        return random_topology(case.shape.in_features, case.shape.out_features // case.block, case.density, device,
                               seed=1)
    return vector_topology(case.shape.in_features, case.shape.out_features, case.density, case.vector, device, seed=1)


def build_methods(case: Case, device: torch.device, dtypes: tuple[torch.dtype, ...],
                  topo: CSRTopology | None) -> list[Method]:
    """Every method of a case, each dtype, ours on ``topo`` (:func:`case_topology`'s); a builder that fails gives a
    refused method, not a crash."""
    shape = case.shape
    methods = dense_methods(shape, device, dtypes)

    def guarded(name: str, dtype: torch.dtype, build: Callable[[], list[Method] | Method]) -> list[Method]:
        try:
            got = build()
        except Exception as exc:  # noqa: BLE001 - any refusal is a row
            return [Method(name, dtype, None, None, note=f"refused: {bench.first_line(exc)}")]
        return got if isinstance(got, list) else [got]

    g = torch.Generator(device).manual_seed(3)
    x = torch.randn(shape.batch, shape.in_features, generator=g, device=device)
    go = torch.randn(shape.batch, shape.out_features, generator=g, device=device)
    if case.structured:
        for d in dtypes:
            methods += guarded("semi_structured_2:4", d,
                               lambda d=d: semi_structured_method(shape, d, x.to(d), go.to(d), device))
        return methods
    if case.block > 1:
        w = torch.randn(topo.nnz, case.block, generator=g, device=device) * 0.05
        for d in dtypes:
            xd, gd, wd = x.to(d), go.to(d), w.to(d)
            if d in supported_dtypes(device.type):
                methods += guarded("fused_atomic", d, lambda xd=xd, gd=gd, wd=wd: vector_methods(topo, xd, gd, wd))
            for b in BLOCKS:
                methods += guarded(f"bsr{b}", d,
                                   lambda b=b, d=d, xd=xd, gd=gd: bsr_method(shape, case.density, b, d, xd, gd,
                                                                             device))
        return methods
    w = torch.randn(topo.nnz, generator=g, device=device) * 0.05
    ours = supported_dtypes(device.type)
    for d in dtypes:
        xd, gd, wd = x.to(d), go.to(d), w.to(d)
        if d in ours:
            methods += guarded("fused_atomic", d, lambda xd=xd, gd=gd, wd=wd: our_methods(topo, xd, gd, wd))
        methods += guarded("torch_sparse", d, lambda xd=xd, gd=gd, wd=wd: csr_method(topo, xd, gd, wd))
        for b in BLOCKS if case.vector == 1 else ():  # BSR's pattern does not depend on ours: timed once
            methods += guarded(f"bsr{b}", d,
                               lambda b=b, d=d, xd=xd, gd=gd: bsr_method(shape, case.density, b, d, xd, gd, device))
    return methods


def relative_errors(topo: CSRTopology, x: torch.Tensor, go: torch.Tensor, w: torch.Tensor) -> dict[str, dict]:
    """Per concrete strategy, ``||ours - ref|| / ||ref||`` of y, grad_x and grad_w against float64 dense math on
    the same (dtype-rounded) inputs, on the tensors' device; NaN outputs give NaN. A 2-D ``w`` [vectors, V] is the
    vector layout (``topo`` over vectors), checked through the vector ops."""
    x64, go64 = x.double(), go.double()
    v = w.shape[1] if w.dim() == 2 else 1
    dense = torch.zeros(topo.out_features * v, topo.in_features, dtype=torch.float64, device=x.device)
    src, dst = topo.src.long(), topo.dst.long()
    if v > 1:  # vector j feeds outputs dst[j]*V + l from src[j]
        dst = dst[:, None] * v + torch.arange(v, device=x.device)
        src = src[:, None].expand(-1, v)
    dense[dst, src] = w.double()
    ref = {"fwd": x64 @ dense.t(), "grad_x": go64 @ dense, "grad_w": (go64.t() @ x64)[dst, src]}
    del dense

    def err(out: torch.Tensor, key: str) -> float:
        return float(torch.linalg.vector_norm(out.double() - ref[key]) / torch.linalg.vector_norm(ref[key]))

    args = topo.kernel_args()
    forward, backward = OPS.csr_linear, OPS.csr_linear_backward
    fwd_err = err(forward(x, w, *args, "auto"), "fwd")
    out = {}
    for s in CONCRETE:
        grad_x, grad_w = backward(go, x, w, *args, s.value)
        out[s.value] = {"fwd": fwd_err, "grad_x": err(grad_x, "grad_x"), "grad_w": err(grad_w, "grad_w")}
    return out


def run_case(case: Case, device: torch.device, dtypes: tuple[torch.dtype, ...], timer: Timer, cap_s: float,
             history: dict, check_errors: bool) -> list[dict]:
    """Time every method of one case in one round-robin; one row per method and dtype (refused ones too)."""
    topo = case_topology(case, device)
    methods = build_methods(case, device, dtypes, topo)

    def key(m: Method, stage: str) -> str:
        return f"{(m.fwd_key or m.name) if stage == 'fwd' else m.name}/{stage}@{m.dtype}"

    prepared: dict[str, Prepared] = {}
    for m in methods:
        for stage in STAGES:
            fn = getattr(m, stage)
            if fn is None or key(m, stage) in prepared:
                continue
            past = history.get((case.group, key(m, stage)))
            predicted, origin = None, ""
            if m.sparse and past and m.nnz:
                ms, nnz, density = past
                predicted, origin = ms * m.nnz / nnz / 1e3, f"{ms:.1f} ms at density {density:g}, scaled by edges"
            prepared[key(m, stage)] = prepare(fn, device, m.eager, cap_s, predicted, origin)
            if m.sparse and not math.isnan(prepared[key(m, stage)].seconds):
                history[(case.group, key(m, stage))] = (prepared[key(m, stage)].seconds * 1e3, m.nnz,
                                                             case.density)
    timed = {k: p.fn for k, p in prepared.items() if p.fn is not None}
    try:
        ms = timer.many(timed)
    except Exception as exc:  # noqa: BLE001 - one failing callable must not lose the others: each alone, then
        print(f"  the round-robin failed ({bench.first_line(exc)}): each callable timed alone", flush=True)
        ms = {}
        for k, fn in timed.items():
            try:
                ms.update(timer.many({k: fn}))
            except Exception as exc_k:  # noqa: BLE001
                prepared[k] = Prepared(None, prepared[k].timing, f"timing failed: {bench.first_line(exc_k)}")
    errors = {}
    if check_errors and not case.structured:
        g = torch.Generator(device).manual_seed(21)
        x = torch.randn(case.shape.batch, case.shape.in_features, generator=g, device=device)
        go = torch.randn(case.shape.batch, case.shape.out_features, generator=g, device=device)
        w = torch.randn(topo.nnz, *((case.block,) if case.block > 1 else ()), generator=g, device=device) * 0.05
        for d in dtypes:
            if d in supported_dtypes(device.type):
                try:
                    errors[d] = relative_errors(topo, x.to(d), go.to(d), w.to(d))
                except Exception as exc:  # noqa: BLE001 - a check that cannot run (memory) is said, not fatal
                    print(f"  error check in {d} not run: {bench.first_line(exc)}", flush=True)
    rows = []
    for m in methods:
        t = {s: ms.get(key(m, s)) if getattr(m, s) is not None else None for s in STAGES}
        p = {s: prepared.get(key(m, s)) if getattr(m, s) is not None else None for s in STAGES}
        notes = [m.note] + [f"{s}: {p[s].note}" for s in STAGES if p[s] is not None and p[s].note]
        modes = sorted({p[s].timing for s in STAGES if p[s] is not None and p[s].fn is not None})
        row = make_row(case, m, t, "; ".join(filter(None, notes)), ", ".join(modes) or "not timed")
        if m.dtype in errors and m.name in errors[m.dtype]:
            row["rel_err"] = errors[m.dtype][m.name]
        rows.append(row)
        for s in STAGES:
            if t[s] is not None and m.sparse:
                history[(case.group, key(m, s))] = (t[s].ms, m.nnz, case.density)
    rows += best_rows(rows)
    add_ratios(rows)
    return rows


def make_row(case: Case, m: Method, t: dict[str, Timing | None], note: str, timing: str) -> dict:
    """One row in the benchmark's format."""
    def get(stage: str, attr: str) -> float:
        return getattr(t[stage], attr) if t[stage] is not None else math.nan

    row = {
        "in_features": case.shape.in_features, "out_features": case.shape.out_features,
        "density": 0.5 if case.structured else case.density, "batch": case.shape.batch,
        "nnz": m.nnz if m.sparse else case.shape.in_features * case.shape.out_features,
        "group": case.group, "dtype": str(m.dtype).removeprefix("torch."), "method": m.name,
        **{f"{s}_{f}": get(s, a) for s in STAGES for f, a in (("ms", "ms"), ("host_ms", "host_ms"),
                                                             ("spread_ms", "spread_ms"))},
        "timing": timing,
        **({"vector": case.vector} if case.vector > 1 else {}),
        **({"block": case.block} if case.block > 1 else {}),
        **m.extra,
    }
    if case.structured:
        row["structured"] = True  # the 2:4 case: its rows stay out of the density sweep
    row["step_ms"] = row["fwd_ms"] + row["bwd_ms"]
    if note:
        row["note"] = note
    return row


def best_rows(rows: list[dict]) -> list[dict]:
    """Per dtype, ``ours_best``: our forward with the faster backward strategy of this case."""
    out = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        ours = [r for r in rows if r["dtype"] == dtype and r["method"] in {s.value for s in CONCRETE}
                and math.isfinite(r["bwd_ms"])]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["bwd_ms"])
        row = {**best, "method": "ours_best", "note": f"backward: {best['method']}"}
        row["step_ms"] = row["fwd_ms"] + row["bwd_ms"]
        out.append(row)
    return out


def add_ratios(rows: list[dict]) -> None:
    """``vs_dense_bf16``: dense bf16's ms over each row's ms, per stage, from the same round-robin."""
    base = next((r for r in rows if r["method"] == "dense_bf16"), None)
    for r in rows:
        r["vs_dense_bf16"] = {s: (base[f"{s}_ms"] / r[f"{s}_ms"]) if base and r[f"{s}_ms"] > 0 else math.nan
                              for s in ("fwd", "bwd", "step")}


# ------------------------------------------------------------------------------------------------ crossover
def crossover(points: Iterable[tuple[float, float]]) -> tuple[float | None, str]:
    """The density where a speedup over the baseline falls through 1: scanning up from the sparsest measured
    density, the first density where it is <= 1, interpolated linearly in the speedup against log(density)
    between it and the density below. ``(density, text)``; ``(None, "< 0.5%")`` when the sparsest already loses,
    ``(None, "> 25%")`` when none does, ``(None, "-")`` without finite points.

    Example:
        >>> density, text = crossover([(0.01, 1.5), (0.04, 0.5)])  # halfway: the geometric mean
        >>> round(density, 6), text
        (0.02, '2%')
        >>> crossover([(0.005, 0.9), (0.25, 0.1)])[1], crossover([(0.005, 3.0), (0.25, 1.1)])[1]
        ('< 0.5%', '> 25%')
    """
    pts = sorted((d, s) for d, s in points if math.isfinite(s) and s > 0)
    if not pts:
        return None, "-"
    for i, (d1, s1) in enumerate(pts):
        if s1 <= 1:
            if i == 0:
                return None, f"< {percent(d1)}"
            d0, s0 = pts[i - 1]
            t = (s0 - 1) / (s0 - s1)
            d = math.exp(math.log(d0) + t * (math.log(d1) - math.log(d0)))
            return d, percent(d)
    return None, f"> {percent(pts[-1][0])}"


def percent(density: float) -> str:
    """A density in percent, two significant digits (``0.5%``, ``1.7%``, ``25%``)."""
    return f"{100 * density:.2g}%"


#: The crossover table's columns: (header, method, dtype, stage), each against dense bf16.
CROSSOVER_COLUMNS = (
    ("ours bf16 fwd", "ours_best", "bfloat16", "fwd"),
    ("ours bf16 bwd", "ours_best", "bfloat16", "bwd"),
    ("ours bf16 step", "ours_best", "bfloat16", "step"),
    ("ours fp32 step", "ours_best", "float32", "step"),
    ("torch CSR bf16 step", "torch_sparse", "bfloat16", "step"),
    ("BSR-16 bf16 step", "bsr16", "bfloat16", "step"),
    ("BSR-32 bf16 step", "bsr32", "bfloat16", "step"),
)


def crossover_table(rows: list[dict]) -> list[str]:
    """Markdown lines: per shape, the crossover density against dense bf16 of each column's method and stage."""
    lines = ["| shape | " + " | ".join(c[0] for c in CROSSOVER_COLUMNS) + " |",
             "|---|" + "---|" * len(CROSSOVER_COLUMNS)]
    for group in dict.fromkeys(r["group"] for r in rows):
        cells = []
        for _, method, dtype, stage in CROSSOVER_COLUMNS:
            pts = [(r["density"], r["vs_dense_bf16"][stage]) for r in rows
                   if r["group"] == group and r["method"] == method and r["dtype"] == dtype]
            cells.append(crossover(pts)[1])
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    return lines


def series_order(rows: list[dict]) -> list[tuple[str, str]]:
    """The (method, dtype) pairs of the table and the plot, in one order: that of their first row, our per-strategy
    rows left out (``ours_best`` stands for them).

    Example:
        >>> series_order([{"method": m, "dtype": d} for m, d in (("ours_best", "bfloat16"), ("fused_atomic",
        ...               "bfloat16"), ("dense_fp32", "float32"), ("ours_best", "bfloat16"))])
        [('ours_best', 'bfloat16'), ('dense_fp32', 'float32')]
    """
    strategies = {s.value for s in CONCRETE}
    return [key for key in dict.fromkeys((r["method"], r["dtype"]) for r in rows) if key[0] not in strategies]


def speedup_table(rows: list[dict], stage: str = "step") -> list[str]:
    """Markdown lines: per shape and method, the speedup over dense bf16 at each density (same run), the methods in
    :func:`series_order` (the plot's order)."""
    densities = sorted({r["density"] for r in rows if not r.get("structured")})
    lines = [f"| shape | method | dtype | {' | '.join(percent(d) for d in densities)} | 2:4 (50%) |",
             "|---|---|---|" + "---|" * (len(densities) + 1)]
    order = series_order(rows)
    for group in dict.fromkeys(r["group"] for r in rows):
        sel = [r for r in rows if r["group"] == group]
        present = {(r["method"], r["dtype"]) for r in sel}
        for method, dtype in (key for key in order if key in present):
            by = {r["density"]: r["vs_dense_bf16"][stage] for r in sel if (r["method"], r["dtype"]) == (method, dtype)
                  and not r.get("structured")}
            structured = [r["vs_dense_bf16"][stage] for r in sel if r["method"] == method and r["dtype"] == dtype
                          and r.get("structured")]
            cells = [f"{by[d]:.2f}x" if math.isfinite(by.get(d, math.nan)) else "-" for d in densities]
            cells.append(f"{structured[0]:.2f}x" if structured and math.isfinite(structured[0]) else "-")
            if all(c == "-" for c in cells):
                continue
            lines.append(f"| {group} | {method} | {dtype} | " + " | ".join(cells) + " |")
    return lines


# ------------------------------------------------------------------------------------------------ plot, hardware
def plot(rows: list[dict], path: Path) -> bool:
    """Speedup over dense bf16 (same run) against density, log axes, per shape: forward (top) and step (bottom),
    the series in the table's order (:func:`series_order`) and colours (:func:`bench.series_colors`). False (and
    says so) without matplotlib."""
    if importlib.util.find_spec("matplotlib") is None:
        print("matplotlib is not installed: no plot")
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    groups = list(dict.fromkeys(r["group"] for r in rows))
    fig, axes = plt.subplots(2, len(groups), figsize=(3.6 * len(groups), 7.4), squeeze=False)
    series = series_order(rows)
    colors = bench.series_colors(series)
    handles = {}
    for col, group in enumerate(groups):
        for row_i, stage in enumerate(("fwd", "step")):
            ax = axes[row_i][col]
            for method, dtype in series:
                structured = method.startswith("semi_structured")  # its one case; the others' sweep only
                pts = sorted((r["density"], r["vs_dense_bf16"][stage]) for r in rows if r["group"] == group
                             and r["method"] == method and r["dtype"] == dtype
                             and bool(r.get("structured")) == structured
                             and math.isfinite(r["vs_dense_bf16"][stage]))
                if pts:
                    label = f"{method} ({bench.SHORT[getattr(torch, dtype)]})"
                    (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="*" if structured else "o",
                                      ms=9 if structured else 3, color=colors[(method, dtype)], label=label)
                    handles[label] = line
            ax.axhline(1.0, color="k", lw=0.8)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks(sorted({r["density"] for r in rows if r["group"] == group}))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: percent(v)))
            ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
            ax.grid(True, which="both", alpha=0.3)
            ax.set_title(f"{group}: {'forward' if stage == 'fwd' else 'forward + backward'}", fontsize=8)
            ax.set_xlabel("density")
            if col == 0:
                ax.set_ylabel("speedup over dense bf16 (same run)")
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(6, len(handles)), fontsize=7)
    fig.suptitle(f"{rows[0].get('device', '')}, torch {rows[0].get('torch', '')}, {rows[0].get('timing', '')}",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def hardware(device: torch.device) -> dict:
    """What the run ran on: GPU, driver, CUDA, torch, triton, and the clocks nvidia-smi reads now."""
    info = {"torch": torch.__version__, "device": device.type}
    if device.type != "cuda":
        return info
    info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda)
    if importlib.util.find_spec("triton") is not None:
        import triton
        info["triton"] = triton.__version__
    query = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,clocks.max.mem,power.draw,power.limit,temperature.gpu"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20, check=True).stdout.strip().splitlines()[0]
        info.update(zip(query.split(","), (v.strip() for v in out.split(","))))
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        info["nvidia-smi"] = f"not read: {exc}"
    return info


# ------------------------------------------------------------------------------------------------ command line
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python benchmarks/crossover.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", nargs="*", default=None, choices=tuple(SHAPE_GROUPS),
                        help="shape groups (default: all of them, unless --shape is given)")
    parser.add_argument("--shape", action="append", type=parse_shape, default=[], metavar="INxOUTxBATCH",
                        help="a further shape (repeatable)")
    parser.add_argument("--densities", type=parse_densities, default=DENSITIES,
                        help="comma-separated densities (default 0.005,0.01,0.02,0.05,0.1,0.25)")
    parser.add_argument("--dtypes", type=bench._dtypes, default=(torch.float32, torch.bfloat16),
                        help="comma-separated dtypes (default float32,bfloat16; dense bf16 is always timed)")
    parser.add_argument("--reps", type=positive_int, default=30, help="repetitions per case, at most (default 30)")
    parser.add_argument("--budget-s", type=float, default=0.2,
                        help="about this many seconds of timing per method and case (5 repetitions at least)")
    parser.add_argument("--cap-s", type=float, default=0.4,
                        help="a method whose one call takes (or is predicted to take) longer is not timed")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="stop starting cases after this many seconds (the rows so far are kept)")
    parser.add_argument("--error-density", type=float, default=0.01,
                        help="the density per shape (nearest measured) of the float64 error check")
    parser.add_argument("--vectors", type=parse_vectors, default=(1,),
                        help="comma-separated vector lengths V of our topology (V consecutive outputs share each "
                             "input; default 1: unstructured); each V > 1 is its own group of rows")
    parser.add_argument("--blocks", type=parse_blocks, default=(1,),
                        help="comma-separated layouts: 1 (csr_linear on the --vectors topologies) and vector blocks "
                             f"V in {VECTOR_BLOCKS} (the vector ops), each V > 1 its own group of rows (default 1)")
    parser.add_argument("--no-structured", action="store_true", help="leave out the 2:4 case of each shape")
    parser.add_argument("--out", type=Path, default=Path("."), help="output folder (default: here)")
    parser.add_argument("--name", default=None, help="file stem (default crossover_<device>)")
    parser.add_argument("--overwrite", action="store_true", help="replace files of an earlier run")
    parser.add_argument("--from-json", nargs="+", type=Path, default=None, metavar="JSON",
                        help="time nothing: the tables and plot of these runs' rows (a later file's case replaces "
                             "an earlier file's case of the same shape and density)")
    return parser


def merge_runs(paths: Iterable[Path]) -> list[dict]:
    """The rows of several runs' JSON files, case by case: a later file's case (shape, density, 2:4 or not)
    replaces an earlier file's; cases keep the order of their first appearance."""
    cases: dict[tuple, list[dict]] = {}
    for path in paths:
        fresh: dict[tuple, list[dict]] = {}
        for row in json.loads(Path(path).read_text()):
            row.setdefault("run", Path(path).stem)  # which run a merged row came from
            fresh.setdefault((row["group"], row["density"], bool(row.get("structured"))), []).append(row)
        cases.update(fresh)
    return [r for rows in cases.values() for r in rows]


def select_cases(shapes: list[Shape], densities: tuple[float, ...], structured: bool,
                 vectors: tuple[int, ...] = (1,), blocks: tuple[int, ...] = (1,)) -> list[Case]:
    """Each shape's sweep per vector length (block 1) and per vector block, then its 2:4 case; shapes in the given
    order."""
    cases = []
    for shape in shapes:
        for b in blocks:
            cases += ([Case(shape, d, vector=v) for v in vectors for d in densities] if b == 1
                      else [Case(shape, d, block=b) for d in densities])
        if structured:
            cases.append(Case(shape, 0.5, structured=True))
    return cases


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message=".*[Ss]parse")  # torch.sparse's beta and invariant-check notices
    warnings.filterwarnings("ignore", message=".*TF32")
    try:
        device = available_device(args.device)
    except argparse.ArgumentTypeError as exc:
        parser.error(f"--device {exc}")
    groups = args.shapes if args.shapes is not None else ([] if args.shape else list(SHAPE_GROUPS))
    shapes = [s for g in groups for s in SHAPE_GROUPS[g]] + args.shape
    if not shapes:
        parser.error("no shapes: give --shapes or --shape")
    dtypes = tuple(dict.fromkeys(args.dtypes))
    stem = args.name or f"crossover_{device.type}"
    files = {k: args.out / f"{stem}{suffix}" for k, suffix in (("json", ".json"), ("md", ".md"), ("png", ".png"))}
    existing = [p.name for p in files.values() if p.exists() and p.resolve() not in
                {q.resolve() for q in args.from_json or ()}]
    if existing and not args.overwrite:
        parser.error(f"--out {args.out} already holds {', '.join(existing)}: pass --overwrite or another --name")
    check_writable(parser, args.out, f"--out {args.out}")
    if args.from_json:
        rows = merge_runs(args.from_json)
        sources = [f"rows from: {', '.join(map(str, args.from_json))} (a later file's cases replace an earlier's)"]
        report(rows, [], sources, files, 0.0, argv)
        return rows

    hw_start = hardware(device)
    print("hardware:", json.dumps(hw_start), flush=True)
    timer = Timer(device, args.reps, budget_s=args.budget_s)
    cases = select_cases(shapes, args.densities, not args.no_structured, args.vectors, args.blocks)
    nearest = min(args.densities, key=lambda d: abs(math.log(d / args.error_density)))
    history: dict = {}
    rows: list[dict] = []
    failures: list[str] = []
    t0 = time.perf_counter()
    for case in cases:
        if args.deadline_s is not None and time.perf_counter() - t0 > args.deadline_s:
            print(f"deadline: {args.deadline_s:g} s passed, case {case.group} d={case.density:g} and later "
                  "not run", flush=True)
            break
        tc = time.perf_counter()
        check = not case.structured and case.density == nearest
        try:
            case_rows = run_case(case, device, dtypes, timer, args.cap_s, history, check)
        except Exception as exc:  # noqa: BLE001 - a case that fails (memory, say) is reported, the rest still run
            failures.append(f"{case.group} d={case.density:g}: {type(exc).__name__}: {bench.first_line(exc)}")
            print(f"case failed: {failures[-1]}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        extra = {"device": hw_start.get("gpu", device.type), "torch": torch.__version__}
        if device.type == "cuda":
            extra["cuda"] = torch.version.cuda
        for r in case_rows:
            r.update(extra)
        rows += case_rows
        summary = {f"{r['method']}@{bench.SHORT[getattr(torch, r['dtype'])]}":
                   f"{r['vs_dense_bf16']['fwd']:.2f}/{r['vs_dense_bf16']['step']:.2f}"
                   for r in case_rows if r["method"] in ("ours_best", "semi_structured_2:4", "bsr32", "dense_tf32")}
        print(f"case {case.group} d={case.density:g}{' (2:4)' if case.structured else ''}: "
              f"{time.perf_counter() - tc:.1f} s; speedup over dense bf16 (fwd/step) {summary}", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        files["json"].write_text(json.dumps(rows, indent=1))  # kept as it grows: a run cut short keeps its rows
        if device.type == "cuda":
            torch.cuda.empty_cache()
    header = [f"hardware at start: {json.dumps(hw_start)}", f"hardware at end: {json.dumps(hardware(device))}"]
    report(rows, failures, header, files, time.perf_counter() - t0, argv)
    return rows


def report(rows: list[dict], failures: list[str], header: list[str], files: dict[str, Path], seconds: float,
           argv: list[str] | None) -> None:
    """The printed tables (also written as markdown beside the JSON) and the plot."""
    lines = [f"# Crossover against dense bf16 ({seconds:.0f} s)", "",
             "command: python benchmarks/crossover.py " + " ".join(sys.argv[1:] if argv is None else argv), "",
             *header, "",
             "## Crossover density against dense bf16 (ours: fwd = csr_linear auto, bwd = the faster strategy)", "",
             *crossover_table(rows), "", "## Step (forward + backward) speedup over dense bf16, same run", "",
             *speedup_table(rows, "step"), "", "## Forward speedup over dense bf16, same run", "",
             *speedup_table(rows, "fwd"), "", "## Refused or not timed", ""]
    lines += [f"- {r['group']} d={r['density']:g} {r['method']} {r['dtype']}: {r.get('note', '')}" for r in rows
              if not (math.isfinite(r["fwd_ms"]) and math.isfinite(r["bwd_ms"]))]
    lines += [f"- case failed: {f}" for f in failures]
    errs = [r for r in rows if "rel_err" in r and r["method"] != "ours_best"]
    lines += ["", "## Relative error of ours against float64", ""]
    lines += [f"- {r['group']} d={r['density']:g} {r['method']} {r['dtype']}: "
              + ", ".join(f"{k} {v:.2e}" for k, v in r["rel_err"].items()) for r in errs]
    text = "\n".join(lines) + "\n"
    print(text)
    files["md"].write_text(text)
    files["json"].write_text(json.dumps(rows, indent=1))
    if rows and plot(rows, files["png"]):
        print(f"wrote {files['png']}")
    print(f"wrote {files['json']} and {files['md']}")


if __name__ == "__main__":
    main()
