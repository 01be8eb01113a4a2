"""The training loop: a sync-free steady-state step, periodic metric reads and evaluation, checkpoint/resume.

The steady-state step (:meth:`Trainer.train_step`) draws its batch on the device, runs forward, backward,
gradient clipping and a fused AdamW update, and adds the loss to a device accumulator. Nothing in it reads a
tensor on the host or branches on a tensor's value, so the host queues step after step while the device
works (docs/training.md, "The sync-free step"). The host waits only every ``log_every`` steps (one read of the
accumulated loss), at evaluations and checkpoints, and on the few sampled steps whose forward and backward are
timed (the step after the first metric read and the step after each evaluation).

With ``dtype`` bfloat16 or float16 the forward and the loss run under ``torch.autocast`` while the parameters
and the optimizer state stay float32 (mixed precision); float16 scales the loss with a ``torch.amp.GradScaler``,
whose skipped steps and scale updates stay on the device with the fused AdamW.

A run whose training loss (read every ``log_every`` steps), validation BPC, weights or optimizer moments
(checked before each checkpoint, where the host waits anyway) stop being finite raises
:class:`TrainingDiverged` and leaves the last good checkpoint as it was.

A checkpoint holds the model, the optimizer, the loss scaler, the RNG states, the sampler's position, the step,
the training time and the metric accumulators, so a resumed run on the CPU continues bitwise as an
uninterrupted one.

Under torch.distributed (``torchrun``; :mod:`.launch`) the model trains through a ``DistributedDataParallel``
wrapper (rebuilt after each topology update), each rank draws its own windows, and the ranks agree, at the
metric reads that wait anyway, on the mean training loss and on the training clock, from which every rank
derives the same learning rate and stop step; rank 0 alone shows progress and writes checkpoints and reports
(docs/training.md, "Several GPUs (torchrun)"). In one process none of this runs.

Example:
    >>> corpus = CharCorpus.from_splits("abcdefgh" * 200, "abcdefgh" * 20, "abcdefgh" * 20, "inline")
    >>> mcfg = ModelConfig(vocab_size=corpus.vocab.size, context=16, d_model=32, n_layers=1, n_heads=2)
    >>> trainer = Trainer(mcfg, TrainConfig(steps=4, batch_size=4, log_every=2, eval_every=4), corpus, "cpu",
    ...                   progress=False, verbose=False)
    >>> summary = trainer.fit()
    >>> summary["steps"]
    4
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NoReturn

import torch
from torch import nn
from tqdm.auto import tqdm

from torch_sparse_metal import SparseLinear, check_index_errors, devices
from torch_sparse_metal.distributed import rewrap, wrap
from torch_sparse_metal.evolve import DynamicSparsity
from torch_sparse_metal.pruning import GradualPruning
from torch_sparse_metal.strategy import resolve_strategy
from torch_sparse_metal_tools.progress import progress_bar

from .data import CharCorpus, WindowSampler, check_eval_fits, eval_windows
from .graphs import GraphedStep
from .launch import max_over_ranks, mean_over_ranks_, rank_and_world, rank_seed
from .metrics import DeviceMean, PhaseTimer, StepClock, median_window_ms, nats_to_bpc, synchronize
from .model import CharTransformer, ModelConfig

__all__ = ["DTYPES", "TrainConfig", "Trainer", "autocast_dtypes", "evaluate_bpc", "graphs_refusal", "pick_device"]

CHECKPOINT_NAME = "checkpoint.pt"
CHECKPOINT_FORMAT = 1
#: Training precisions: float32 throughout, or autocast to a 16-bit dtype over float32 master weights.
DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping. Exactly one of ``steps`` and ``minutes`` is the budget."""

    steps: int | None = None
    minutes: float | None = None
    batch_size: int = 64
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 200
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    log_every: int = 50
    eval_every: int = 1000
    eval_chars: int | None = 1 << 20
    eval_batch: int = 64
    seed: int = 0
    tf32: bool = True
    dtype: str = "float32"  # one of DTYPES: the autocast dtype of forward and loss; parameters stay float32
    # Evolving topology (torch_sparse_metal.evolve.DynamicSparsity); prune_every=0 keeps the topology fixed.
    prune_every: int = 0
    drop_fraction: float = 0.3
    regrow: str = "set"
    grow_to: float | None = None
    grow_until: float = 0.5
    prune_stop: float = 0.75
    # Gradual magnitude pruning (torch_sparse_metal.pruning) to this density instead of prune-and-regrow: every
    # prune_every steps until prune_stop of the run (steps budget only).
    prune_to: float | None = None
    # SRigL's neuron ablation (DynamicSparsity's min_salient) for constant fan-in layers; None: no ablation.
    min_salient: int | None = None
    # The --data the run was started with (kept in checkpoints, so that --resume finds the same corpus).
    data: str | None = None

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.minutes is None):
            raise ValueError("give exactly one budget: steps or minutes")
        if self.steps is not None and self.steps <= 0:
            raise ValueError(f"steps must be positive, got {self.steps}")
        if self.minutes is not None and not self.minutes > 0:
            raise ValueError(f"minutes must be positive, got {self.minutes}")
        for name in ("batch_size", "log_every", "eval_every", "eval_batch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.prune_every < 0:
            raise ValueError(f"prune_every must be >= 0 (0: fixed topology), got {self.prune_every}")
        if self.prune_to is not None and (self.steps is None or not self.prune_every):
            raise ValueError("prune_to (gradual pruning) needs a steps budget and prune_every")
        if self.min_salient is not None and (not self.prune_every or self.prune_to is not None):
            raise ValueError("min_salient (neuron ablation) needs prune_every, and not prune_to: outputs are ablated "
                             "at prune-and-regrow updates")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 < self.lr < math.inf:
            raise ValueError(f"lr must be a positive number, got {self.lr}")
        if self.eval_chars is not None and self.eval_chars <= 0:
            raise ValueError(f"eval_chars must be positive (None: the whole split), got {self.eval_chars}")
        if not 0 <= self.seed < 2**63:  # torch generators take 64 bits; the run also seeds seed + 1 and seed + 2
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")


class TrainingDiverged(RuntimeError):
    """The loss or the weights stopped being finite; the last good checkpoint was kept."""


DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"


def pick_device(name: str = "auto") -> torch.device:
    """``"auto"``: CUDA, then MPS, then CPU; otherwise the named device, checked to exist here (a ValueError or
    RuntimeError whose message names ``--device`` and the choices).

    Example:
        >>> pick_device("cpu")
        device(type='cpu')
    """
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:  # torch's message lists two dozen device types this program cannot train on
        raise ValueError(f"--device {name}: not a device name; use {DEVICE_CHOICES}") from None
    if devices.get(device.type) is None:
        raise ValueError(f"--device {name}: not a device to train on; use {DEVICE_CHOICES}")
    if device.type == "cuda":
        _check_cuda_index(name, device)
    elif device.index not in (None, 0):  # torch accepts cpu:1 and mps:1 and runs on the one device there is
        raise ValueError(f"--device {name}: {device.type} has one device, {device.type}; use {DEVICE_CHOICES}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise RuntimeError(f"--device {name}: MPS is not available on this machine; use {DEVICE_CHOICES}")
    return device


def _check_cuda_index(name: str, device: torch.device) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError(f"--device {name}: this torch has no usable CUDA device; use auto, cpu or mps")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise RuntimeError(f"--device {name}: this machine has {count} CUDA device{'s' * (count != 1)}, "
                           f"cuda:0 to cuda:{count - 1}")


@functools.cache
def autocast_dtypes(device: torch.device) -> tuple[str, ...]:
    """The :data:`DTYPES` this torch can train in on ``device``: float32, and each 16-bit dtype that a probe
    matmul under ``torch.autocast`` really computes in.

    An unsupported pair does not always raise: ``torch.autocast`` may only warn and run in float32, or fail at
    the first kernel (bfloat16 on older GPUs or macOS), so the probe runs one.

    Example:
        >>> autocast_dtypes(torch.device("cpu"))[0]
        'float32'
    """
    supported = ["float32"]
    if not torch.amp.autocast_mode.is_autocast_available(device.type):
        return tuple(supported)
    for name in DTYPES[1:]:
        dtype = getattr(torch, name)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", UserWarning)  # "target dtype is not supported. Disabling autocast"
                with torch.autocast(device.type, dtype=dtype):
                    a = torch.ones(2, 2, device=device)
                    works = (a @ a).dtype == dtype
        except (RuntimeError, TypeError, UserWarning):
            works = False
        if works:
            supported.append(name)
    return tuple(supported)


def _autocast(device: torch.device, dtype: str, cache_enabled: bool = True):
    """A factory of the forward's autocast context (a no-op for float32). ``cache_enabled=False`` under CUDA graphs
    (torch's rule: a cached cast would outlive the capture); the casts compute the same values either way."""
    if dtype == "float32":
        return contextlib.nullcontext
    return functools.partial(torch.autocast, device.type, dtype=getattr(torch, dtype), cache_enabled=cache_enabled)


def graphs_refusal(device: torch.device, world: int) -> str | None:
    """Why a run on ``device`` with ``world`` processes cannot capture its step in a CUDA graph (None: it can)."""
    if device.type != "cuda":
        return f"CUDA graphs capture CUDA work; this run is on {device.type}"
    if world > 1:
        return ("not under torchrun: DistributedDataParallel's gradient all-reduce would have to be captured too, "
                "and its wrapper is rebuilt after topology updates")
    return None


@torch.no_grad()
def evaluate_bpc(model: CharTransformer, tokens: torch.Tensor, max_chars: int | None, batch: int,
                 autocast=contextlib.nullcontext) -> float:
    """Bits per character of ``model`` on a split (first ``max_chars`` characters). One host read at the end.
    ``autocast``: the training step's autocast context factory, so the model is measured as it trains."""
    was_training = model.training
    model.eval()
    x, y = eval_windows(tokens, model.cfg.context, max_chars)
    total = torch.zeros((), dtype=torch.float32, device=tokens.device)
    for i in range(0, x.shape[0], batch):
        with autocast():
            total += model.loss(x[i : i + batch], y[i : i + batch], reduction="sum")
    model.train(was_training)
    return nats_to_bpc(total.item() / y.numel())


def _make_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device, capturable: bool = False
                    ) -> torch.optim.Optimizer:
    """AdamW with weight decay on the matrices (dense 2-D weights and sparse layers' values) only.

    The fused implementation keeps its step count on the device, so ``step()`` never reads a host scalar;
    where a device has no fused kernel, the default implementation is used. ``capturable``: for CUDA graphs (the
    fused kernel with its learning rate read from a device tensor, installed by the trainer).
    """
    decay, no_decay = [], []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            is_matrix = name == "weight" and isinstance(module, (nn.Linear, SparseLinear))
            (decay if is_matrix else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"lr": cfg.lr, "betas": (cfg.beta1, cfg.beta2)}
    if capturable:
        return torch.optim.AdamW(groups, fused=True, capturable=True, **kwargs)
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except RuntimeError:
        return torch.optim.AdamW(groups, **kwargs)


def _ddp_kwargs(device: torch.device) -> dict:
    """``DistributedDataParallel``'s arguments: the process's GPU, and no broadcast of buffers at every forward.
    The only buffers are the sparse layers' topologies, which every rank builds from the same seed and which
    ``DynamicSparsity`` changes identically (checking at each update that the ranks agree)."""
    params = inspect.signature(nn.parallel.DistributedDataParallel).parameters
    no_sync = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"  # the newer name
    return {no_sync: False, **({"device_ids": [device]} if device.type == "cuda" else {})}


class Trainer:
    """Trains a :class:`CharTransformer` on a :class:`CharCorpus`; see the module docstring.

    ``out_dir`` receives ``checkpoint.pt`` at every evaluation and at the end; ``progress`` shows a tqdm bar
    whose postfix changes only when metrics are read (without a terminal: a plain line at least every 30 s,
    :mod:`torch_sparse_metal_tools.progress`); ``verbose`` prints one line per evaluation. Under
    torch.distributed only rank 0 writes, shows progress and prints.

    ``graphs=True`` (CUDA, one process) captures the step in a CUDA graph and replays it (:mod:`.graphs`;
    docs/training.md, "Graph capture"): topology updates that keep the edge count are written in place, one that
    changes it captures again. Results equal the eager step's bitwise where its kernels are deterministic and the
    learning rate is a float32 value (the capturable AdamW reads it as a float32 device tensor).
    """

    def __init__(self, model_cfg: ModelConfig, cfg: TrainConfig, corpus: CharCorpus, device: torch.device | str,
                 *, out_dir: str | os.PathLike | None = None, progress: bool = True, verbose: bool = True,
                 graphs: bool = False) -> None:
        self.device = torch.device(device)
        if cfg.dtype not in autocast_dtypes(self.device):
            raise ValueError(f"dtype {cfg.dtype}: this torch cannot autocast to it on {self.device.type}; "
                             f"supported there: {', '.join(autocast_dtypes(self.device))}")
        check_eval_fits(corpus, model_cfg.context, cfg.eval_chars)
        self.model_cfg, self.cfg = model_cfg, cfg
        self.corpus = corpus.to(self.device)
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.rank, self.world = rank_and_world()
        if graphs and (why := graphs_refusal(self.device, self.world)) is not None:
            raise ValueError(f"graphs: {why}")
        self.progress, self.verbose = progress and self.rank == 0, verbose and self.rank == 0
        if self.device.type == "cuda" and cfg.tf32:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        torch.manual_seed(cfg.seed)
        self.model = CharTransformer(model_cfg, generator=torch.Generator().manual_seed(cfg.seed)).to(self.device)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = _make_optimizer(self.model, cfg, self.device, capturable=graphs)
        # Under graphs the learning rate is a device tensor the host refills before each step (_set_lr)
        self._lr = torch.full((), cfg.lr, dtype=torch.float32, device=self.device) if graphs else None
        self._lr_host = cfg.lr
        self._install_lr()
        self.autocast = _autocast(self.device, cfg.dtype, cache_enabled=not graphs)
        # float16's narrow range needs loss scaling; a disabled scaler passes everything through (one code path).
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=cfg.dtype == "float16")
        self.evolve = self._make_evolve(in_place=graphs) if cfg.prune_every and model_cfg.sparse else None
        self.sampler = WindowSampler(self.corpus.train, model_cfg.context, cfg.batch_size, seed=cfg.seed + 1)
        self._seed_own_streams(0)
        # The model as trained: a DistributedDataParallel wrapper under torch.distributed, else the model itself.
        self.ddp = wrap(self.model, **_ddp_kwargs(self.device))
        self._pace = (0, 0.0, 0.0)  # (step, agreed training time, seconds per step) at the last read; see _progress
        self.train_loss = DeviceMean(self.device)
        self.timer = PhaseTimer(self.device)
        self.step = 0
        self.elapsed = 0.0
        self.history: dict[str, list[list[float]]] = {"train": [], "val": []}
        self.best_val = math.inf
        self.window_ms: list[float] = []
        self._postfix: dict[str, str] = {}
        self.saved: tuple[Path, int] | None = None  # (file, step) of the last checkpoint this run wrote or resumed
        self.graphed = GraphedStep(self._graph_body, self.device, prepare=self._zero_grad) if graphs else None

    def _seed_own_streams(self, step: int) -> None:
        """Ranks other than 0 draw their own windows and dropout masks, from ``--seed``, the rank and the step
        the run (re)starts at; rank 0 keeps the single-process streams (restored from a checkpoint on resume)."""
        if self.rank == 0:
            return
        self.sampler.generator.manual_seed(rank_seed(self.cfg.seed, self.rank, step, "windows"))
        torch.manual_seed(rank_seed(self.cfg.seed, self.rank, step, "dropout"))

    def _make_evolve(self, in_place: bool) -> DynamicSparsity | GradualPruning:
        cfg = self.cfg
        if cfg.prune_to is not None:  # each layer to its share of prune_to, as --distribution shares --density
            final = dataclasses.replace(self.model_cfg, density=cfg.prune_to)
            finals = {name: final.layer_density(m.in_features, m.out_features)
                      for name, m in self.model.named_modules() if isinstance(m, SparseLinear)}
            return GradualPruning(self.model, self.optimizer, final_density=finals, prune_every=cfg.prune_every,
                                  end_step=max(int(cfg.prune_stop * cfg.steps), 1))
        return DynamicSparsity(self.model, self.optimizer, prune_every=cfg.prune_every, total_steps=cfg.steps,
                               drop_fraction=cfg.drop_fraction, stop_fraction=cfg.prune_stop, grow_to=cfg.grow_to,
                               grow_until=cfg.grow_until, mode=cfg.regrow, min_salient=cfg.min_salient,
                               generator=torch.Generator().manual_seed(cfg.seed + 2), in_place=in_place)

    def _install_lr(self) -> None:
        """Under graphs: every parameter group reads the learning-rate tensor, capturably (again after an optimizer
        state is loaded, which brings the saved groups' values)."""
        if self._lr is None:
            return
        for group in self.optimizer.param_groups:
            group["lr"], group["capturable"] = self._lr, True

    def _set_lr(self, lr: float) -> None:
        self._lr_host = lr
        if self._lr is not None:
            self._lr.fill_(lr)  # queued on the device: no host wait
        else:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    # ------------------------------------------------------------------------------------------ the step
    def lr_at(self, step: int, progress: float) -> float:
        """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr`` over the budget."""
        cfg = self.cfg
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        floor = cfg.lr * cfg.min_lr_ratio
        return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))

    def train_step(self, progress: float, timer: PhaseTimer | None = None) -> None:
        """One optimisation step with no host synchronisation (unless ``timer`` times its phases).

        ``progress`` is the fraction of the budget used, computed on the host (from the step or the clock). Under
        graphs the step is a replay, except the warm-up, timed steps and the steps RigL records (eager, see
        :mod:`.graphs`).
        """
        self._set_lr(self.lr_at(self.step, progress))
        graphed = self.graphed
        recorded = self.evolve is not None and self.evolve.records_next_step
        if graphed is None:
            self.train_loss.add(self._optimise(self.sampler.sample, timer))
        elif graphed.ready and timer is None and not recorded:
            graphed.replay(*self.sampler.sample())
            self.train_loss.count += 1
        else:
            with graphed.eager():
                self.train_loss.add(self._optimise(self.sampler.sample, timer))
        if self.evolve is not None and self._evolve_step(progress):  # between updates: one integer test
            self.ddp = rewrap(self.ddp)  # DDP's buckets hold the old parameter sizes
            if graphed is not None and not self.evolve.updated_in_place:
                graphed.invalidate()  # the edge count changed: the captured tensors were replaced
        self.step += 1

    def _evolve_step(self, progress: float) -> bool:
        """The topology schedule's step: DynamicSparsity runs on progress, GradualPruning on the step count."""
        return self.evolve.step() if isinstance(self.evolve, GradualPruning) else self.evolve.step(progress)

    def _optimise(self, batch, timer: PhaseTimer | None = None) -> torch.Tensor:
        """Draw ``batch()``, then forward, backward, clipping and the optimizer update: the device work of a step, also
        what a CUDA graph captures. Returns the (detached) loss."""
        phase = timer.phase if timer is not None else (lambda _name: contextlib.nullcontext())
        with phase("forward"):
            x, y = batch()
            with self.autocast():
                loss = self.ddp(x, y)  # the loss through the wrapper's forward, which DDP's gradient hooks follow
        with phase("backward"):
            self._zero_grad()
            self.scaler.scale(loss).backward()
            # Drop the graph: it holds the parameters' gradient accumulators, which a DDP wrapper rebuilt after
            # a topology update (rewrap) would otherwise reuse with the old sizes.
            loss = loss.detach()
        with phase("optimizer"):
            if self.cfg.grad_clip > 0:
                self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
                torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip, foreach=True)
            # The fused AdamW takes the scaler's inf flag on the device and skips the update there: no host read
            # (GradScaler would read the flag on the host to step an unfused optimizer).
            self.scaler.step(self.optimizer)
            self.scaler.update()
        return loss

    def _graph_body(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The captured step: :meth:`_optimise` on the static batch, and the loss added to the device accumulator."""
        self.train_loss.add_on_device(self._optimise(lambda: (x, y)))

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------------------------------ the loop
    def _progress(self, clock: StepClock) -> float:
        """The fraction of the budget used. With several ranks and a time budget, the clocks differ: every rank
        extrapolates from the training time and pace agreed at the last metric read (:meth:`_agree_elapsed`),
        so that all compute the same learning rate and stop at the same step with no per-step communication."""
        if self.cfg.steps is not None:
            return self.step / self.cfg.steps
        if self.world == 1:
            return clock.elapsed() / (self.cfg.minutes * 60.0)
        step, elapsed, seconds_per_step = self._pace
        return (elapsed + (self.step - step) * seconds_per_step) / (self.cfg.minutes * 60.0)

    def _agree_elapsed(self, clock: StepClock) -> float:
        """Training time so far; with several ranks the slowest rank's (an all-reduce at a read, which waits
        anyway), also kept with the pace since the previous read for :meth:`_progress`."""
        if self.world == 1:
            return clock.elapsed()
        elapsed = max_over_ranks(clock.elapsed(), self.device)
        step, previous, seconds_per_step = self._pace
        if self.step > step:
            seconds_per_step = (elapsed - previous) / (self.step - step)
        self._pace = (self.step, elapsed, seconds_per_step)
        return elapsed

    def fit(self, stop_step: int | None = None) -> dict:
        """Train until the budget is spent (or until ``stop_step``, to simulate an interruption: then only a
        checkpoint is written). Returns the run's summary (also written to ``out_dir/log.json``). Raises
        :class:`TrainingDiverged` at the first metric read whose training loss, or the first evaluation whose
        validation BPC, weights or optimizer state, is not finite: before a checkpoint would overwrite the last
        good one, and before any report or plot."""
        cfg = self.cfg
        clock = StepClock(self.elapsed, self.window_ms, step=self.step)
        self._pace = (self.step, self.elapsed, 0.0)  # the same on every rank: 0 or the checkpoint's
        total = cfg.steps if cfg.steps is not None else round(cfg.minutes * 60)
        bar = progress_bar(total=total, initial=self.step if cfg.steps is not None else round(self.elapsed),
                           unit="step" if cfg.steps is not None else "s", enabled=self.progress)
        try:
            return self._fit(clock, bar, stop_step)
        finally:
            bar.close()

    def _fit(self, clock: StepClock, bar, stop_step: int | None) -> dict:
        cfg = self.cfg
        profile_next = False
        interrupted = False
        while self._progress(clock) < 1.0:
            if stop_step is not None and self.step >= stop_step:
                interrupted = True
                break
            self.train_step(self._progress(clock), self.timer if profile_next else None)
            profile_next = False
            if cfg.steps is not None:
                bar.update(1)
            if self.step % cfg.log_every == 0:
                self._read_train(clock, bar)
                profile_next = len(self.history["train"]) == 1  # a first timing sample for short runs
            if self.step % cfg.eval_every == 0:
                self._evaluate(clock, bar)
                profile_next = True  # the sampled steps: after each evaluation, which left the queue empty
        return self._finish(clock, bar, interrupted)

    def _finish(self, clock: StepClock, bar, interrupted: bool) -> dict:
        """After the last step: a checkpoint only (``interrupted``), or the last read, evaluation and report."""
        synchronize(self.device)
        self.elapsed = clock.elapsed()
        if interrupted:
            self._check_finite()
            self.save()
            return self.summary()
        if self.train_loss.count:
            self._read_train(clock, bar)
        if not self.history["val"] or self.history["val"][-1][1] != self.step:
            self._evaluate(clock, bar)
        summary = self.summary()
        if self.out_dir is not None and self.rank == 0:
            from .report import write_report

            write_report(self.out_dir, summary)
        return summary

    def _read_train(self, clock: StepClock, bar) -> None:
        mean_over_ranks_(self.train_loss.total)  # every rank added the same number of losses
        nats = self.train_loss.read()  # the one host wait of the steady state, every log_every steps
        ms = clock.window(self.step)
        self.elapsed = self._agree_elapsed(clock)
        bpc = nats_to_bpc(nats)
        if not math.isfinite(bpc):  # already on the host: stop now rather than train on to the evaluation
            self._diverged("the training loss")
        self.history["train"].append([round(self.elapsed, 3), self.step, bpc])
        if self.cfg.minutes is not None:
            bar.n = min(round(self.elapsed), bar.total)
        self._postfix.update({"train_bpc": f"{bpc:.3f}", "ms/step": f"{ms:.1f}" if ms else "-"})
        bar.set_postfix(self._postfix, refresh=True)

    def _evaluate(self, clock: StepClock, bar) -> float:
        """Validation BPC, one printed line, and a checkpoint; none of it counts as training time."""
        clock.pause()
        self.elapsed = clock.elapsed()
        bpc = evaluate_bpc(self.model, self.corpus.valid, self.cfg.eval_chars, self.cfg.eval_batch, self.autocast)
        if not math.isfinite(bpc):
            self._diverged("the validation BPC")
        check_index_errors(self.device)  # the device was just read: index errors a GPU kernel recorded surface here
        self._check_finite()
        self.history["val"].append([round(self.elapsed, 3), self.step, bpc])
        self.best_val = min(self.best_val, bpc)
        self._postfix["val_bpc"] = f"{bpc:.3f}"
        bar.set_postfix(self._postfix, refresh=True)
        if self.verbose:
            train = self.history["train"][-1][2] if self.history["train"] else math.nan
            tqdm.write(f"step {self.step:>7,}  {self.elapsed:7.1f} s  train {train:.4f}  val {bpc:.4f} bpc")
        self.save()
        clock.resume(self.step)
        return bpc

    def _check_finite(self) -> None:
        """Before a checkpoint (the device is read there anyway): every weight and optimizer moment is finite,
        checked with one reduction and one host read."""
        tensors = self._state_tensors()
        if not tensors or bool(torch.stack([torch.isfinite(t).all() for _, t in tensors]).all()):
            return
        bad = [name for name, t in tensors if not bool(torch.isfinite(t).all())]  # the run is over: read each
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        self._diverged(f"{len(bad)} of {len(tensors)} weight and optimizer tensors ({shown})")

    def _state_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The floating-point tensors a checkpoint holds for the model and the optimizer, by name."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        found = [(name, p.detach()) for name, p in self.model.named_parameters()]
        for p, state in self.optimizer.state.items():
            found += [(f"{names.get(id(p), '?')} ({key})", t) for key, t in state.items()
                      if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() > 0]
        return found

    def _diverged(self, what: str) -> NoReturn:
        """Stop the run: ``what`` stopped being finite; the last checkpoint on disk is left as it is."""
        if self.saved is not None:
            kept = f"the checkpoint of step {self.saved[1]} in {self.saved[0]} is kept unchanged"
        else:
            kept = "no checkpoint was written"
        raise TrainingDiverged(f"training diverged at step {self.step}: {what} stopped being finite ({kept}); "
                               f"lower --lr (now {self.cfg.lr:g}) or raise --warmup-steps "
                               f"(now {self.cfg.warmup_steps})")

    # ------------------------------------------------------------------------------------------ results
    def summary(self) -> dict:
        """Everything the results table reports, plus the configuration and the curves."""
        phases = self.timer.medians()

        def last(key: str) -> float | None:
            return self.history[key][-1][2] if self.history[key] else None

        return {
            "name": "dense" if not self.model_cfg.sparse else f"sparse-d{self.model_cfg.density:g}",
            "device": devices.get(self.device.type).describe(self.device),
            "dtype": self.cfg.dtype,
            "torch": torch.__version__,
            "steps": self.step,
            "elapsed_s": round(self.elapsed, 2),
            "steps_per_s": round(self.step / self.elapsed, 3) if self.elapsed > 0 else None,
            "train_bpc": last("train"),
            "val_bpc": last("val"),
            "best_val_bpc": self.best_val if math.isfinite(self.best_val) else None,
            "median_step_ms": median_window_ms(self.window_ms),
            "fwd_ms": phases.get("forward"),
            "bwd_ms": phases.get("backward"),
            "opt_ms": phases.get("optimizer"),
            "timed_steps": len(self.timer.samples.get("forward", [])),
            "edges": self.model.block_weights(),
            "edges_history": self._edges_history(),
            "fan_in_history": self._fan_in_history(),
            "backward_resolved": self._resolved_backward(),
            "params": self.model.n_params(),
            "tokens_per_step": self.cfg.batch_size * self.model_cfg.context * self.world,
            "processes": self.world if self.world > 1 else None,
            "graphs": ({"captures": self.graphed.captures, "replays": self.graphed.replays}
                       if self.graphed is not None else None),
            "model": self.model_cfg.to_dict(),
            "train": asdict(self.cfg),
            "corpus": self.corpus.describe(),
            "history": self.history,
        }

    def _edges_history(self) -> list[list[int]]:
        """[step, total edges of the sparse layers, edges regrown by that update] at the start and after every
        topology update."""
        if self.evolve is None:
            return []
        return [[step, sum(counts), grown] for (step, counts), grown in zip(self.evolve.history, self.evolve.regrown)]

    def _fan_in_history(self) -> list[dict]:
        """Per update that changed a constant fan-in layer: the step, and per layer (by index) its fan-in, active
        outputs and the outputs neuron ablation removed or brought back."""
        reports = getattr(self.evolve, "fan_in_reports", [])
        return [{"step": step, "layers": {str(i): asdict(report) for i, report in layers.items()}}
                for step, layers in reports]

    def _resolved_backward(self) -> dict[str, str]:
        """The strategy each sparse layer shape's backward runs (``auto`` resolved from sizes, no device read)."""
        tokens = self.cfg.batch_size * self.model_cfg.context
        return {f"{m.in_features}x{m.out_features}": resolve_strategy(m.backward, self.device, m.in_features,
                                                                      m.out_features, m.nnz, tokens)
                for m in self.model.modules() if isinstance(m, SparseLinear)}

    # ------------------------------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        return {
            "format": CHECKPOINT_FORMAT,
            "model_config": self.model_cfg.to_dict(),
            "train_config": asdict(self.cfg),
            "vocab": list(self.corpus.vocab.chars),
            "model": self.model.state_dict(),
            "optimizer": self._optimizer_state(),
            "scaler": self.scaler.state_dict(),  # float16's loss scale and growth tracker ({} when disabled)
            "sampler": self.sampler.state_dict(),
            "rng": rng,
            "train_loss": self.train_loss.state_dict(),
            "step": self.step,
            "elapsed": self.elapsed,
            "history": self.history,
            "best_val": self.best_val,
            "window_ms": list(self.window_ms),
            "timer": self.timer.samples,
            "evolve": self.evolve.state_dict() if self.evolve is not None else None,
        }

    def _optimizer_state(self) -> dict:
        """The optimizer's state as an eager run saves it (a learning rate number, not capturable), so that a
        checkpoint resumes with or without graphs."""
        state = self.optimizer.state_dict()
        if self._lr is not None:
            for group in state["param_groups"]:
                group["lr"], group["capturable"] = self._lr_host, False
        return state

    def load_state_dict(self, state: dict) -> None:
        _check_vocab(self.corpus, state)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._install_lr()
        if state.get("scaler"):  # empty unless the run is float16, absent from older checkpoints
            self.scaler.load_state_dict(state["scaler"])
        if not self.sampler.load_state_dict(state["sampler"]):
            where = state["sampler"].get("device", "another device")
            warnings.warn(f"the checkpoint's training windows were drawn on {where}; on {self.device.type} they "
                          f"continue from a new seed, so the windows after step {state['step']} differ from an "
                          "uninterrupted run's", stacklevel=2)
        torch.set_rng_state(state["rng"]["cpu"])
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"], self.device)
        self.train_loss.load_state_dict(state["train_loss"])
        self.step, self.elapsed = state["step"], state["elapsed"]
        self.history, self.best_val = state["history"], state["best_val"]
        self.window_ms[:] = state["window_ms"]
        self.timer.samples = {k: list(v) for k, v in state["timer"].items()}
        if self.evolve is not None and state.get("evolve") is not None:
            self.evolve.load_state_dict(state["evolve"])
        self._seed_own_streams(self.step)
        self.ddp = rewrap(self.ddp)  # the checkpoint's topology may have other sizes than the one built

    def save(self, path: str | os.PathLike | None = None) -> Path | None:
        """Write the checkpoint (atomically: a temporary file, then a rename). Waits for the device. Under
        torch.distributed rank 0 alone writes (every rank holds the same state); the others return None."""
        if self.rank != 0:
            return None
        if path is None:
            if self.out_dir is None:
                return None
            path = self.out_dir / CHECKPOINT_NAME
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        torch.save(self.state_dict(), tmp)
        os.replace(tmp, path)
        self.saved = (path, self.step)
        return path

    def finished(self) -> bool:
        """True when the budget is spent (``fit`` would only evaluate and report)."""
        if self.cfg.steps is not None:
            return self.step >= self.cfg.steps
        return self.elapsed >= self.cfg.minutes * 60.0

    @staticmethod
    def read_checkpoint(path: str | os.PathLike) -> tuple[Path, dict]:
        """``(file, state)`` of a checkpoint file or of a run directory holding ``checkpoint.pt``; raises
        FileNotFoundError, or ValueError saying the file is not a training checkpoint of this program."""
        path = Path(path)
        if path.is_dir():
            path = path / CHECKPOINT_NAME
        if not path.is_file():
            raise FileNotFoundError(f"--resume {path}: no checkpoint there")
        try:
            with warnings.catch_warnings():  # a foreign file's unpickler warnings would precede the verdict below
                warnings.simplefilter("ignore")
                state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - torch's advice (weights_only=False) would load foreign code
            raise _not_ours(path, f"it cannot be read as a torch file ({type(exc).__name__}: truncated, corrupt, "
                                  "or written by another program)") from exc
        _check_checkpoint(path, state)
        return path, state

    @classmethod
    def resume(cls, path: str | os.PathLike, corpus: CharCorpus, device: torch.device | str, *,
               out_dir: str | os.PathLike | None = None, progress: bool = True, verbose: bool = True,
               state: dict | None = None, graphs: bool = False, **budget) -> Trainer:
        """A trainer restored from a checkpoint file (or a run directory holding ``checkpoint.pt``); ``state``:
        that file's contents when the caller has already read them (:meth:`read_checkpoint`). ``graphs``: as for
        the constructor, whatever the checkpoint's run used (it saves no graph state).

        ``budget`` may replace ``steps`` or ``minutes`` (to extend a finished run); the learning-rate schedule
        follows the new budget from then on.
        """
        if state is None:
            path, state = cls.read_checkpoint(path)
        else:
            path = Path(path) / CHECKPOINT_NAME if Path(path).is_dir() else Path(path)
        _check_vocab(corpus, state)  # its own message: the checkpoint is ours, the corpus is not its corpus
        train_cfg = dict(state["train_config"])
        if budget.get("steps") is not None or budget.get("minutes") is not None:
            train_cfg.update(steps=budget.get("steps"), minutes=budget.get("minutes"))
        trainer = cls(ModelConfig(**state["model_config"]), TrainConfig(**train_cfg), corpus, device,
                      out_dir=out_dir if out_dir is not None else path.parent, progress=progress, verbose=verbose,
                      graphs=graphs)
        try:
            trainer.load_state_dict(state)
        except (KeyError, TypeError, ValueError, RuntimeError, IndexError, AttributeError) as exc:
            detail = " ".join(str(exc).split())[:300]
            raise _not_ours(path, f"its contents do not load ({type(exc).__name__}: {detail})") from exc
        if trainer.out_dir is not None and trainer.out_dir.resolve() == path.parent.resolve():
            trainer.saved = (trainer.out_dir / CHECKPOINT_NAME, trainer.step)
        return trainer


#: Entries of a checkpoint and their types (what :meth:`Trainer.load_state_dict` reads).
_CHECKPOINT_ENTRIES = {
    "model_config": dict, "train_config": dict, "vocab": list, "model": dict, "optimizer": dict, "sampler": dict,
    "rng": dict, "train_loss": dict, "step": int, "elapsed": float, "history": dict, "best_val": float,
    "window_ms": list, "timer": dict,
}


def _check_vocab(corpus: CharCorpus, state: dict) -> None:
    """The checkpoint was trained on this corpus' vocabulary (else a ValueError that says so)."""
    if list(corpus.vocab.chars) != state["vocab"]:
        raise ValueError("the checkpoint was trained on another vocabulary: resume with the same --data")


def _not_ours(path: Path, why: str) -> ValueError:
    return ValueError(f"--resume {path} is not a training checkpoint of this program: {why}")


def _check_checkpoint(path: Path, state: object) -> None:
    """``state`` has the format marker, the entries and the settings of a checkpoint this program wrote."""
    if not isinstance(state, dict):
        raise _not_ours(path, f"it holds a {type(state).__name__}, not a checkpoint's dict")
    if state.get("format") != CHECKPOINT_FORMAT:
        raise _not_ours(path, f"it has format {state.get('format')!r}, this program writes {CHECKPOINT_FORMAT}")
    missing = [key for key in _CHECKPOINT_ENTRIES if key not in state]
    wrong = [key for key, kind in _CHECKPOINT_ENTRIES.items()
             if key in state and not isinstance(state[key], (int, float) if kind is float else kind)]
    if missing or wrong:
        what = [f"without {', '.join(missing)}"] * bool(missing) + [f"with a bad {', '.join(wrong)}"] * bool(wrong)
        raise _not_ours(path, f"it is a dict {' and '.join(what)}")
    try:
        ModelConfig(**state["model_config"])
        TrainConfig(**state["train_config"])
    except (TypeError, ValueError) as exc:
        raise _not_ours(path, f"its settings describe no run ({exc})") from exc
