"""Tune ``auto`` ahead of a run, or show or clear the decisions: ``python -m torch_sparse_metal.tune``.

Each ``--layer IN,OUT,DENSITY`` at ``--batch`` rows runs one forward and backward on ``--device``, which tunes
its size bucket unless this machine already has a decision for it: the backward's strategy and, where the
backend has kernel variants (MPS: ``values_per_lane``), the backward's and the forward's variant
(:mod:`torch_sparse_metal.tuning`). The decisions are printed, then the cache (``--show`` alone prints it).

Example::

    $ python -m torch_sparse_metal.tune --device mps --layer 1024,1024,0.05 --batch 256
    $ python -m torch_sparse_metal.tune --show
    $ python -m torch_sparse_metal.tune --clear
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from torch_sparse_metal import SparseLinear, tuning
from torch_sparse_metal.strategy import CONCRETE


def _layer(text: str) -> tuple[int, int, float]:
    try:
        n_in, n_out, density = text.split(",")
        return int(n_in), int(n_out), float(density)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected IN,OUT,DENSITY (e.g. 1024,1024,0.05), got {text!r}") from None


def decisions(device: torch.device, dtype: torch.dtype, n_in: int, n_out: int, nnz: int, batch: int) -> str:
    """The cached decisions for a size, in words: ``"forward values_per_lane=4, backward fused_atomic
    values_per_lane=4"`` (no forward where the device has no variants to choose)."""
    fwd = tuning.cached(device, tuning.bucket_key(dtype, n_in, n_out, nnz, batch, "forward"),
                        tuning.candidates(device.type))
    bwd = tuning.cached(device, tuning.bucket_key(dtype, n_in, n_out, nnz, batch),
                        tuning.candidates(device.type, [s.value for s in CONCRETE]))
    words = [f"forward {tuning.label(fwd)}"] if fwd else []
    return ", ".join(words + [f"backward {tuning.label(bwd) if bwd else 'not tuned'}"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torch_sparse_metal.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else
                   "mps" if torch.backends.mps.is_available() else "cpu")
    p.add_argument("--layer", type=_layer, action="append", default=[], metavar="IN,OUT,DENSITY")
    p.add_argument("--batch", type=int, default=256, help="rows per call (batch x sequence length), default 256")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--show", action="store_true", help="print the cached decisions")
    p.add_argument("--clear", action="store_true", help="delete every cached decision")
    args = p.parse_args(argv)
    if args.clear:
        tuning.forget()
        print(f"cleared {tuning.cache_path()}")
    if args.layer and not tuning.enabled():
        p.error("TORCH_SPARSE_METAL_TUNE=0 is set: nothing would be tuned")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    for n_in, n_out, density in args.layer:
        layer = SparseLinear(n_in, n_out, density=density, device=device, dtype=dtype)
        x = torch.randn(args.batch, n_in, device=device, dtype=dtype, requires_grad=True)
        layer(x).sum().backward()  # the first forward and backward of a bucket tune it
        print(f"{n_in}x{n_out}, density {density:g}, batch {args.batch} on {device}: "
              f"{decisions(device, dtype, n_in, n_out, layer.nnz, args.batch)}")
    if args.show or args.layer:
        print(f"{tuning.cache_path()}:")
        print(json.dumps(tuning._load(), indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
