"""The Metal kernels timed on an NVIDIA GPU, beside our CUDA kernels: ``python -m tsm_dev.metal_bench`` (from a
checkout; the benchmark's own options, ``--device cuda``).

The shipped ``shaders/`` compiled as CUDA by :mod:`tsm_dev.msl.cuda` and driven by the MPS host code
(``MetalCsrLinear``, with its own grids and threadgroups) are timed in the benchmark's round-robin
(:func:`torch_sparse_metal_tools.bench.run`) as ``<strategy>/metal``; ``--baseline DIR`` adds another Metal design as
``<strategy>/metal_base`` (``DIR`` holds its ``csr_linear_common.h``, ``csr_linear.metal`` and host ``mps.py``,
e.g. from an earlier commit: ``benchmarks/metal_baseline.sh``). After the benchmark's table it prints
:func:`metal_table`. docs/metal.md says what such timings tell about Apple GPUs.

Example::

    $ bash benchmarks/metal_baseline.sh b6c1e25 .metal_baseline
    $ python -m tsm_dev.metal_bench --device cuda --cases design seed --baseline .metal_baseline --graphs

The scripts benchmarks/metal_vector_bench.py and benchmarks/metal_window_bench.py share its :func:`rel_error` and
:func:`report_rows`.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import statistics
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from torch_sparse_metal.backends.metal_source import load_source
from torch_sparse_metal_tools import bench
from torch_sparse_metal_tools.argtypes import existing_path

#: The files a Metal baseline folder must hold (:func:`metal_designs`).
BASELINE_FILES = ("csr_linear_common.h", "csr_linear.metal", "mps.py")
#: The stages compared in the Metal table: (label, strategy whose row holds it, field).
METAL_STAGES = (("forward", "fused_atomic", "fwd_ms"), ("fused_atomic bwd", "fused_atomic", "bwd_ms"),
                ("atomic_free bwd", "atomic_free", "bwd_ms"))


def metal_designs(baseline: Path | None = None, compile_fn: Callable[[str], object] | None = None,
                  device_type: str = "cuda") -> dict[str, object]:
    """Label -> ``MetalCsrLinear``-like object running Metal kernels: ``metal``, the shipped shaders with the
    shipped host code, and ``metal_base``, the design found in ``baseline``. They compile through the CUDA
    translation on CUDA tensors (``compile_fn`` and ``device_type`` may name another target, e.g. the executor)."""
    from torch_sparse_metal.backends.mps import MetalCsrLinear

    if compile_fn is None:
        from tsm_dev.msl import cuda

        compile_fn = cuda.compile_shader
    designs: dict[str, object] = {"metal": MetalCsrLinear(compile_fn, device_type, poison=False)}
    if baseline is not None:
        host = types.ModuleType("tsm_metal_baseline")
        host.__file__ = str(baseline / "mps.py")
        # the baseline's host module, without its last line's registration of MPS kernels, compiling its own source
        code = (baseline / "mps.py").read_text().replace("\nregister()\n", "\n")
        with _no_backend_declarations():  # the shipped module declared the MPS backend already
            exec(compile(code, str(baseline / "mps.py"), "exec"), host.__dict__)  # noqa: S102 - our earlier file
        # its shader files behind the constants its host defines (none before they moved there: then its shaders
        # hold their own numbers)
        source = load_source(("csr_linear.metal",), getattr(host, "CONSTANTS", None), directory=baseline)
        host.load_source = lambda dtype=None: source  # every dtype's kernels, whichever dtype the host asks for
        design = host.MetalCsrLinear(compile_fn, device_type, poison=False)
        if "col_ptr" not in inspect.signature(design.backward).parameters:
            design = _BySourceBackward(design)
        designs["metal_base"] = design
    return designs


@contextlib.contextmanager
def _no_backend_declarations() -> Iterator[None]:
    """While a baseline's host module runs: its ``devices.register`` call (the design's MPS backend, which the
    shipped module declared already) returns the declaration without recording it."""
    from torch_sparse_metal import devices

    register = devices.register
    devices.register = lambda backend: backend
    try:
        yield
    finally:
        devices.register = register


class _BySourceBackward:
    """A design from before the backward op took the whole topology (such as b6c1e25's, the first design, which
    docs/metal.md compares): its backward gets the by-source arrays."""

    def __init__(self, design: object):
        self.forward, self._design = design.forward, design

    def backward(self, grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm, strategy):
        return self._design.backward(grad_out, x, weight, row_ptr, dst, src, strategy)


def _case_key(row: dict) -> tuple[int, float, int, str]:
    return row["in_features"], row["density"], row["batch"], row.get("dtype", "float32")  # older JSON: float32


def _time(run: list[dict], case: tuple[int, float, int, str], method: str, field: str) -> float:
    return next((r[field] for r in run if r["method"] == method and _case_key(r) == case), math.nan)


def metal_table(runs: list[list[dict]]) -> str:
    """Markdown table of the Metal designs against our CUDA kernels over one or more runs of the same cases: per
    case and stage, the median time over runs, and the median and range of the per-run ratio Metal / CUDA (a
    ratio is taken within one run, where both were timed side by side)."""
    labels = sorted({r["method"].split("/", 1)[1] for r in runs[0] if "/metal" in r["method"]})
    lines = ["| case | stage | our CUDA ms | " + " | ".join(f"{lab} ms | {lab} / CUDA" for lab in labels) + " |",
             "|" + "---|" * (3 + 2 * len(labels))]
    keys = {_case_key(r) for r in runs[0] if r["method"] == METAL_STAGES[0][1]}  # where ours ran
    for case in sorted(keys, key=lambda k: (k[0], k[2], k[1], k[3])):
        for stage, strategy, field in METAL_STAGES:
            base = [_time(run, case, strategy, field) for run in runs]
            cells = [f"{statistics.median(base):.4f}"]
            for lab in labels:
                times = [_time(run, case, f"{strategy}/{lab}", field) for run in runs]
                ratios = [t / b for t, b in zip(times, base)]
                spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
                cells += [f"{statistics.median(times):.4f}", f"{statistics.median(ratios):.2f}{spread}"]
            n, density, batch, dtype = case
            label = f"{n}², {density * 100:.2g}%, B{batch}" + ("" if dtype == "float32" else f", {dtype}")
            lines.append(f"| {label} | {stage} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error of ``got`` against the float64 reference ``ref`` (on the CPU), in the Frobenius norm."""
    return float((got.double().cpu() - ref).norm() / ref.norm().clamp_min(1e-30))


def report_rows(rows: list[dict], case: Callable[[dict], str], ratio: str, device: str, json_path: Path | None) -> None:
    """The rows of benchmarks/metal_*_bench.py as a Markdown table (the first column ``case(row)``; ``vs_<ratio>``,
    the ratio to that method's time) and, with ``json_path``, as JSON there with ``device`` (its description)."""
    print(f"| case | dtype | stage | method | ms | / {ratio} | spread ms | rel. error |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {case(r)} | {r['dtype']} | {r['stage']} | {r['method']} | {r['ms']:.4f} | {r[f'vs_{ratio}']:.2f} | "
              f"{r['spread_ms']:.4f} | {r['rel_error']:.1e} |")
    if json_path:
        json_path.write_text(json.dumps({"device": device, "torch": torch.__version__, "rows": rows}, indent=1))


def main(argv: list[str] | None = None) -> None:
    """The benchmark with the Metal designs beside ours; usage errors (exit status 2) before any timing."""
    parser = bench.build_parser(prog="python -m tsm_dev.metal_bench")
    parser.add_argument("--baseline", type=existing_path, default=None,
                        help="a folder with another Metal design to time beside (benchmarks/metal_baseline.sh)")
    args = parser.parse_args(argv)
    if args.device != "cuda":
        parser.error("the Metal kernels run through their CUDA translation here: use --device cuda")
    if args.baseline is not None:
        missing = [name for name in BASELINE_FILES if not (args.baseline / name).is_file()]
        if missing:
            parser.error(f"--baseline {args.baseline}: no {', '.join(missing)} there "
                         "(benchmarks/metal_baseline.sh makes such a folder)")
    rows = bench.run(parser, args, designs=lambda: metal_designs(args.baseline))
    print("\nMetal designs compiled as CUDA, beside our CUDA kernels (ratio = Metal / CUDA, same run)")
    print(metal_table([rows]))


if __name__ == "__main__":
    main()
