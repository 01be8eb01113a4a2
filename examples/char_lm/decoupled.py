"""Decoupled forward and backward workers with layer-wise updates (PD-ASGD) on one device.

One forward worker (the calling thread) draws batches and runs the forward pass; ``backward`` worker threads
take its losses from a queue, run the backward pass and apply each parameter's AdamW update from a
post-accumulate-grad hook the moment that parameter's gradient exists. There is no global lock: a
parameter is guarded by its own lock, held only while its update is queued (docs/decoupled.md).

Parameters are read through a snapshot: each forward clones every parameter (a leaf of its own) and runs the
model on the clones with :func:`torch.func.functional_call`. The backward differentiates with respect to the
clones and applies the gradient to the live parameter. Updating the live parameters in place while a graph
that saved them is pending would fail ("modified by an inplace operation"); with snapshots each gradient is
exact for the weights its forward read, and staleness is the only approximation, the one PD-ASGD accepts.

Each parameter carries a version, incremented at each update; a forward records the versions it read, and an
update's staleness is the number of updates that parameter received in between.

Example:
    >>> from char_lm import CharCorpus, ModelConfig, TrainConfig
    >>> corpus = CharCorpus.from_splits("abcdefgh" * 200, "abcdefgh" * 20, "abcdefgh" * 20, "inline")
    >>> mcfg = ModelConfig(vocab_size=corpus.vocab.size, context=16, d_model=32, n_layers=1, n_heads=2)
    >>> trainer = DecoupledTrainer(mcfg, TrainConfig(steps=6, batch_size=4, log_every=3, eval_every=6), corpus,
    ...                            "cpu", decoupled=DecoupledConfig.parse("1:2"), progress=False, verbose=False)
    >>> summary = trainer.fit()
    >>> summary["steps"], summary["decoupled"]["updates"] == 6 * len(trainer.params)
    (6, True)
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import threading
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch.func import functional_call
from torch.optim.adamw import adamw

from .loop import Trainer
from .metrics import StepClock, synchronize

__all__ = ["DecoupledConfig", "DecoupledTrainer", "refusal"]


@dataclass(frozen=True)
class DecoupledConfig:
    """Worker counts and pipeline depth of the decoupled mode.

    ``max_in_flight``: items whose forward has begun and whose backward has not finished (default
    ``backward + 1``: every backward worker busy and the forward computing the next item); 1 makes the mode
    synchronous-equivalent (staleness 0). ``straggler_ms`` delays backward worker 0 before each of its items.

    Example:
        >>> DecoupledConfig.parse("1:3").in_flight
        4
    """

    forward: int = 1
    backward: int = 2
    max_in_flight: int | None = None
    straggler_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.forward != 1:
            raise ValueError(f"one forward worker is supported (F:B with F = 1), got F = {self.forward}")
        if self.backward < 1:
            raise ValueError(f"at least one backward worker is needed (B >= 1), got B = {self.backward}")
        if self.max_in_flight is not None and self.max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if not 0.0 <= self.straggler_ms < math.inf:
            raise ValueError(f"straggler_ms must be a number >= 0, got {self.straggler_ms}")

    @property
    def in_flight(self) -> int:
        return self.max_in_flight if self.max_in_flight is not None else self.backward + 1

    @classmethod
    def parse(cls, text: str, **kwargs) -> DecoupledConfig:
        """``"F:B"`` (e.g. ``"1:2"``); a ValueError that names the expected form otherwise."""
        parts = text.split(":")
        try:
            forward, backward = (int(p) for p in parts) if len(parts) == 2 else (None, None)
        except ValueError:
            forward = None
        if forward is None:
            raise ValueError(f"expected F:B, forward and backward worker counts such as 1:2, got {text!r}")
        return cls(forward=forward, backward=backward, **kwargs)


def refusal(cfg, *, distributed: bool | None = None) -> str | None:
    """Why the decoupled mode cannot run this :class:`~.loop.TrainConfig` here, or None.

    Example:
        >>> from char_lm import TrainConfig
        >>> refusal(TrainConfig(steps=1, dtype="float16"), distributed=False)[:28]
        'float16 needs a loss scaler '
    """
    if distributed is None:
        distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1 or (
            torch.distributed.is_available() and torch.distributed.is_initialized())
    if distributed:
        return ("the decoupled mode runs on one device; across processes (torchrun, torch.distributed) it is not "
                "implemented: run it in one process, without torchrun")
    if cfg.dtype == "float16":
        return ("float16 needs a loss scaler whose inf check spans all gradients of a step, which layer-wise "
                "updates never have together: use --dtype bfloat16 or float32")
    if cfg.prune_every:
        return ("an evolving topology (--prune-every/--grow) changes parameters that backward workers update "
                "concurrently: it is not supported with --decoupled")
    return None


@dataclass
class _Stats:
    """One backward worker's counts (written by that worker's items only, so no lock)."""

    items: int = 0
    updates: int = 0
    stale_sum: int = 0
    histogram: dict[int, int] = field(default_factory=dict)

    def add(self, staleness: int) -> None:
        self.updates += 1
        self.stale_sum += staleness
        self.histogram[staleness] = self.histogram.get(staleness, 0) + 1


def _merge(stats: list[_Stats]) -> dict[int, int]:
    """The workers' staleness histograms summed (each copied first: a worker may be adding to it)."""
    merged: dict[int, int] = {}
    for s in stats:
        for k, v in dict(s.histogram).items():
            merged[k] = merged.get(k, 0) + v
    return merged


class _Slot:
    """A live parameter, its AdamW state, its lock, its version and (CUDA) the event of its last access."""

    __slots__ = ("param", "lock", "version", "event", "exp_avg", "exp_avg_sq", "step", "weight_decay")

    def __init__(self, param: torch.nn.Parameter, state: dict, weight_decay: float, cuda: bool) -> None:
        self.param, self.lock, self.version = param, threading.Lock(), 0
        self.event = torch.cuda.Event() if cuda else None
        self.exp_avg, self.exp_avg_sq, self.step = state["exp_avg"], state["exp_avg_sq"], state["step"]
        self.weight_decay = weight_decay


class _Item:
    """One forward's loss graph, the versions it read, its learning rate and stream."""

    __slots__ = ("index", "loss", "versions", "lr", "stream", "stats")

    def __init__(self, index: int, lr: float, stream) -> None:
        self.index, self.lr, self.stream = index, lr, stream
        self.loss: torch.Tensor | None = None
        self.versions: list[int] = []
        self.stats: _Stats | None = None


class DecoupledTrainer(Trainer):
    """A :class:`~.loop.Trainer` whose steps run as PD-ASGD: see the module docstring and docs/decoupled.md.

    ``steps`` counts forwards issued; every one is backwarded and applied before an evaluation, a checkpoint or
    the end of the run (the workers drain there). Gradients are clipped per parameter (``grad_clip``), since a
    global norm would wait for all of a step's gradients.
    """

    def __init__(self, *args, decoupled: DecoupledConfig | None = None, **kwargs) -> None:
        cfg = args[1] if len(args) > 1 else kwargs["cfg"]
        why = refusal(cfg)
        if why is not None:
            raise ValueError(why)
        super().__init__(*args, **kwargs)
        self.decoupled = decoupled or DecoupledConfig()
        self._names = [name for name, p in self.model.named_parameters() if p.requires_grad]
        self._fused = bool(self.optimizer.defaults.get("fused"))
        cuda = self.device.type == "cuda"
        decay = {id(p): g["weight_decay"] for g in self.optimizer.param_groups for p in g["params"]}
        self._slots = [_Slot(p, self._adamw_state(p), decay[id(p)], cuda) for p in self.params]
        self._stats: list[_Stats] = []

    def _adamw_state(self, p: torch.nn.Parameter) -> dict:
        """The optimizer's state of ``p``, created in the layout ``torch.optim.AdamW`` itself creates, so that
        checkpoints of both modes load into either."""
        state = self.optimizer.state[p]
        if not state:
            fused = self._fused
            state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if fused
                             else torch.tensor(0.0, dtype=torch.float32))
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    # ------------------------------------------------------------------------------------------ one update
    def _update(self, i: int, leaf: torch.Tensor, item: _Item) -> None:
        """Post-accumulate-grad hook of parameter ``i``'s snapshot: apply its gradient to the live parameter."""
        grad, leaf.grad = leaf.grad, None
        slot, cfg = self._slots[i], self.cfg
        with torch.no_grad():
            if cfg.grad_clip > 0:  # on the device: no host read
                grad.mul_(torch.clamp(cfg.grad_clip / (torch.linalg.vector_norm(grad) + 1e-6), max=1.0))
            with slot.lock:
                if slot.event is not None:  # after the previous read or write of this parameter, on any stream
                    slot.event.wait()
                adamw([slot.param], [grad], [slot.exp_avg], [slot.exp_avg_sq], [], [slot.step], fused=self._fused,
                      foreach=False, amsgrad=False, beta1=cfg.beta1, beta2=cfg.beta2, lr=item.lr,
                      weight_decay=slot.weight_decay, eps=1e-8, maximize=False)
                staleness = slot.version - item.versions[i]
                slot.version += 1
                if slot.event is not None:
                    slot.event.record()
        item.stats.add(staleness)

    # ------------------------------------------------------------------------------------------ the forward
    def _forward(self, run: _Run, progress: float) -> _Item:
        """Snapshot the parameters, run the forward on the snapshot, register the update hooks."""
        item = _Item(self.step, self.lr_at(self.step, progress), run.stream(self.step))
        copies = []
        with run.device_lock, run.stream_context(item.stream):
            x, y = self.sampler.sample()
            for i, slot in enumerate(self._slots):
                with slot.lock:
                    if slot.event is not None:
                        slot.event.wait()
                    copy = slot.param.detach().clone()
                    item.versions.append(slot.version)
                    if slot.event is not None:  # the next update of this parameter waits for this copy
                        slot.event.record()
                copy.requires_grad_(True)
                copy.register_post_accumulate_grad_hook(lambda leaf, i=i: self._update(i, leaf, item))
                copies.append(copy)
            with self.autocast():
                logits = functional_call(self.model, dict(zip(self._names, copies)), (x,))
                item.loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            run.record_loss(item.loss)
        return item

    # ------------------------------------------------------------------------------------------ the loop
    def _fit(self, clock: StepClock, bar, stop_step: int | None) -> dict:
        cfg = self.cfg
        run = _Run(self)
        self._stats = run.stats
        self.history.setdefault("staleness", [])  # absent from a resumed synchronous run's history
        interrupted = False
        try:
            while self._progress(clock) < 1.0:
                if stop_step is not None and self.step >= stop_step:
                    interrupted = True
                    break
                progress = self._progress(clock)
                run.acquire()
                run.put(self._forward(run, progress))
                self.step += 1
                if cfg.steps is not None:
                    bar.update(1)
                if self.step % cfg.log_every == 0:
                    run.flush_losses()
                    self._read_train(clock, bar)
                    self._log_staleness(run, self.elapsed)
                if self.step % cfg.eval_every == 0:
                    run.drain()
                    self._evaluate(clock, bar)
                    run.resume()
            run.drain()
        finally:
            run.stop()
        run.flush_losses()
        self._log_staleness(run, clock.elapsed())
        return self._finish(clock, bar, interrupted)

    def _log_staleness(self, run: _Run, elapsed: float) -> None:
        """Append ``[elapsed, step, mean, max]`` over the updates applied since the previous entry (nothing when
        there were none)."""
        now = _merge(run.stats)
        window = {k: v - run.logged.get(k, 0) for k, v in now.items() if v > run.logged.get(k, 0)}
        if not window:
            return
        run.logged = now
        n = sum(window.values())
        mean = sum(k * v for k, v in window.items()) / n
        self.history["staleness"].append([round(elapsed, 3), self.step, round(mean, 4), max(window)])

    def summary(self) -> dict:
        summary = super().summary()
        stats = self._stats
        updates = sum(s.updates for s in stats)
        histogram = _merge(stats)
        summary["name"] += f"-pdasgd{self.decoupled.forward}:{self.decoupled.backward}"
        summary["staleness_mean"] = round(sum(k * v for k, v in histogram.items()) / updates, 4) if updates else None
        summary["staleness_max"] = max(histogram, default=None)
        summary["decoupled"] = {
            **asdict(self.decoupled), "in_flight": self.decoupled.in_flight,
            "items": sum(s.items for s in stats), "updates": updates, "parameters": len(self._slots),
            "staleness_histogram": {str(k): histogram[k] for k in sorted(histogram)},
            "workers": [{"items": s.items, "updates": s.updates,
                         "staleness_mean": s.stale_sum / s.updates if s.updates else None} for s in stats],
        }
        return summary


class _Run:
    """The worker threads, the in-flight bound, the streams and the loss slots of one :meth:`fit`."""

    def __init__(self, trainer: DecoupledTrainer) -> None:
        self.trainer = trainer
        dcfg, device = trainer.decoupled, trainer.device
        self.cuda = device.type == "cuda"
        # Autograd runs each backward op on its forward op's stream, so streams belong to items, not threads:
        # with at most in_flight items alive, a pool of that many gives every live item its own stream.
        self.streams = [torch.cuda.Stream(device) for _ in range(dcfg.in_flight)] if self.cuda else []
        # MPS: two threads encoding at once can crash the process (pytorch/pytorch#197805), so device work of
        # forward and backward items takes turns there; CPU and CUDA need no such lock.
        self.device_lock = threading.Lock() if device.type == "mps" else contextlib.nullcontext()
        self.in_flight = threading.Semaphore(dcfg.in_flight)
        self.queue: queue.Queue[_Item | None] = queue.Queue()
        self.stats = [_Stats() for _ in range(dcfg.backward)]
        self.logged: dict[int, int] = {}  # the staleness histogram at the last log entry
        self.error: BaseException | None = None
        self.losses = torch.zeros(trainer.cfg.log_every, dtype=torch.float32, device=device)
        self.pending = 0
        self.resume()
        self.threads = [threading.Thread(target=self._work, args=(w,), name=f"pdasgd-backward-{w}", daemon=True)
                        for w in range(dcfg.backward)]
        for t in self.threads:
            t.start()

    def stream(self, index: int):
        return self.streams[index % len(self.streams)] if self.cuda else None

    def stream_context(self, stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def resume(self) -> None:
        """The item streams start after everything queued on the current stream (model, state, evaluation)."""
        current = torch.cuda.current_stream(self.trainer.device) if self.cuda else None
        for s in self.streams:
            s.wait_stream(current)

    def acquire(self) -> None:
        """Wait for an in-flight slot, re-raising a backward worker's error instead of waiting forever."""
        while not self.in_flight.acquire(timeout=0.5):
            self.check()
        self.check()

    def put(self, item: _Item) -> None:
        self.queue.put(item)

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError(f"a backward worker failed: {type(self.error).__name__}: {self.error}") from self.error

    def record_loss(self, loss: torch.Tensor) -> None:
        """The loss into its own slot of a device buffer (one slot per step of a read window: no two streams
        add into one tensor)."""
        self.losses[self.pending].copy_(loss.detach())
        self.pending += 1

    def flush_losses(self) -> None:
        """Move the window's losses into the trainer's accumulator, after all streams finished them."""
        if not self.pending:
            return
        synchronize(self.trainer.device)
        self.trainer.train_loss.total += self.losses[: self.pending].sum()
        self.trainer.train_loss.count += self.pending
        self.pending = 0

    def drain(self) -> None:
        """Wait until every queued item is backwarded and applied on the device (a barrier for evaluation,
        checkpoints and the end)."""
        self.queue.join()
        synchronize(self.trainer.device)
        self.check()

    def stop(self) -> None:
        for _ in self.threads:
            self.queue.put(None)
        for t in self.threads:
            t.join()

    def _work(self, worker: int) -> None:
        stats, delay = self.stats[worker], self.trainer.decoupled.straggler_ms / 1e3
        while (item := self.queue.get()) is not None:
            try:
                if self.error is None:
                    if delay and worker == 0:
                        time.sleep(delay)
                    item.stats = stats
                    with self.device_lock, self.stream_context(item.stream):
                        item.loss.backward()
                    stats.items += 1
            except BaseException as exc:  # noqa: BLE001 - handed to the forward thread, which raises it
                self.error = self.error or exc
            finally:
                item.loss = None  # frees the graph and the snapshot
                self.in_flight.release()
                self.queue.task_done()
        self.queue.task_done()
