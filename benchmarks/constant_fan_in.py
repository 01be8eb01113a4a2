"""Does a constant fan-in topology make the kernels faster? The same layer with the same edge count, its edges drawn
uniformly at random or with every output's in-degree equal (SRigL's constant fan-in, ``CSRTopology.random(...,
constant_fan_in=True)``), timed through the ``csr_linear`` ops: the forward and both backward strategies.

Equal in-degrees would pay in a kernel whose workers own whole rows and wait for the longest one: the rows of a
random topology at 1% of 1024 inputs hold 10 +- 3 edges. The walks here split rows into batch chunks (CUDA), tasks of
rows and batch columns (CPU) and SIMD-groups per row (Metal); this measures what equal rows buy them.

    python benchmarks/constant_fan_in.py --out benchmarks/results/constant_fan_in_cpu_2026-12-07.json
    python benchmarks/constant_fan_in.py --device cuda --dtype bfloat16 --batch 8192 --out cfi_cuda.json
    python benchmarks/constant_fan_in.py --device mps --dtype float16 --batch 4096 --out cfi_mps.json

Every case's topologies and inputs are drawn once; the two topologies' calls run interleaved in one timer
(:class:`torch_sparse_metal.timing.Timer`), and the ratio is random / constant per op (above 1: constant fan-in is
faster), with the spread of each time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path

import torch

import torch_sparse_metal  # noqa: F401  (loads the ops)
from torch_sparse_metal import devices
from torch_sparse_metal.timing import Timer
from torch_sparse_metal.topology import CSRTopology

OPS = torch.ops.torch_sparse_metal
STRATEGIES = ("fused_atomic", "atomic_free")


def parse_shape(text: str) -> tuple[int, int]:
    """``OUTxIN`` as (out_features, in_features)."""
    out, _, inp = text.partition("x")
    return int(out), int(inp)


def topologies(out_features: int, in_features: int, density: float, block: int, seed: int) -> dict[str, CSRTopology]:
    """The constant fan-in topology and a uniformly random one with exactly its edge count."""
    gen = torch.Generator().manual_seed(seed)
    constant = CSRTopology.random(in_features, out_features, density, generator=gen, block=block,
                                  constant_fan_in=True)
    uniform = CSRTopology.random(in_features, out_features, constant.nnz / (in_features * out_features),
                                 generator=gen, block=block)
    assert uniform.nnz == constant.nnz, (uniform.nnz, constant.nnz)
    # the vector layout's ops take the topology over vectors (in_features -> out_features / V)
    return {"random": uniform, "constant": constant} if block == 1 else \
        {"random": uniform.vectors, "constant": constant.vectors}


def run_case(device: torch.device, dtype: torch.dtype, shape: tuple[int, int], density: float, block: int,
             batch: int, reps: int, seed: int) -> dict:
    out_features, in_features = shape
    topos = {name: t.to(device) for name, t in topologies(out_features, in_features, density, block, seed).items()}
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, in_features, generator=gen).to(device, dtype)
    go = torch.randn(batch, out_features, generator=gen).to(device, dtype)
    nnz = topos["random"].nnz
    w = torch.randn((nnz, block) if block > 1 else (nnz,), generator=gen).to(device, dtype)
    calls = {}
    for name, topo in topos.items():
        args = topo.kernel_args()
        calls[f"{name}/forward"] = lambda args=args: OPS.csr_linear(x, w, *args, "auto")
        for strategy in STRATEGIES:
            calls[f"{name}/{strategy}"] = lambda args=args, s=strategy: OPS.csr_linear_backward(go, x, w, *args, s)
    times = Timer(device, reps).many(calls)
    fan = topos["random"].fan_in().float()
    row = {"out_features": out_features, "in_features": in_features, "density": density, "block": block,
           "batch": batch, "nnz": nnz, "random_fan_in": {"mean": fan.mean().item(), "max": fan.max().item()},
           "constant_fan_in": topos["constant"].common_fan_in(), "ops": {}}
    for op in ("forward", *STRATEGIES):
        a, b = times[f"random/{op}"], times[f"constant/{op}"]
        row["ops"][op] = {"random_ms": a.ms, "random_spread_ms": a.spread_ms, "constant_ms": b.ms,
                          "constant_spread_ms": b.spread_ms, "random_over_constant": a.ms / b.ms}
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[(1024, 1024), (4096, 1024), (1024, 4096)],
                        metavar="OUTxIN")
    parser.add_argument("--densities", type=lambda s: tuple(float(v) for v in s.split(",")), default=(0.01, 0.05))
    parser.add_argument("--blocks", type=lambda s: tuple(int(v) for v in s.split(",")), default=(1, 16))
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    rows = []
    print(f"{'case':<34} {'op':<13} {'random ms':>10} {'constant ms':>12} {'random / constant':>18}")
    for shape in args.shapes:
        for density in args.densities:
            for block in args.blocks:
                row = run_case(device, dtype, shape, density, block, args.batch, args.reps, args.seed)
                rows.append(row)
                name = f"{shape[0]}x{shape[1]} {density:.0%} " + ("unstructured" if block == 1 else f"V={block}")
                for op, t in row["ops"].items():
                    print(f"{name:<34} {op:<13} {t['random_ms']:10.3f} {t['constant_ms']:12.3f} "
                          f"{t['random_over_constant']:18.3f}")
    if args.out is not None:
        backend = devices.get(device.type)
        meta = {"device": backend.describe(device) if backend is not None else device.type,
                "machine": platform.machine(), "torch": torch.__version__, "dtype": args.dtype,
                "reps": args.reps, "timing": Timer(device, args.reps).mode,
                "threads": torch.get_num_threads() if device.type == "cpu" else None,
                "command": " ".join(["python benchmarks/constant_fan_in.py",
                                     *(sys.argv[1:] if argv is None else argv)]),
                "date": datetime.date.today().isoformat()}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
