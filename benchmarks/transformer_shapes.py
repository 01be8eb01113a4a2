"""Sparse layers at the shapes transformers train: our ops against dense bf16 and fp16 (fp16 accumulation).

The shapes are the BERT-base/large layer table that Sputnik, CLASP and Spatha (VENOM) are compared on:
out x in in {768x768, 3072x768, 768x3072, 1024x1024, 4096x1024, 1024x4096} with n in {4096, 8192} tokens
(Castro et al., "VENOM: A Vectorized N:M Format for Unleashing the Power of Sparse Tensor Cores", SC 2023, Fig. 13;
its artifact's ``benchmark/run_spmm_spatha.sh`` and ``result/spmm_bert_spatha.csv``). For each shape, n, density
and layout (unstructured, vector V=16, V=32) it times, in one interleaved round-robin per (shape, n):

- ``fwd``: ``csr_linear`` (the layer's forward, ``auto``);
- ``bwd`` per concrete strategy (``csr_linear_backward``), and ``step`` = fwd + the faster backward;
- dense ``F.linear`` and its two backward matmuls in bfloat16, and in float16 with float16 accumulation
  (``torch.backends.cuda.matmul.allow_fp16_accumulation``: the baseline of the published table), on random dense
  weights.

On CUDA every callable is captured in a CUDA graph and its replays are timed (the median over the rounds, with the
interquartile range); ``vs_dense_bf16`` is dense bf16 ms / ours ms, its IQR from the per-round ratios (rounds paired).

With ``--profile-density`` (default 0.01) each of our stages at that density is also run once under
``torch.profiler``: every kernel it launches and its device time, split into the kernels that compute
(``main``) and whole passes over a tensor (transposes, fills, casts, copies: ``pass``). Each stage is set against
its byte bound: the fewest bytes it must move (activations read and written once, the weight values, indices and
pointers once) over the device's copy bandwidth measured in the same run; the table prints the achieved GB/s and
time / bound.

    python benchmarks/transformer_shapes.py --device cuda --out benchmarks/results --name transformer_shapes_h100
    python benchmarks/transformer_shapes.py --device mps --out . --name transformer_shapes_mps    # on a Mac
    python benchmarks/transformer_shapes.py --device cpu --shapes 96x64 --tokens 64 --densities 0.05 --reps 3
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from torch_sparse_metal.contract import VECTOR_BLOCKS
from torch_sparse_metal.strategy import CONCRETE
from torch_sparse_metal.timing import Timer, synchronize
from torch_sparse_metal.topology import CSRTopology

OPS = torch.ops.torch_sparse_metal
#: (out_features, in_features) of the published table, in its order.
SHAPES = ((768, 768), (3072, 768), (768, 3072), (1024, 1024), (4096, 1024), (1024, 4096))
TOKENS = (4096, 8192)
DENSITIES = (0.1, 0.05, 0.02, 0.01)
LAYOUTS = (1, 16, 32)  # 1: unstructured; V > 1: the vector layout with blocks of V outputs
#: Kernel names that mark a whole pass over a tensor rather than the sparse math.
PASS_MARKS = ("transpose", "fill", "copy", "cast", "elementwise", "zero", "convert", "reduce_kernel", "sum_splits")


@dataclass(frozen=True)
class Case:
    out_features: int
    in_features: int
    tokens: int
    density: float
    layout: int  # 1 or the vector block V

    @property
    def label(self) -> str:
        lay = "unstructured" if self.layout == 1 else f"V{self.layout}"
        return f"{self.out_features}x{self.in_features} n{self.tokens} d{self.density:g} {lay}"


def parse_shape(text: str) -> tuple[int, int]:
    """``OUTxIN`` (e.g. ``768x3072``: out_features 768, in_features 3072).

    Example:
        >>> parse_shape("768x3072")
        (768, 3072)
    """
    try:
        out, inp = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected OUTxIN (e.g. 768x3072), got {text!r}") from None
    if min(out, inp) < 1:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {text!r}")
    return out, inp


def topology(case: Case, device: torch.device, seed: int) -> CSRTopology:
    """A uniformly random topology of ``round(density * in * out / V)`` edges over ``out / V`` output groups (a
    vector layout's topology when V > 1), drawn on ``device``."""
    groups = case.out_features // case.layout
    count = max(1, round(case.density * case.in_features * groups))
    gen = torch.Generator(device).manual_seed(seed)
    flat = torch.randperm(case.in_features * groups, generator=gen, device=device)[:count].sort().values
    return CSRTopology.from_edges(flat // groups, flat % groups, case.in_features, groups, sort=False)


def dense_callables(out_f: int, in_f: int, tokens: int, device: torch.device
                    ) -> dict[str, Callable[[], object]]:
    """Dense forward and backward (both matmuls) in bf16, and in fp16 with fp16 accumulation on CUDA."""
    g = torch.Generator(device).manual_seed(7)
    w = torch.randn(out_f, in_f, generator=g, device=device) * 0.05
    x = torch.randn(tokens, in_f, generator=g, device=device)
    go = torch.randn(tokens, out_f, generator=g, device=device)
    fns: dict[str, Callable[[], object]] = {}
    for name, dtype, fp16_acc in (("dense_bf16", torch.bfloat16, False), ("dense_fp16acc", torch.float16, True)):
        if fp16_acc and not (device.type == "cuda" and hasattr(torch.backends.cuda.matmul, "allow_fp16_accumulation")):
            continue
        wd, xd, gd = w.to(dtype), x.to(dtype), go.to(dtype)
        fns[f"{name}/fwd"] = with_fp16_accumulation(lambda wd=wd, xd=xd: F.linear(xd, wd), fp16_acc)
        fns[f"{name}/bwd"] = with_fp16_accumulation(lambda wd=wd, xd=xd, gd=gd: (gd.t() @ xd, gd @ wd), fp16_acc)
    return fns


def with_fp16_accumulation(fn: Callable[[], object], allow: bool) -> Callable[[], object]:
    """``fn`` run with fp16-accumulating matmuls allowed or not (read when a graph is captured, so replays keep it)."""
    if not allow:
        return fn

    def call() -> object:
        flags = torch.backends.cuda.matmul
        old = flags.allow_fp16_accumulation
        flags.allow_fp16_accumulation = True
        try:
            return fn()
        finally:
            flags.allow_fp16_accumulation = old

    return call


def operands(case: Case, device: torch.device, seed: int) -> tuple[CSRTopology, torch.Tensor, torch.Tensor,
                                                                    torch.Tensor]:
    """``(topology, x, grad_out, weight)`` of a case in bf16: weight [E] (unstructured) or [E, V]."""
    topo = topology(case, device, seed)
    g = torch.Generator(device).manual_seed(seed + 1)
    shape = (topo.nnz,) if case.layout == 1 else (topo.nnz, case.layout)
    w = (torch.randn(shape, generator=g, device=device) * 0.05).to(torch.bfloat16)
    x = torch.randn(case.tokens, case.in_features, generator=g, device=device).to(torch.bfloat16)
    go = torch.randn(case.tokens, case.out_features, generator=g, device=device).to(torch.bfloat16)
    return topo, x, go, w


def sparse_callables(topo: CSRTopology, x: torch.Tensor, go: torch.Tensor, w: torch.Tensor
                     ) -> dict[str, Callable[[], object]]:
    args = topo.kernel_args()
    fns: dict[str, Callable[[], object]] = {"fwd": lambda: OPS.csr_linear(x, w, *args, "auto")}
    for s in CONCRETE:
        fns[s.value] = lambda s=s.value: OPS.csr_linear_backward(go, x, w, *args, s)
    return fns


def relative_errors(topo: CSRTopology, x: torch.Tensor, go: torch.Tensor, w: torch.Tensor) -> dict[str, float]:
    """``||ours - ref|| / ||ref||`` of y, and of grad_x and grad_w per strategy, against float64 dense math on the
    same bf16 inputs (outputs poisoned with NaN first: an element no kernel writes shows as NaN)."""
    v = w.shape[1] if w.dim() == 2 else 1
    where = torch.device("cpu") if x.device.type == "mps" else x.device  # MPS has no float64
    src, dst = topo.src.long().to(where), topo.dst.long().to(where)
    if v > 1:
        dst = dst[:, None] * v + torch.arange(v, device=where)
        src = src[:, None].expand(-1, v)
    dense = torch.zeros(topo.out_features * v, topo.in_features, dtype=torch.float64, device=where)
    dense[dst, src] = w.to(where).double()
    x64, go64 = x.to(where).double(), go.to(where).double()
    ref = {"fwd": x64 @ dense.t(), "grad_x": go64 @ dense, "grad_w": (go64.t() @ x64)[dst, src]}
    del dense

    def err(out: torch.Tensor, key: str) -> float:
        return float(torch.linalg.vector_norm(out.to(where).double() - ref[key]) / torch.linalg.vector_norm(ref[key]))

    args = topo.kernel_args()
    out = {"fwd": err(OPS.csr_linear(x, w, *args, "auto"), "fwd")}
    for s in CONCRETE:
        gx, gw = OPS.csr_linear_backward(go, x, w, *args, s.value)
        out[f"{s.value}/grad_x"] = err(gx, "grad_x")
        out[f"{s.value}/grad_w"] = err(gw, "grad_w")
    return out


def byte_bound(case: Case, nnz_values: int, groups_or_rows: int, stage: str) -> int:
    """The fewest bytes a stage must move (bf16 values, int32 indices): activations read and written once, the
    weight values, their indices and the CSR pointers once (forward: one CSR; backward: both orders, grad_w
    written)."""
    act = 2 * case.tokens
    index_entries = nnz_values // case.layout
    csr = 4 * index_entries + 4 * (groups_or_rows + 1)
    if stage == "fwd":
        return act * (case.in_features + case.out_features) + 2 * nnz_values + csr
    # grad_out and x read, grad_x written; weight read and grad_w written; both CSR orders and the permutation
    return act * (2 * case.in_features + case.out_features) + 4 * nnz_values + 2 * csr + 4 * index_entries


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + written), median of 20 copies of 1 GiB (CUDA) or
    256 MiB (elsewhere)."""
    n = (1 << 30 if device.type == "cuda" else 1 << 28) // 4
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = Timer(device, reps=20).many({"copy": lambda: dst.copy_(src)})["copy"].ms
    return 2 * n * 4 / (ms / 1e3)


def profile_stage(fn: Callable[[], object], device: torch.device) -> list[tuple[str, float]]:
    """``(kernel name, device us)`` of every kernel one call of ``fn`` launches (CUDA), in launch order."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(e.name, e.device_time) for e in kernels]


def kind_of(kernel: str) -> str:
    """``pass`` for a kernel that only moves a whole tensor (transposes, fills, casts), else ``main``.

    Example:
        >>> kind_of("void transpose_kernel<bf16>(...)"), kind_of("csr_tile_kernel<...>")
        ('pass', 'main')
    """
    name = kernel.lower()
    return "pass" if any(m in name for m in PASS_MARKS) else "main"


def short_name(kernel: str) -> str:
    """A kernel's name without its return type, namespaces and arguments.

    Example:
        >>> short_name("void torch_sparse_metal::(anonymous namespace)::transpose_kernel<float, bf16>(float const*)")
        'transpose_kernel<float, bf16>'
        >>> short_name("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int)")
        'vectorized_elementwise_kernel<4, FillFunctor<float>>'
    """
    name = kernel.removeprefix("void ")
    depth, cut = 0, len(name)
    for i, ch in enumerate(name):  # the argument list: the first "(" outside template brackets
        depth += ch == "<"
        depth -= ch == ">"
        if ch == "(" and depth == 0 and not name[:i].endswith("(anonymous namespace"):
            if name[i:].startswith("(anonymous namespace)"):
                continue
            cut = i
            break
    name = name[:cut].replace("(anonymous namespace)::", "")
    for ns in ("torch_sparse_metal::", "at::native::", "at::"):
        name = name.replace(ns, "")
    return name


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def summary(samples: list[float]) -> dict[str, float]:
    q1, q3 = quartiles(samples)
    return {"ms": statistics.median(samples), "q1": q1, "q3": q3}


def paired_ratio(base: list[float], mine: list[float]) -> dict[str, float]:
    """Median and IQR of the per-round ratio base / mine (above 1: ours is faster)."""
    ratios = [b / m for b, m in zip(base, mine)]
    q1, q3 = quartiles(ratios)
    return {"x": statistics.median(ratios), "q1": q1, "q3": q3}


def run_group(out_f: int, in_f: int, tokens: int, densities: tuple[float, ...], layouts: tuple[int, ...],
              device: torch.device, reps: int, bandwidth: float, profile_density: float | None,
              check: bool) -> list[dict]:
    """One (shape, tokens): every density and layout and the dense baselines in one round-robin."""
    fns = dense_callables(out_f, in_f, tokens, device)
    cases, keep = [], []
    for layout in layouts:
        if layout > 1 and out_f % layout:
            continue
        for d in densities:
            case = Case(out_f, in_f, tokens, d, layout)
            topo, x, go, w = operands(case, device, seed=len(cases) + 1)
            keep.append((topo, x, go, w))
            cases.append(case)
            for k, fn in sparse_callables(topo, x, go, w).items():
                fns[f"{case.label}/{k}"] = fn
    timer = Timer(device, reps=reps, graphs=device.type == "cuda")
    samples = {k: [t for t, _ in v] for k, v in timer.samples(fns).items()}

    def step(prefix: str, bwd: str) -> list[float]:
        return [f + b for f, b in zip(samples[f"{prefix}/fwd"], samples[f"{prefix}/{bwd}"])]

    rows = []
    base = {name: step(name, "bwd") for name in ("dense_bf16", "dense_fp16acc") if f"{name}/fwd" in samples}
    base_fwd = {name: samples[f"{name}/fwd"] for name in base}
    common = {"out_features": out_f, "in_features": in_f, "tokens": tokens, "device": device_name(device),
              "torch": torch.__version__, "timing": timer.mode}
    for name in base:
        rows.append({**common, "method": name, "fwd": summary(base_fwd[name]),
                     "bwd": summary(samples[f"{name}/bwd"]), "step": summary(base[name])})
    for case, (topo, x, go, w) in zip(cases, keep):
        bwd = {s.value: summary(samples[f"{case.label}/{s.value}"]) for s in CONCRETE}
        best = min(bwd, key=lambda s: bwd[s]["ms"])
        steps = step(case.label, best)
        row = {**common, "method": "ours", "density": case.density, "layout": case.layout, "nnz": w.numel(),
               "fwd": summary(samples[f"{case.label}/fwd"]), "bwd": bwd, "best_bwd": best, "step": summary(steps),
               "vs": {name: {"fwd": paired_ratio(base_fwd[name], samples[f"{case.label}/fwd"]),
                             "step": paired_ratio(base[name], steps)} for name in base}}
        groups = topo.out_features
        row["bound_us"] = {s: byte_bound(case, w.numel(), groups, s) / bandwidth * 1e6 for s in ("fwd", "bwd")}
        row["gbps"] = {"fwd": byte_bound(case, w.numel(), groups, "fwd") / (row["fwd"]["ms"] / 1e3) / 1e9,
                       "bwd": byte_bound(case, w.numel(), groups, "bwd") / (bwd[best]["ms"] / 1e3) / 1e9}
        if check:
            row["rel_err"] = relative_errors(topo, x, go, w)
        if device.type == "cuda" and profile_density is not None and math.isclose(case.density, profile_density):
            stage_fns = sparse_callables(topo, x, go, w)
            row["profile"] = {k: profile_stage(fn, device) for k, fn in stage_fns.items()}
        rows.append(row)
        print(line(row), flush=True)
    return rows


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple GPU (MPS), {platform.machine()} macOS {platform.mac_ver()[0]}"
    return f"CPU ({platform.processor() or platform.machine()})"


def line(row: dict) -> str:
    lay = "unstr" if row["layout"] == 1 else f"V{row['layout']}"
    vs = row["vs"].get("dense_bf16", {})
    cell = (lambda r: f"{r['x']:.2f}x [{r['q1']:.2f}-{r['q3']:.2f}]") if vs else (lambda r: "-")
    return (f"{row['out_features']:>5}x{row['in_features']:<5} n{row['tokens']:<5} {row['density']:>5.1%} {lay:>6}"
            f"  fwd {row['fwd']['ms'] * 1e3:8.1f} us  step {row['step']['ms'] * 1e3:8.1f} us ({row['best_bwd']})"
            f"  vs bf16 fwd {cell(vs['fwd']) if vs else '-'}  step {cell(vs['step']) if vs else '-'}"
            f"  bound fwd {row['fwd']['ms'] * 1e3 / row['bound_us']['fwd']:.1f}x"
            f" bwd {row['bwd'][row['best_bwd']]['ms'] * 1e3 / row['bound_us']['bwd']:.1f}x")


def markdown(rows: list[dict], meta: dict) -> str:
    """The results as markdown: the step table against dense bf16 and fp16-accumulate, then the stage profile."""
    out = [f"# Sparse layers at transformer shapes ({meta['device']})", "",
           f"Command: `{meta['command']}`  ", f"torch {meta['torch']}, {meta['timing']}, {meta['reps']} rounds; "
           f"copy bandwidth {meta['bandwidth_gbps']:.0f} GB/s (measured, read + write). Ratios: dense ms / ours ms, "
           "median of the per-round ratios [interquartile range]; above 1 is faster than dense.", "",
           "| shape (out x in) | n | density | layout | fwd us | step us (best bwd) | fwd vs bf16 | step vs bf16 | "
           "step vs fp16-acc | fwd / bound | bwd / bound |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    dense = {(r["out_features"], r["in_features"], r["tokens"], r["method"]): r for r in rows
             if r["method"] != "ours"}
    for r in rows:
        if r["method"] != "ours":
            continue
        lay = "unstructured" if r["layout"] == 1 else f"V={r['layout']}"

        def ratio(name: str, stage: str, r: dict = r) -> str:
            v = r["vs"].get(name)
            return f"{v[stage]['x']:.2f} [{v[stage]['q1']:.2f}-{v[stage]['q3']:.2f}]" if v else "-"

        out.append(f"| {r['out_features']}x{r['in_features']} | {r['tokens']} | {r['density']:.0%} | {lay} | "
                   f"{r['fwd']['ms'] * 1e3:.1f} | {r['step']['ms'] * 1e3:.1f} ({r['best_bwd']}) | "
                   f"{ratio('dense_bf16', 'fwd')} | {ratio('dense_bf16', 'step')} | {ratio('dense_fp16acc', 'step')} | "
                   f"{r['fwd']['ms'] * 1e3 / r['bound_us']['fwd']:.1f} | "
                   f"{r['bwd'][r['best_bwd']]['ms'] * 1e3 / r['bound_us']['bwd']:.1f} |")
    out += ["", "Dense baselines (us): fwd / step", ""]
    for (o, i, n, name), r in dense.items():
        out.append(f"- {o}x{i} n{n} {name}: {r['fwd']['ms'] * 1e3:.1f} / {r['step']['ms'] * 1e3:.1f}")
    profiled = [r for r in rows if "profile" in r]
    if profiled:
        out += ["", "## Stage profile (torch.profiler, one eager call, device us)", "",
                "| case | stage | main kernels us | whole passes us | passes |", "|---|---|---|---|---|"]
        for r in profiled:
            lay = "unstructured" if r["layout"] == 1 else f"V={r['layout']}"
            for stage, kernels in r["profile"].items():
                main = sum(t for k, t in kernels if kind_of(k) == "main")
                passes = [(k, t) for k, t in kernels if kind_of(k) == "pass"]
                names = "; ".join(f"{short_name(k)} {t:.1f}" for k, t in passes) or "none"
                out.append(f"| {r['out_features']}x{r['in_features']} n{r['tokens']} {r['density']:.0%} {lay} | "
                           f"{stage} | {main:.1f} | {sum(t for _, t in passes):.1f} | {names} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=SHAPES, metavar="OUTxIN")
    parser.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    parser.add_argument("--densities", type=lambda s: tuple(float(v) for v in s.split(",")), default=DENSITIES)
    parser.add_argument("--layouts", type=lambda s: tuple(int(v) for v in s.split(",")), default=LAYOUTS,
                        help=f"1 (unstructured) and vector blocks among {VECTOR_BLOCKS}")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--profile-density", type=float, default=0.01, help="profile the stages at this density "
                        "(CUDA); a negative value profiles none")
    parser.add_argument("--no-check", action="store_true", help="skip the float64 error check of each case")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--name", default=None)
    args = parser.parse_args(argv)
    bad = [v for v in args.layouts if v != 1 and v not in VECTOR_BLOCKS]
    if bad:
        parser.error(f"layouts must be 1 or among {VECTOR_BLOCKS}, got {bad}")
    if not all(0 < d <= 1 for d in args.densities):
        parser.error("densities must lie in (0, 1]")
    device = torch.device(args.device)
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.name or f"transformer_shapes_{device.type}"
    bandwidth = copy_bandwidth(device)
    profile_density = args.profile_density if args.profile_density > 0 else None
    rows: list[dict] = []
    t0 = time.time()
    for out_f, in_f in args.shapes:
        for tokens in args.tokens:
            rows += run_group(out_f, in_f, tokens, args.densities, args.layouts, device, args.reps, bandwidth,
                              profile_density, not args.no_check)
    meta = {"device": device_name(device), "torch": torch.__version__, "reps": args.reps,
            "timing": rows[0]["timing"] if rows else "", "bandwidth_gbps": bandwidth / 1e9,
            "command": "python benchmarks/transformer_shapes.py " + " ".join(sys.argv[1:] if argv is None else argv),
            "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - t0)}
    (args.out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (args.out / f"{name}.md").write_text(markdown(rows, meta))
    print(f"wrote {args.out / name}.json and .md ({meta['seconds']} s)")


if __name__ == "__main__":
    main()
