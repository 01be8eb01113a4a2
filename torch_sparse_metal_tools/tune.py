"""Tune ``auto`` ahead of a run, or show or clear the decisions: ``python -m torch_sparse_metal_tools.tune``.

Each ``--layer IN,OUT,DENSITY`` at ``--batch`` rows runs one forward and backward on ``--device`` with tuning on
(whatever ``TORCH_SPARSE_METAL_TUNE`` says: this command is the opt-in), which tunes its size bucket unless this
machine already has a decision for it: what the device's backend tunes (:mod:`torch_sparse_metal.tuning`; MPS: the
kernel variants of the forward and of the backward). Where the backend tunes nothing (CPU, CUDA: the strategies'
measurements do not differ enough, docs/strategies.md) it says so, runs the layers all the same (so a size the
device cannot run shows) and ``auto`` runs the static rule. The decisions are printed, then the cache (``--show``
alone prints it). A later run reads them only with tuning on (``TORCH_SPARSE_METAL_TUNE=1`` or
``torch_sparse_metal.tuning.enable()``); otherwise ``auto`` follows the static rules.

Example::

    $ python -m torch_sparse_metal_tools.tune --device mps --layer 1024,1024,0.05 --batch 256
    $ python -m torch_sparse_metal_tools.tune --show
    $ python -m torch_sparse_metal_tools.tune --clear
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from torch_sparse_metal import SparseLinear, tuning
from torch_sparse_metal.contract import DTYPES, supported_dtypes
from torch_sparse_metal.strategy import STATIC, tuned_strategies
from torch_sparse_metal.topology import CSRTopology
from torch_sparse_metal_tools.argtypes import check_writable, positive_int
from torch_sparse_metal_tools.cli import device_type, wait_passively
from torch_sparse_metal_tools.progress import heartbeat

#: The setting that turns tuning on for a run.
_TUNE_ENV = "TORCH_SPARSE_METAL_TUNE"
#: The value dtypes of the op contract, by name.
DTYPE_NAMES = tuple(str(d).removeprefix("torch.") for d in DTYPES)


def _layer(text: str) -> tuple[int, int, float]:
    """``--layer IN,OUT,DENSITY``: positive sizes and a density that leaves at least one edge."""
    try:
        n_in, n_out, density = text.split(",")
        n_in, n_out, density = int(n_in), int(n_out), float(density)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected IN,OUT,DENSITY (e.g. 1024,1024,0.05), got {text!r}") from None
    if n_in <= 0 or n_out <= 0:
        raise argparse.ArgumentTypeError(f"IN and OUT must be positive, got {text!r}")
    try:
        nnz = CSRTopology.random_edge_count(n_in, n_out, density)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    if nnz == 0:
        raise argparse.ArgumentTypeError(f"{text!r}: density {density:g} leaves no edge in {n_in}x{n_out}; give "
                                         f"DENSITY {1 / (n_in * n_out):.3g} or more")
    return n_in, n_out, density


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"


def build_parser() -> argparse.ArgumentParser:
    """The command line; every value is checked as it is parsed (a usage error, exit status 2).

    Example:
        >>> build_parser().parse_args(["--device", "cpu", "--layer", "64,32,0.1", "--dtype", "bfloat16"]).layer
        [(64, 32, 0.1)]
    """
    p = argparse.ArgumentParser(prog="python -m torch_sparse_metal_tools.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", type=device_type(), default=_default_device(),
                   help="cpu, cuda, cuda:N or mps (default: cuda, then mps, then cpu)")
    p.add_argument("--layer", type=_layer, action="append", default=[], metavar="IN,OUT,DENSITY",
                   help="a layer size to tune (repeatable)")
    p.add_argument("--batch", type=positive_int, default=256,
                   help="rows per call (batch x sequence length), default 256")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES,
                   help="value dtype (default float32; the device must have kernels for it)")
    p.add_argument("--show", action="store_true", help="print the cached decisions")
    p.add_argument("--clear", action="store_true", help="delete every cached decision")
    return p


def decisions(device: torch.device, dtype: torch.dtype, n_in: int, n_out: int, nnz: int, batch: int) -> str:
    """The cached decisions for a size, in words: ``"forward values_per_lane=4, backward fused_atomic
    values_per_lane=4"`` (no forward where the device has no variants to choose; the static rule where it has
    nothing to tune)."""
    if not tunable(device.type):
        return f"backward {STATIC.value} (the static rule)"
    fwd = tuning.cached(device, tuning.bucket_key(dtype, n_in, n_out, nnz, batch, "forward"),
                        tuning.candidates(device.type))
    bwd = tuning.cached(device, tuning.bucket_key(dtype, n_in, n_out, nnz, batch),
                        tuning.candidates(device.type, tuned_strategies(device.type)))
    words = [f"forward {tuning.label(fwd)}"] if fwd else []
    return ", ".join(words + [f"backward {tuning.label(bwd) if bwd else 'not tuned'}"])


def tunable(device_type: str) -> bool:
    """Whether ``auto`` has anything to choose on ``device_type`` (a strategy or a kernel variant).

    Example:
        >>> tunable("cpu"), tunable("mps")
        (False, True)
    """
    backward = tuning.candidates(device_type, tuned_strategies(device_type))
    return len(backward) > 1 or len(tuning.candidates(device_type)) > 1


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The combinations the types cannot check, before anything is cleared or tuned."""
    if not (args.layer or args.show or args.clear):
        parser.error("nothing to do: give --layer IN,OUT,DENSITY, --show or --clear")
    supported = [name for name in DTYPE_NAMES if getattr(torch, name) in supported_dtypes(args.device.type)]
    if args.dtype not in supported:
        parser.error(f"--dtype {args.dtype}: no csr_linear kernels for it on {args.device.type}; there: "
                     f"{', '.join(supported)}")
    try:
        cache = tuning.cache_path()
    except RuntimeError as exc:  # no home folder and no cache variable
        parser.error(str(exc))
    if args.clear or (args.layer and tunable(args.device.type)):  # what writes the cache
        check_writable(parser, cache.parent, f"the tuning cache's folder {cache.parent} (TORCH_SPARSE_METAL_CACHE_DIR)")


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (1 when a layer could not be tuned, e.g. out of memory); bad
    arguments exit with status 2 (argparse's usage error) before anything is cleared or tuned."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    if args.clear:
        tuning.forget()
        print(f"cleared {tuning.cache_path()}")
    was_on = tuning.enabled()
    tuning.enable()  # running this command is the opt-in; a caller's process gets its own setting back
    try:
        status = _tune(args.device, getattr(torch, args.dtype), args.layer, args.batch)
    finally:
        tuning.enable(was_on)
    if status == 0 and (args.show or (args.layer and tunable(args.device.type))):
        print(f"{tuning.cache_path()}:")
        print(json.dumps(tuning.decisions(), indent=1, sort_keys=True))
    if status == 0 and args.layer and tunable(args.device.type):
        print(f"runs read these decisions only with tuning on ({_TUNE_ENV}=1 or torch_sparse_metal.tuning.enable()); "
              "without it auto follows the static rules")
    return status


def _tune(device: torch.device, dtype: torch.dtype, layers: list[tuple[int, int, float]], batch: int) -> int:
    """One forward and backward of each layer, printing its decisions; 1 at the first that cannot run."""
    if layers and not tunable(device.type):
        print(f"nothing to tune on {device.type}: auto runs {STATIC.value} there, the static rule (its measurements "
              "show no difference beyond the timing noise: docs/strategies.md)")
    for n_in, n_out, density in layers:
        try:
            with heartbeat(f"tuning {n_in}x{n_out}, density {density:g}, batch {batch}"):
                layer = SparseLinear(n_in, n_out, density=density, device=device, dtype=dtype)
                x = torch.randn(batch, n_in, device=device, dtype=dtype, requires_grad=True)
                layer(x).sum().backward()  # the first forward and backward of a bucket tune it
        except (RuntimeError, MemoryError) as exc:  # out of memory above all: the sizes parsed, the machine refused
            print(f"error: {n_in}x{n_out}, density {density:g}, batch {batch} on {device} could not be tuned: "
                  f"{(str(exc).splitlines() or [type(exc).__name__])[0]}", file=sys.stderr)
            return 1
        print(f"{n_in}x{n_out}, density {density:g}, batch {batch} on {device}: "
              f"{decisions(device, dtype, n_in, n_out, layer.nnz, batch)}")
    return 0


if __name__ == "__main__":
    wait_passively()
    sys.exit(main())
