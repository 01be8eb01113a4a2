"""Self-check of the Metal backend: ``python -m torch_sparse_metal.selfcheck``.

On a Mac with MPS it runs every op and backward strategy on MPS against the CPU backend, prints PASS/FAIL per
check, then a table of forward/backward times for both strategies at seed 000's sizes (22K-61K edges), naming
the hardware. Without MPS it runs the same checks through the MSL-on-CPU executor, says so, and prints no
timings (executor timings say nothing about Metal). Exit status is non-zero only if a check failed.

Example::

    $ python -m torch_sparse_metal.selfcheck            # checks, then the MPS timing table
    $ python -m torch_sparse_metal.selfcheck --no-bench # checks only
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

STRATEGIES = ("fused_atomic", "atomic_free")
#: (in_features, out_features, density, batch) checked on every backend: a char-level-sized layer, odd sizes that
#: are no multiple of the threadgroup, batch 1 and 0, no edges, all edges.
CHECK_CASES = [
    (1024, 1024, 0.03, 128),
    (300, 257, 0.05, 33),
    (37, 45, 0.3, 1),
    (64, 33, 0.0, 3),
    (50, 70, 1.0, 0),
]
#: Seed 000's edge counts (M1 Pro; fused / atomic-free backward ms as published there).
SEED000 = [(22_000, 10.8, 81.0), (30_000, 12.6, 100.0), (39_000, 12.8, 117.3), (42_000, 12.0, 124.6),
           (61_000, 17.3, 159.5)]
#: Layer of the timing table: a char-level model's hidden layer, in = out = 1024, batch 128 sequences.
BENCH_FEATURES = 1024
BENCH_BATCH = 128


def hardware_name() -> str:
    """E.g. ``"Apple M1 Pro, macOS 14.5"``; the CPU model elsewhere."""
    if sys.platform == "darwin":
        try:
            chip = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], check=False, capture_output=True,
                                  text=True).stdout.strip()
        except OSError:
            chip = ""
        return f"{chip or platform.machine()}, macOS {platform.mac_ver()[0]}"
    return f"{platform.processor() or platform.machine()}, {platform.system()} {platform.release()}"


def _close(got: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    got, ref = got.detach().cpu().double(), ref.detach().cpu().double()
    if got.shape != ref.shape:
        return False, float("inf")
    if got.numel() == 0:
        return True, 0.0
    err = (got - ref).abs().max().item()
    scale = max(1.0, ref.abs().max().item())
    return bool(torch.isfinite(got).all()) and err <= 1e-4 * scale + 1e-4, err


class Report:
    """Collects PASS/FAIL lines."""

    def __init__(self) -> None:
        self.failures = 0

    def check(self, name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
        ok, err = _close(got, ref)
        self.failures += not ok
        print(f"  {'PASS' if ok else 'FAIL'}  {name:<58} max|err| {err:.2e}")

    def error(self, name: str, exc: BaseException) -> None:
        self.failures += 1
        print(f"  FAIL  {name:<58} {type(exc).__name__}: {exc}")


def run_checks(device: str, metal, report: Report) -> None:
    """Every op and strategy through ``metal`` (a MetalCsrLinear) against the CPU backend's ops."""
    from torch_sparse_metal import CSRTopology, sparse_linear

    ops = torch.ops.torch_sparse_metal
    for n_in, n_out, density, batch in CHECK_CASES:
        g = torch.Generator().manual_seed(n_in * 31 + batch)
        topo = CSRTopology.random(n_in, n_out, density, generator=g)
        x = torch.randn(batch, n_in, generator=g)
        w = torch.randn(topo.nnz, generator=g)
        go = torch.randn(batch, n_out, generator=g)
        dev = topo.to(device)
        xd, wd, god = x.to(device), w.to(device), go.to(device)
        tag = f"in={n_in} out={n_out} d={density} N={batch} E={topo.nnz}"
        try:
            ref = ops.csr_linear(x, w, *topo.kernel_args(), "auto")
            report.check(f"forward            {tag}", metal.forward(xd, wd, *dev.kernel_args()), ref)
            for s in STRATEGIES:
                ref_gx, ref_gw = ops.csr_linear_backward(go, x, w, topo.row_ptr, topo.dst, topo.src, s)
                gx, gw = metal.backward(god, xd, wd, dev.row_ptr, dev.dst, dev.src, s)
                report.check(f"backward {s:<12} grad_x {tag}", gx, ref_gx)
                report.check(f"backward {s:<12} grad_w {tag}", gw, ref_gw)
            if device == "mps":  # the registered MPS kernels, through the op and its autograd rule
                for s in STRATEGIES:
                    xr, wr = xd.clone().requires_grad_(), wd.clone().requires_grad_()
                    y = sparse_linear(xr, wr, dev, backward=s)
                    y.backward(god)
                    report.check(f"sparse_linear+autograd {s:<12} {tag}", y, ref)
                    ref_gx, ref_gw = ops.csr_linear_backward(go, x, w, topo.row_ptr, topo.dst, topo.src, s)
                    report.check(f"  grad_x via autograd {s:<12} {tag}", xr.grad, ref_gx)
                    report.check(f"  grad_w via autograd {s:<12} {tag}", wr.grad, ref_gw)
        except Exception as exc:  # noqa: BLE001 - every failure is reported, the run goes on
            report.error(tag, exc)


def _median_ms(fn: Callable[[], object], reps: int) -> float:
    for _ in range(3):
        fn()
    torch.mps.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.mps.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _bench_case(metal, topo, x, w, go, reps: int) -> tuple[float, dict[str, float]]:
    fwd = _median_ms(lambda: metal.forward(x, w, *topo.kernel_args()), reps)
    bwd = {s: _median_ms(lambda s=s: metal.backward(go, x, w, topo.row_ptr, topo.dst, topo.src, s), reps)
           for s in STRATEGIES}
    return fwd, bwd


def bench_mps(metal, reps: int) -> None:
    """Seed-000-style table, measured on MPS only."""
    from torch_sparse_metal import CSRTopology

    n = BENCH_FEATURES
    print(f"\nMPS timings on {hardware_name()}, torch {torch.__version__}: layer {n}x{n}, batch {BENCH_BATCH}, "
          f"float32, median of {reps} synchronised calls (ms)")
    print(f"{'edges':>7} {'density':>8} {'forward':>8} {'bwd fused':>10} {'bwd a-free':>11} {'a-free/fused':>13}"
          f"   seed 000 M1 Pro fused / a-free")
    for edges, s_fused, s_free in SEED000:
        g = torch.Generator().manual_seed(edges)
        topo = CSRTopology.random(n, n, edges / (n * n), generator=g).to("mps")
        x = torch.randn(BENCH_BATCH, n, generator=g).to("mps")
        w = torch.randn(topo.nnz, generator=g).to("mps")
        go = torch.randn(BENCH_BATCH, n, generator=g).to("mps")
        fwd, bwd = _bench_case(metal, topo, x, w, go, reps)
        ratio = bwd["atomic_free"] / bwd["fused_atomic"]
        print(f"{topo.nnz:>7} {topo.density:>8.4f} {fwd:>8.3f} {bwd['fused_atomic']:>10.3f} "
              f"{bwd['atomic_free']:>11.3f} {ratio:>13.2f}   {s_fused:>6.1f} / {s_free:.1f}")
    print("(seed 000 timed whole training steps of its own model; compare ratios, not absolute times)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_sparse_metal.selfcheck", description=__doc__.split("\n")[0])
    parser.add_argument("--no-bench", action="store_true", help="skip the MPS timing table")
    parser.add_argument("--reps", type=int, default=20, help="timed calls per measurement (default 20)")
    args = parser.parse_args(argv)

    from torch_sparse_metal.backends import mps

    report = Report()
    if torch.backends.mps.is_available():
        print(f"torch_sparse_metal self-check on MPS ({hardware_name()}, torch {torch.__version__}): "
              "Metal kernels vs the CPU backend")
        metal = mps.default()
        run_checks("mps", metal, report)
        if not args.no_bench and not report.failures:
            bench_mps(metal, args.reps)
    else:
        print("MPS is not available on this machine, so Metal itself is NOT being tested here.\n"
              "Running the same checks with the MSL-on-CPU executor (torch_sparse_metal.testing.msl), which compiles "
              "the unchanged shaders/*.metal as C++ and runs them on CPU tensors through the same host code.\n"
              "No timings are printed: executor timings say nothing about Metal.")
        from torch_sparse_metal.testing.msl import MslError, compile_shader

        try:
            metal = mps.MetalCsrLinear(compile_shader, device_type="cpu")
            metal.library  # noqa: B018 - compile now, to report a missing compiler clearly
        except MslError as exc:
            print(f"Cannot run the executor here ({exc}); nothing was checked.")
            return 0
        run_checks("cpu", metal, report)
    verdict = "FAIL" if report.failures else "PASS"
    print(f"\n{verdict}: {report.failures} failed check(s)")
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
