"""Command line of ``examples/train_wikitext103.py``: argument parsing and the run itself.

The same command runs under ``torchrun --nproc-per-node N`` (:mod:`.launch`): each process sets up the
process group before any work, trains on its own device and windows, and only rank 0 prints and writes.

Example:
    >>> args = build_parser().parse_args(["--steps", "10", "--density", "0.1", "--device", "cpu"])
    >>> args.steps, args.density, args.backward
    (10, 0.1, 'auto')
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from pathlib import Path

import torch

from torch_sparse_metal import SparseLinear
from torch_sparse_metal.evolve import DynamicSparsity
from torch_sparse_metal.strategy import Strategy
from torch_sparse_metal.topology import BLOCKS, CSRTopology
from torch_sparse_metal_tools import argtypes
from torch_sparse_metal_tools import cli as _cli

from .decoupled import DecoupledConfig, refusal
from .launch import (
    DEFAULT_TIMEOUT_MINUTES,
    Launch,
    destroy_process_group,
    init_process_group,
    process_device,
    torchrun_launch,
)
from .loop import DTYPES, autocast_dtypes

__all__ = ["build_parser", "check_args", "check_corpus_fits", "check_density", "check_schedule", "load_corpus_checked",
           "main"]

DEFAULT_MINUTES = 4.0
MAX_MINUTES = 1e7
#: Model and batch sizes by ``--size``; ``auto`` is ``small`` on the CPU (a few hundred steps in two minutes on
#: two cores) and ``base`` on accelerators (the configuration measured in docs/training.md). Explicit options win.
SIZES = {
    "small": {"d_model": 128, "layers": 2, "heads": 2, "context": 128, "batch_size": 8, "eval_chars": 1 << 15,
              "log_every": 10, "eval_every": 100},
    "base": {"d_model": 256, "layers": 4, "heads": 4, "context": 256, "batch_size": 16, "eval_chars": 1 << 20,
             "log_every": 50, "eval_every": 1000},
}


#: The options that configure sparse layers only (their backward strategy, their evolving topology), by destination.
#: ``--dense`` builds nn.Linear layers, which none of them would change: each is refused with it, not ignored.
#: (``--density``, ``--block`` and ``--constant-fan-in`` are not among them: ``--dense`` sizes its model from the
#: sparse one they describe.)
SPARSE_ONLY = ("backward", "prune_every", "grow", "grow_until", "drop_fraction", "prune_stop", "regrow",
               "prune_to", "min_salient")

_fraction, _probability = argtypes.fraction, argtypes.probability
_positive_int, _non_negative_int = argtypes.positive_int, argtypes.non_negative_int
_positive_float, _non_negative_float = argtypes.positive_float, argtypes.non_negative_float
_seed, _existing_path = argtypes.seed, argtypes.existing_path
_run_fraction = argtypes.unit_interval("(0, 1]")
#: What a run writes into its output folder (a new run there would replace them).
RUN_FILES = ("checkpoint.pt", "log.json", "bpc.png")


def _minutes(text: str) -> float:
    value = _positive_float(text)
    if value > MAX_MINUTES:  # the clock and the progress bar count seconds in floats and ints
        raise argparse.ArgumentTypeError(f"must be at most {MAX_MINUTES:g} (about 19 years), got {text}")
    return value


def _ratio(text: str) -> DecoupledConfig:
    try:
        return DecoupledConfig.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train_wikitext103.py",
        description="Train a character-level Transformer with SparseLinear layers on WikiText-103 (or a local "
                    "text / the bundled offline corpus) with a sync-free training step; report BPC and timings.",
    )
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=_minutes, default=None,
                        help=f"training-time budget in minutes, evaluation excluded (default {DEFAULT_MINUTES:g})")
    budget.add_argument("--steps", type=_positive_int, default=None, help="budget in optimisation steps")
    p.add_argument("--data", type=_existing_path, default=None,
                   help="a WikiText raw directory (wiki.{train,valid,test}.raw), or one text file split 90/5/5 "
                        "(gzip/.dz allowed); default: WikiText-103 via 'datasets', else the bundled corpus")
    p.add_argument("--offline", action="store_true", help="do not try 'datasets' when --data is not given")
    p.add_argument("--device", type=_cli.device_type(allow_auto=True), default="auto",
                   help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps")
    p.add_argument("--seed", type=_seed, default=0, help="seed of the topology, weights and batches (default 0)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: runs/<sparse|dense>-<time>)")
    p.add_argument("--overwrite", action="store_true",
                   help="let a new run replace another run's checkpoint, log and plot in --out")
    p.add_argument("--resume", type=_existing_path, default=None,
                   help="continue from a checkpoint file or run folder (model and training settings come from "
                        "it; --steps/--minutes, if given, replace its budget)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (without a terminal: no progress line every 30 s)")
    p.add_argument("--dist-timeout", type=_positive_float, default=DEFAULT_TIMEOUT_MINUTES, metavar="MINUTES",
                   help="under torchrun: how long the processes wait for a silent one before the run fails "
                        "(default %(default)g)")

    m = p.add_argument_group("model")
    m.add_argument("--density", type=_fraction, default=0.25,
                   help="fraction of the sparse layers' connections kept (default %(default)s)")
    m.add_argument("--distribution", choices=["uniform", "er", "erk"], default="uniform",
                   help="how --density is shared among the sparse layers: the same in each (default), or "
                        "Erdos-Renyi(-kernel) densities, higher for smaller matrices (docs/topology.md)")
    m.add_argument("--block", type=int, choices=BLOCKS, default=1,
                   help="layout of the sparse matrices: 1 unstructured (default), or vectors of V outputs "
                        "(SparseLinear(block=V))")
    m.add_argument("--constant-fan-in", action="store_true",
                   help="every output of a sparse matrix gets the same number of inputs, round(density * inputs), "
                        "and the evolving topology keeps it (SRigL; with --block V, every group of V outputs the "
                        "same number of vectors)")
    m.add_argument("--backward", choices=[s.value for s in Strategy], default="auto",
                   help="SparseLinear backward strategy (default %(default)s)")
    m.add_argument("--dense", action="store_true",
                   help="the same model with dense nn.Linear layers, narrowed to the sparse model's nonzero count")
    m.add_argument("--size", choices=["auto", *SIZES], default="auto",
                   help="presets for the options below: small (d_model 128, 2 layers, 2 heads, context 128, batch 8) "
                        "or base (256, 4, 4, 256, 16); auto (default): small on cpu, base elsewhere")
    m.add_argument("--d-model", type=_positive_int, default=None, help="width of the sparse model")
    m.add_argument("--layers", type=_positive_int, default=None, help="Transformer blocks")
    m.add_argument("--heads", type=_positive_int, default=None, help="attention heads")
    m.add_argument("--context", type=_positive_int, default=None, help="characters per training window")

    t = p.add_argument_group("training")
    t.add_argument("--batch-size", type=_positive_int, default=None,
                   help="windows per step and process (under torchrun the global batch is N times it; "
                        "default: --size)")
    t.add_argument("--dropout", type=_probability, default=0.0,
                   help="dropout on embeddings, attention and residual branches, both models (default 0)")
    t.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="float32, or mixed precision: forward and loss under torch.autocast in bfloat16 or float16 "
                        "(float16 with loss scaling), parameters and optimizer state float32 (default %(default)s)")
    t.add_argument("--graphs", action="store_true",
                   help="capture the training step in a CUDA graph once and replay it (CUDA, one process; SET/RigL "
                        "updates are written into the captured tensors, --grow captures again; docs/training.md)")
    t.add_argument("--lr", type=_positive_float, default=2e-3, help="peak AdamW learning rate (default %(default)s)")
    t.add_argument("--warmup-steps", type=_non_negative_int, default=200,
                   help="linear warm-up steps (default %(default)s)")
    t.add_argument("--log-every", type=_positive_int, default=None,
                   help="read device-side metrics every N steps (default: --size, 10 or 50)")
    t.add_argument("--eval-every", type=_positive_int, default=None,
                   help="validate and checkpoint every N steps (default: --size, 100 or 1000)")
    t.add_argument("--eval-chars", type=_positive_int, default=None,
                   help="validation characters per evaluation (default: --size)")
    d = p.add_argument_group("decoupled forward/backward training (PD-ASGD, one device; docs/decoupled.md)")
    d.add_argument("--decoupled", type=_ratio, nargs="?", const=DecoupledConfig(), default=None, metavar="F:B",
                   help="one forward worker and B backward workers applying layer-wise updates as gradients "
                        "arrive (F must be 1; default 1:2 when given alone)")
    d.add_argument("--max-in-flight", type=_positive_int, default=None, metavar="N",
                   help="items forwarded and not yet applied (default B + 1; 1 is synchronous-equivalent)")
    d.add_argument("--straggler-ms", type=_non_negative_float, default=None, metavar="MS",
                   help="delay backward worker 0 by MS milliseconds per item (a deliberate straggler)")
    e = p.add_argument_group("evolving topology (sparse models only; torch_sparse_metal.evolve)")
    e.add_argument("--prune-every", type=_positive_int, default=None,
                   help="prune and regrow the sparse layers every N steps (default: fixed topology)")
    e.add_argument("--grow", type=_fraction, default=None, metavar="DENSITY",
                   help="grow each sparse layer's edge count linearly toward DENSITY (>= --density)")
    e.add_argument("--grow-until", type=_run_fraction, default=0.5,
                   help="fraction of the run by which --grow is reached (default %(default)s)")
    e.add_argument("--drop-fraction", type=_run_fraction, default=0.3,
                   help="fraction of edges pruned at the first update, decaying on a cosine (default %(default)s)")
    e.add_argument("--prune-stop", type=_run_fraction, default=0.75,
                   help="fraction of the run after which the topology stays fixed (default %(default)s)")
    e.add_argument("--regrow", choices=["set", "rigl"], default="set",
                   help="where new edges go: at random (SET) or by dense-gradient magnitude (RigL)")
    e.add_argument("--prune-to", type=_fraction, default=None, metavar="DENSITY",
                   help="gradual magnitude pruning instead of prune-and-regrow: from --density (e.g. 1) down to "
                        "DENSITY on a cubic schedule (Zhu & Gupta), every --prune-every steps until --prune-stop of "
                        "the run (needs --steps)")
    e.add_argument("--min-salient", type=_positive_int, default=None, metavar="N",
                   help="SRigL's neuron ablation with --constant-fan-in: at each update an output with fewer than N "
                        "salient weights loses its inputs, which go to the other outputs (one process only)")
    return p


def _fill_size_defaults(args, device_type: str) -> None:
    """Options left unset take the ``--size`` preset's values."""
    size = args.size if args.size != "auto" else ("small" if device_type == "cpu" else "base")
    for name, value in SIZES[size].items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def _configs(args, vocab_size: int):
    from .loop import TrainConfig
    from .model import ModelConfig

    model_cfg = ModelConfig(vocab_size=vocab_size, context=args.context, d_model=args.d_model, n_layers=args.layers,
                            n_heads=args.heads, density=args.density, block=args.block, sparse=True,
                            backward=args.backward, dropout=args.dropout, distribution=args.distribution,
                            constant_fan_in=args.constant_fan_in)
    if args.dense:
        model_cfg = model_cfg.dense_equivalent()
    minutes = args.minutes if args.minutes is not None or args.steps is not None else DEFAULT_MINUTES
    train_cfg = TrainConfig(
        steps=args.steps, minutes=minutes, batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps,
        log_every=args.log_every, eval_every=args.eval_every, eval_chars=args.eval_chars, seed=args.seed,
        dtype=args.dtype,
        prune_every=args.prune_every or 0, drop_fraction=args.drop_fraction, regrow=args.regrow, grow_to=args.grow,
        grow_until=args.grow_until, prune_stop=args.prune_stop, prune_to=args.prune_to, min_salient=args.min_salient,
        data=str(args.data.resolve()) if args.data is not None else None,
    )
    return model_cfg, train_cfg


#: Options that --resume takes from the checkpoint (the model and training settings), by destination.
_FROM_CHECKPOINT = {
    "model_config": {"density": "density", "distribution": "distribution", "block": "block", "backward": "backward",
                     "constant_fan_in": "constant_fan_in", "d_model": "d_model",
                     "layers": "n_layers", "heads": "n_heads", "context": "context", "dropout": "dropout"},
    "train_config": {"batch_size": "batch_size", "lr": "lr", "warmup_steps": "warmup_steps", "seed": "seed",
                     "log_every": "log_every", "eval_every": "eval_every", "eval_chars": "eval_chars",
                     "prune_every": "prune_every", "grow": "grow_to", "grow_until": "grow_until",
                     "drop_fraction": "drop_fraction", "prune_stop": "prune_stop", "regrow": "regrow",
                     "prune_to": "prune_to", "min_salient": "min_salient",
                     "dtype": "dtype"},
}


def _given(parser: argparse.ArgumentParser, argv: list[str]) -> set[str]:
    """Destinations of the options written on the command line (``--x v`` or ``--x=v``)."""
    words = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    return {a.dest for a in parser._actions if words & set(a.option_strings)}


def _prepare_resume(parser: argparse.ArgumentParser, args, argv: list[str]) -> dict:
    """Read the --resume checkpoint; take --data from it when not given; report what it overrides."""
    from .loop import Trainer

    try:
        _, state = Trainer.read_checkpoint(args.resume)
    except (FileNotFoundError, ValueError) as exc:
        parser.error(str(exc))
    stored = state["train_config"].get("data")
    if args.data is None and stored is not None:
        if not Path(stored).exists():
            parser.error(f"--resume: the run was trained on --data {stored}, which no longer exists; pass --data")
        args.data = Path(stored)
        print(f"--resume: using --data {stored} from the checkpoint")
    state["train_config"].setdefault("dtype", "float32")  # a checkpoint without a dtype trained in float32
    state["model_config"].setdefault("constant_fan_in", False)  # nor one without the flag with constant fan-in
    given = _given(parser, argv)
    for part, names in _FROM_CHECKPOINT.items():
        for dest, key in names.items():
            value = state[part].get(key)
            if dest in given and getattr(args, dest) != value:
                option = "--" + dest.replace("_", "-")
                print(f"--resume: ignoring {option} {getattr(args, dest)}: the checkpoint's run has {value}")
    if "dense" in given and args.dense == state["model_config"].get("sparse", True):
        print("--resume: ignoring --dense: the checkpoint's model decides sparse or dense")
    return state


def _check_dtype(parser: argparse.ArgumentParser, device, dtype: str, state: dict | None) -> None:
    """The device autocasts to --dtype in this torch (torch.autocast may otherwise just warn and run float32)."""
    supported = autocast_dtypes(device)
    if dtype not in supported:
        whose = "the checkpoint's run trains in" if state is not None else "--dtype"
        parser.error(f"{whose} {dtype}, which torch {torch.__version__} cannot autocast to on {device.type}; "
                     f"supported there: --dtype {' or '.join(supported)}")


def _check_not_replacing(parser: argparse.ArgumentParser, args, out: Path, described: str) -> None:
    """A run writes into ``out`` only where it holds no other run's files (a resumed run's own folder is its
    run's), unless --overwrite."""
    if args.overwrite:
        return
    if args.resume is not None:
        own = args.resume if args.resume.is_dir() else args.resume.parent
        if own.resolve() == out.resolve():
            return
    found = [name for name in RUN_FILES if (out / name).exists()]
    if found:
        parser.error(f"{described} holds another run's {', '.join(found)}: continue that run with --resume {out}, "
                     "give another --out, or pass --overwrite to replace them")


def _out_dir(args) -> tuple[Path, str]:
    """Where the run writes, and that folder described as the user chose it (for a message)."""
    if args.out is not None:
        return args.out, f"--out {args.out}"
    if args.resume is not None:
        folder = args.resume if args.resume.is_dir() else args.resume.parent
        return folder, f"the --resume run's folder {folder} (give --out to write elsewhere)"
    kind = "dense" if args.dense else "sparse"
    out = Path("runs") / f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    return out, f"the default output folder {out} (give --out)"


def load_corpus_checked(parser: argparse.ArgumentParser, data: Path | None, allow_download: bool = True, log=None):
    """The corpus of --data (:func:`.data.load_corpus`); one that cannot be read is a usage error naming --data."""
    from .data import load_corpus

    try:
        return load_corpus(data, allow_download=allow_download, log=log)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        message = str(exc)
        parser.error(message if message.startswith("--data") else f"--data {data}: {message}")


def check_corpus_fits(parser: argparse.ArgumentParser, corpus, context: int, eval_chars: int | None,
                      resumed: bool = False) -> None:
    """Each split the run reads holds one window of --context characters, and --eval-chars covers one
    (checked before training; a resumed run takes both from its checkpoint)."""
    whose = "the checkpoint's " if resumed else ""
    # A training window draws context + 1 characters from below len - context; an evaluation predicts context.
    for name, split, extra in (("training", corpus.train, 2), ("validation", corpus.valid, 1)):
        have = split.numel()
        if have < context + extra:
            smaller = f" or a smaller --context (at most {have - extra})" if not resumed and have > extra else ""
            parser.error(f"the {name} split of {corpus.source} has {have:,} characters; one {name} window of "
                         f"{whose}--context {context} needs {context + extra:,}: give a larger --data{smaller}")
    if eval_chars is not None and eval_chars < context:
        fix = f"give --eval-chars {context} or more" if not resumed else "the checkpoint's run cannot be evaluated"
        parser.error(f"{whose}--eval-chars {eval_chars} is smaller than {whose}--context {context}: an evaluation "
                     f"needs at least one window; {fix}")


def check_density(parser: argparse.ArgumentParser, density: float, d_model: int, block: int = 1,
                  constant_fan_in: bool = False) -> None:
    """Every sparse matrix keeps at least one connection, a whole vector of ``block`` outputs when ``block`` > 1,
    and with ``constant_fan_in`` one input for every output (the smallest matrix is --d-model x --d-model; counted
    as the layers count them)."""
    if constant_fan_in and CSRTopology.random_edge_count(d_model, d_model, density, constant_fan_in=True) < 1:
        parser.error(f"--density {density:g} with --constant-fan-in gives the outputs of the {d_model}x{d_model} "
                     f"matrices of --d-model {d_model} round({density:g} * {d_model}) = 0 inputs each: give --density "
                     f"{1 / d_model:.3g} or more")
    if CSRTopology.random_edge_count(d_model, d_model, density, block=block) < 1:
        what = "a connection" if block == 1 else f"a vector (--block {block}: {block} connections)"
        parser.error(f"--density {density:g} leaves the {d_model}x{d_model} matrices of --d-model {d_model} without "
                     f"{what}: give --density {block / d_model**2:.3g} or more")


def check_schedule(parser: argparse.ArgumentParser, args) -> None:
    """An evolving topology (--prune-every) can regrow what each update drops, in every sparse matrix: the schedule's
    own construction check (:class:`~torch_sparse_metal.evolve.DynamicSparsity` refuses a schedule that cannot keep
    its edge count), made on one layer of each shape on the meta device before any work, as a usage error."""
    if args.prune_every is None or args.dense or args.prune_to is not None:  # gradual pruning grows nothing
        return
    from .model import ModelConfig

    cfg = ModelConfig(vocab_size=1, d_model=args.d_model, density=args.density, block=args.block,
                      distribution=args.distribution)
    # A constant fan-in layer's check reads its in-degree, which a layer on the meta device does not have: it is drawn
    # on the CPU (small: one matrix of each shape).
    device = "cpu" if args.constant_fan_in else "meta"
    for n_in, n_out in sorted(set(cfg.block_shapes())):
        layer = SparseLinear(n_in, n_out, density=cfg.layer_density(n_in, n_out), block=args.block, device=device,
                             constant_fan_in=args.constant_fan_in, generator=torch.Generator().manual_seed(0))
        try:
            DynamicSparsity([layer], torch.optim.SGD(layer.parameters(), lr=0.0), prune_every=args.prune_every,
                            total_steps=args.steps, drop_fraction=args.drop_fraction, stop_fraction=args.prune_stop,
                            grow_to=args.grow, grow_until=args.grow_until, mode=args.regrow,
                            min_salient=args.min_salient)
        except ValueError as exc:
            grow = f", --grow {args.grow:g}" if args.grow is not None else ""
            parser.error(f"--prune-every {args.prune_every} with --density {args.density:g}{grow} and --drop-fraction "
                         f"{args.drop_fraction:g}, in the {n_in}x{n_out} matrices: {exc}")


def _check_graphs(parser: argparse.ArgumentParser, args, device, launch: Launch | None,
                  decoupled: DecoupledConfig | None) -> None:
    """--graphs only where the step can be captured: CUDA, one process, the synchronous loop."""
    if not args.graphs:
        return
    from .loop import graphs_refusal

    why = graphs_refusal(device, launch.world_size if launch is not None else 1)
    if why is None and decoupled is not None:
        why = "not with --decoupled, whose workers apply updates from Python threads as gradients arrive"
    if why is not None:
        parser.error(f"--graphs: {why}")


def _decoupled(parser: argparse.ArgumentParser, args) -> DecoupledConfig | None:
    """The --decoupled configuration with its options, or None; refused combinations are usage errors."""
    if args.decoupled is None:
        for option, value in (("--max-in-flight", args.max_in_flight), ("--straggler-ms", args.straggler_ms)):
            if value is not None:
                parser.error(f"{option} configures the decoupled mode: give --decoupled F:B with it")
        return None
    config = dataclasses.replace(args.decoupled, max_in_flight=args.max_in_flight,
                                 straggler_ms=args.straggler_ms or 0.0)
    if args.prune_every is not None or args.grow is not None:
        parser.error("--decoupled: an evolving topology (--prune-every/--grow) changes parameters that backward "
                     "workers update concurrently; it is not supported with --decoupled")
    # A resumed run's dtype and topology schedule come from its checkpoint, checked once that is read.
    why = refusal(argparse.Namespace(dtype=args.dtype if args.resume is None else "float32", prune_every=0))
    if why is not None:
        parser.error(f"--decoupled: {why}")
    return config


def check_args(parser: argparse.ArgumentParser, args, device: torch.device, launch: Launch | None = None
               ) -> DecoupledConfig | None:
    """Every check of the parsed arguments that needs neither the corpus nor a checkpoint, in place (the --size
    defaults filled in for ``device``): usage errors through ``parser``. Returns the --decoupled configuration."""
    _fill_size_defaults(args, device.type)
    if args.dense:
        _refuse_sparse_only(parser, args)
    if args.grow is not None and args.prune_every is None:
        parser.error("--grow needs --prune-every: edges are added at the topology updates")
    if args.prune_to is not None:
        if args.prune_every is None or args.grow is not None or args.regrow != "set":
            parser.error("--prune-to (gradual pruning) needs --prune-every and takes neither --grow nor --regrow")
        if args.prune_to > args.density:
            parser.error(f"--prune-to {args.prune_to} is above --density {args.density}: gradual pruning only removes")
        if args.resume is None and args.steps is None:
            parser.error("--prune-to needs a --steps budget: its schedule counts steps")
    if args.grow is not None and args.grow < args.density:
        parser.error(f"--grow {args.grow} is below --density {args.density}: the schedule only grows")
    _check_fan_in(parser, args, launch)
    decoupled = _decoupled(parser, args)
    _check_graphs(parser, args, device, launch, decoupled)
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads}")
    if args.resume is None:  # a resumed run's model comes from its checkpoint
        # --dense sizes its twin from the sparse model of these options, so they must describe one
        if args.d_model % args.block:
            parser.error(f"--d-model {args.d_model} must be a multiple of --block {args.block} (whole vectors)")
        check_density(parser, args.density, args.d_model, args.block, args.constant_fan_in)
        check_schedule(parser, args)
    return decoupled


def _check_fan_in(parser: argparse.ArgumentParser, args, launch: Launch | None) -> None:
    """--constant-fan-in and --min-salient only where they work: constant fan-in keeps each output's in-degree, so
    it takes no --grow; ablation (--min-salient) acts at prune-and-regrow updates of constant fan-in layers, in one
    process. A resumed run takes both from its checkpoint, checked when that run started."""
    if args.resume is not None:
        return
    if args.constant_fan_in and args.grow is not None:
        parser.error("--grow does not apply with --constant-fan-in: the updates keep each output's in-degree (grow "
                     "the density of a constant fan-in model with a larger --density instead)")
    if args.min_salient is None:
        return
    if not args.constant_fan_in:
        parser.error("--min-salient (SRigL's neuron ablation) needs --constant-fan-in: it shares a layer's edges among "
                     "the outputs it keeps, one in-degree for all")
    if args.prune_every is None or args.prune_to is not None:
        parser.error("--min-salient needs --prune-every without --prune-to: outputs are ablated at prune-and-regrow "
                     "updates, and gradual pruning regrows nothing")
    if launch is not None:
        parser.error("--min-salient is not available under torchrun: the edge counts of an ablating update are known "
                     "only once rank 0 has planned it")


def _refuse_sparse_only(parser: argparse.ArgumentParser, args) -> None:
    """A usage error naming each option of :data:`SPARSE_ONLY` set to other than its default (so that it would
    change a sparse model), for a ``--dense`` run, which has no sparse layers."""
    options = ["--" + dest.replace("_", "-") for dest in SPARSE_ONLY if getattr(args, dest) != parser.get_default(dest)]
    if options:
        parser.error(f"{', '.join(options)} {'configures' if len(options) == 1 else 'configure'} sparse layers only "
                     "(their backward strategy or evolving topology) and cannot be combined with --dense, whose model "
                     "has dense nn.Linear layers")


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status. Under torchrun, ranks other than 0 print nothing to stdout."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    try:
        launch = torchrun_launch()
    except ValueError as exc:
        parser.error(str(exc))
    with contextlib.ExitStack() as stack:
        if launch is not None and launch.rank != 0:
            stack.enter_context(contextlib.redirect_stdout(stack.enter_context(open(os.devnull, "w"))))
        stack.callback(destroy_process_group)
        return _run(parser, args, argv, launch)


def _run(parser: argparse.ArgumentParser, args, argv: list[str], launch: Launch | None) -> int:
    from .decoupled import DecoupledTrainer
    from .loop import Trainer, TrainingDiverged, pick_device
    from .report import format_table

    try:
        device = pick_device(str(args.device))
        if launch is not None:
            device = process_device(device, launch)
    except (RuntimeError, ValueError) as exc:
        parser.error(str(exc))
    decoupled = check_args(parser, args, device, launch)
    if launch is not None:  # the arguments are checked; from here on the processes work together
        init_process_group(device, args.dist_timeout)
    state = _prepare_resume(parser, args, argv) if args.resume is not None else None
    if decoupled is not None and state is not None:
        from .loop import TrainConfig

        why = refusal(TrainConfig(**{**state["train_config"], "steps": 1, "minutes": None}))
        if why is not None:
            parser.error(f"--decoupled with the checkpoint's run: {why}")
    _check_dtype(parser, device, state["train_config"]["dtype"] if state else args.dtype, state)
    out, described = _out_dir(args)
    if launch is None or launch.rank == 0:  # the one process that writes
        _check_not_replacing(parser, args, out, described)
        argtypes.check_writable(parser, out, described)
    quiet = launch is not None and launch.rank != 0  # every rank loads the same corpus; rank 0 says which
    corpus = load_corpus_checked(parser, args.data, allow_download=not args.offline,
                                 log=(lambda _msg: None) if quiet else None)
    if state is None:
        check_corpus_fits(parser, corpus, args.context, args.eval_chars, resumed=False)
    else:
        check_corpus_fits(parser, corpus, state["model_config"]["context"], state["train_config"]["eval_chars"],
                           resumed=True)
    progress = not args.no_progress
    if args.resume is not None:
        try:
            kind = Trainer if decoupled is None else DecoupledTrainer
            trainer = kind.resume(args.resume, corpus, device, out_dir=out, progress=progress, state=state,
                                  graphs=args.graphs, steps=args.steps, minutes=args.minutes)
        except ValueError as exc:  # another corpus's vocabulary, or contents that do not load
            parser.error(str(exc))
        if decoupled is not None:
            trainer.decoupled = decoupled
        if trainer.finished():
            budget = f"{trainer.cfg.steps} steps" if trainer.cfg.steps is not None else f"{trainer.cfg.minutes:g} min"
            print(f"--resume: the run in {trainer.out_dir} is finished (step {trainer.step}, budget {budget}); to "
                  f"train on, give a larger budget: --steps N (N > {trainer.step}) or --minutes M "
                  f"(M > {trainer.elapsed / 60:.2f})")
            return 0
    else:
        model_cfg, train_cfg = _configs(args, corpus.vocab.size)
        try:  # builds the model and the topology schedule, which refuse what the checks above may not know of
            if decoupled is None:
                trainer = Trainer(model_cfg, train_cfg, corpus, device, out_dir=out, progress=progress,
                                  graphs=args.graphs)
            else:
                trainer = DecoupledTrainer(model_cfg, train_cfg, corpus, device, out_dir=out, progress=progress,
                                           decoupled=decoupled)
        except ValueError as exc:
            parser.error(str(exc))
    if launch is None or launch.rank == 0:
        _cli.print_openmp_note(device)
    cfg = trainer.model_cfg
    block = (f", block {cfg.block}" if cfg.block > 1 else "") + (", constant fan-in" if cfg.constant_fan_in else "")
    kind = "dense" if not cfg.sparse else f"sparse (density {cfg.density:g}{block}, backward {cfg.backward})"
    print(f"model: {kind}, d_model {cfg.d_model}, {cfg.n_layers} layers, context {cfg.context}; "
          f"{trainer.model.n_params():,} parameters, {trainer.model.block_weights():,} block weights; "
          f"device {device}, {trainer.cfg.dtype}{', CUDA graphs' if args.graphs else ''}; "
          f"batch {trainer.cfg.batch_size}{_processes(launch, trainer)}; "
          f"out {trainer.out_dir}", flush=True)
    if decoupled is not None:
        dcfg = trainer.decoupled
        print(f"decoupled (PD-ASGD): {dcfg.forward} forward and {dcfg.backward} backward workers, at most "
              f"{dcfg.in_flight} items in flight" + (f", backward worker 0 delayed {dcfg.straggler_ms:g} ms per item"
                                                     if dcfg.straggler_ms else ""), flush=True)
    try:
        summary = trainer.fit()
    except TrainingDiverged as exc:
        if launch is None or launch.rank == 0:  # every rank diverges at the same read
            print(f"error: {exc}", file=sys.stderr)
        return 1
    print(format_table(summary))
    print(f"log: {trainer.out_dir / 'log.json'}  plot: {trainer.out_dir / 'bpc.png'}  "
          f"checkpoint: {trainer.out_dir / 'checkpoint.pt'}")
    return 0


def _processes(launch: Launch | None, trainer) -> str:
    """The launch, as the model line reports it."""
    if launch is None:
        return ""
    return (f" per process x {launch.world_size} processes (torchrun) = {trainer.cfg.batch_size * launch.world_size} "
            "windows a step")
