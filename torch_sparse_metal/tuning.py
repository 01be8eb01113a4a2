"""The tuner of ``auto`` (opt-in): times the choices a backend declares on the user's own machine and keeps the
fastest per problem size.

**Off by default.** ``auto`` then follows static rules, with nothing timed, read or written:

- the backward strategy: ``fused_atomic`` on every backend (:data:`torch_sparse_metal.strategy.STATIC`). It won
  beyond the timing noise wherever measured: the CPU (1.18-1.43x at the sizes measured), an H200 (1.16-1.76x
  wherever the backward takes more than ~0.1 ms, no lead either way below), and the published M1 Pro figures
  (2.8-10x) with our Metal kernels compiled for an H200 (1.4-2.6x); docs/strategies.md holds the runs. No backend
  declares ``Backend.tunes_strategy``, so even with tuning on no strategy is timed;
- CPU and CUDA: no kernel variants; tuning does nothing there;
- MPS: ``values_per_lane`` P of the tiled kernels by :func:`torch_sparse_metal.backends.mps.values_per_lane` (1 up
  to 32 batch rows, else 4), and the direct SpMM kernel (``spmm``, not ``spmm_window``). No measurement on Apple
  hardware stands behind either: P = 4 moves 12-38% fewer bytes at batch 128 in the executor's traffic model
  (counts, not times; docs/metal.md, "Traffic model"), and the window kernel ran 3.4-9.9x slower than the direct
  one in the forward with the shaders compiled for an H200 (docs/metal.md, "The row-window SpMM").

**On**, with ``TORCH_SPARSE_METAL_TUNE=1`` when the package is imported (:mod:`torch_sparse_metal.settings`) or
:func:`enable` at any time (as ``torch.backends.cudnn.benchmark = True``): the first eager forward and the first
backward of a problem-size bucket on a device with more than one candidate (MPS) time each candidate on the real
tensors and keep the fastest, cached on disk for later runs. ``python -m torch_sparse_metal_tools.tune`` measures given
sizes ahead of a run (with tuning on for that command) and shows or clears the cache; a later run reads those
decisions only with tuning on. The switch and the backends' kernel variants live in
:mod:`torch_sparse_metal._autotune`; the ops read that switch before they call in here, and nothing else while tuning
is off.

What is tuned is declared per backend: the strategies where ``Backend.tunes_strategy`` (none today:
:func:`torch_sparse_metal.strategy.tuned_strategies`) and the kernel variants a backend declares
(:func:`register_variants`). A decision is a *configuration*: for the backward a strategy, for the forward nothing,
each combined with every setting of the variants; :func:`candidates` builds that table. Where it holds one
configuration (CPU and CUDA) nothing is timed, read or written.

Candidates are timed once per bucket, at the first call, never in the steady state, with the benchmark's timer
(:class:`torch_sparse_metal.timing.Timer`: one warm-up call each, then :data:`REPS` rounds that time every
candidate once, in alternating order, so that a change of load reaches all candidates alike). The fastest median
is used from then on. While a candidate is timed its variants are in force (:func:`variant` returns them);
otherwise a backend reads the bucket's decision with :func:`variant`, a dictionary lookup that never waits on the
device.

Decisions are cached on disk per device name, torch version and package version
(``$TORCH_SPARSE_METAL_CACHE_DIR/tuning.json``, else ``$XDG_CACHE_HOME/torch_sparse_metal/tuning.json``, else
``~/.cache/torch_sparse_metal/tuning.json``), so a machine tunes each bucket once. Buckets round every size up
to a power of two, so a topology that grows or shrinks a little keeps its decision; the backward's and the
forward's decisions of a size are separate buckets. An entry is ``{"strategy": ..., "values_per_lane": ...,
"ms": {candidate: median ms}, "spread_ms": {candidate: max - min}}`` (the keys its candidates have). A winner
whose lead over the runner-up is within the noise (the larger of the two spreads) is marked
``"provisional": true``: this process uses it, and the next process to meet the bucket times it again. An entry
that does not name exactly one of today's candidates (one written before a device had variants, which has a
strategy but no ``values_per_lane``), and anything else the file holds that is not such an entry, counts as no
decision. Processes tuning at the same time merge their decisions into the file under a lock
(``tuning.json.lock`` beside it) instead of overwriting each other's.

Under ``torch.use_deterministic_algorithms(True)`` the cache is ignored and nothing is timed even with tuning on
(``auto`` runs ``atomic_free`` with the static P), so that every run executes the same kernels. Tuning is skipped
where tensors are not real (``torch.compile`` tracing, ``torch.func`` transforms, meta tensors), inside a CUDA
graph capture, and under ``create_graph=True``; a decision made before is still used there.

Example:
    >>> bucket_key(torch.float32, 1000, 1000, 50_000, 100)
    'float32/in1024/out1024/nnz65536/batch128'
    >>> [label(c) for c in candidates("cpu", ("fused_atomic", "atomic_free"))]
    ['fused_atomic', 'atomic_free']
    >>> [label(c) for c in candidates("mps", ("fused_atomic",))]  # the MPS backend declares values_per_lane
    ['fused_atomic values_per_lane=1', 'fused_atomic values_per_lane=4']
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch

from . import _autotune, devices, settings, timing
from ._version import __version__

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; concurrent tuners may then lose one another's decisions
    fcntl = None

__all__ = ["REPS", "VARIANTS", "Config", "bucket_key", "cache_path", "cached", "candidates", "choose", "decisions",
           "device_key", "enable", "enabled", "forget", "label", "register_variants", "tune_forward", "tuned_strategy",
           "tuned_variant", "variant"]

#: Timed rounds: each times every candidate once (after one warm-up call each).
REPS = 3
_CACHE_ENV = "TORCH_SPARSE_METAL_CACHE_DIR"
_lock = threading.Lock()
_memory: dict[str, Any] | None = None  # the file as last read or written: device key -> bucket -> entry
_session: dict[tuple[str, str], dict] = {}  # (device key, bucket) -> the entry this process decided, kept or not
#: A configuration: ``{"strategy": ...}`` (backward only) and one value per kernel variant, e.g.
#: ``{"strategy": "fused_atomic", "values_per_lane": 4}``.
Config = dict[str, Any]
#: Kernel variants per device type, as their backends declare them (:func:`register_variants`): setting -> values.
VARIANTS = _autotune.VARIANTS
#: Per device type, the ops a variant setting changes (``"forward"`` and strategy names); a setting not named
#: changes every op. A backward is tuned over the settings that change one of its strategies only.
VARIANT_OPS = _autotune.VARIANT_OPS
#: Declare a backend's kernel variants (kept where the ops read them without importing the tuner).
register_variants = _autotune.register_variants
_timing: ContextVar[Config | None] = ContextVar("torch_sparse_metal_tuning_candidate", default=None)


def enable(on: bool = True) -> None:
    """Turn tuning on (or off with ``enable(False)``) for this process, whatever ``TORCH_SPARSE_METAL_TUNE`` said
    at import: ``auto`` then times its candidates at the first use of a size and reads and writes the cache.

    Example:
        >>> enable()
        >>> enabled()
        True
        >>> enable(False)  # the static rules again

    """
    _autotune.enabled = settings.switch("tuning.enable(on)", on)


def enabled() -> bool:
    """Whether tuning is on: ``TORCH_SPARSE_METAL_TUNE`` at import (default off), then :func:`enable`."""
    return _autotune.enabled


def _active() -> bool:
    """Whether ``auto`` may time candidates and read decisions: tuning on and deterministic algorithms off (then
    every process runs the static rules' kernels, whatever the cache holds)."""
    return enabled() and not torch.are_deterministic_algorithms_enabled()


def cache_path() -> Path:
    """Where decisions are kept: ``$TORCH_SPARSE_METAL_CACHE_DIR``, else ``$XDG_CACHE_HOME/torch_sparse_metal``,
    else ``~/.cache/torch_sparse_metal``. Empty variables count as unset, and a relative ``XDG_CACHE_HOME`` is
    ignored, as the XDG spec says: the cache never lands in the working directory. RuntimeError when there is no
    home folder either."""
    root = settings.text(_CACHE_ENV)
    if root is not None:
        return Path(root).expanduser() / "tuning.json"
    xdg = settings.text("XDG_CACHE_HOME")
    if xdg is not None and Path(xdg).is_absolute():
        return Path(xdg) / "torch_sparse_metal" / "tuning.json"
    home = Path(os.path.expanduser("~"))
    if not home.is_absolute():
        raise RuntimeError(f"torch_sparse_metal: no home folder for the tuning cache; set {_CACHE_ENV} to a folder")
    return home / ".cache" / "torch_sparse_metal" / "tuning.json"


def _pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


@functools.lru_cache(maxsize=1024)
def bucket_key(dtype: torch.dtype, in_features: int, out_features: int, nnz: int, batch: int,
               op: str = "backward") -> str:
    """The problem-size bucket of ``op`` (``"backward"`` or ``"forward"``): each size rounded up to a power of two;
    the forward's buckets start with ``forward/``."""
    name = str(dtype).removeprefix("torch.")
    prefix = "forward/" if op == "forward" else ""
    return f"{prefix}{name}/in{_pow2(in_features)}/out{_pow2(out_features)}/nnz{_pow2(nnz)}/batch{_pow2(batch)}"


def candidates(device_type: str, strategies: Sequence[str] = ()) -> tuple[Config, ...]:
    """Every configuration ``auto`` chooses between on ``device_type``: each of ``strategies`` (the backward's;
    none for the forward) with each combination of the device's kernel variants that change that op
    (:data:`VARIANT_OPS`). ``({},)`` when there is nothing to choose."""
    ops = {str(getattr(s, "value", s)) for s in strategies} or {"forward"}
    changes = VARIANT_OPS.get(device_type, {})
    axes = tuple((k, v) for k, v in VARIANTS.get(device_type, {}).items() if k not in changes
                 or ops & set(changes[k]))
    return _candidates(tuple(strategies), axes)


@functools.lru_cache(maxsize=64)
def _candidates(strategies: tuple[str, ...], variants: tuple[tuple[str, tuple[Any, ...]], ...]) -> tuple[Config, ...]:
    """:func:`candidates` for one table: built once, as ``auto`` asks for it in every backward (callers must not
    modify the returned configurations)."""
    axes = ({"strategy": strategies} if strategies else {}) | dict(variants)
    return tuple(dict(zip(axes, values)) for values in itertools.product(*axes.values()))


def label(config: Config) -> str:
    """A configuration in words, as the cache's timings name it: ``"fused_atomic values_per_lane=4"``."""
    return " ".join(str(v) if k == "strategy" else f"{k}={v}" for k, v in config.items())


def device_key(device: torch.device) -> str:
    """The machine a decision belongs to: the device's name, its thread count on the CPU, torch's version."""
    return _device_key(device, torch.get_num_threads())


@functools.lru_cache(maxsize=64)
def _device_key(device: torch.device, threads: int) -> str:
    """Computed once per device and thread count (the backend's name of the machine reads /proc/cpuinfo or asks the
    driver): ``auto`` looks it up every backward."""
    backend = devices.get(device.type)
    name = backend.describe(device) if backend is not None else device.type
    return f"{name} | torch {torch.__version__} | torch_sparse_metal {__version__}"


def _read(path: Path) -> dict[str, Any]:
    """The cache file's content; ``{}`` for a missing, unreadable or malformed file (it is not trusted)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


def decisions() -> dict[str, Any]:
    """The cache as this process last read or wrote it (read at the first use)."""
    global _memory
    if _memory is None:
        try:
            _memory = _read(cache_path())
        except RuntimeError:  # no folder for a cache: this process's decisions only
            _memory = {}
    return _memory


def _buckets(data: Mapping[str, Any], machine: str) -> dict[str, Any]:
    """The entries of ``machine`` in the cache's ``data``; ``{}`` where the file holds something else there."""
    entries = data.get(machine)
    return entries if isinstance(entries, dict) else {}


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path``'s sibling lock file, so that processes tuning at the same time merge
    their decisions instead of overwriting each other's (no lock where ``fcntl`` is missing: Windows)."""
    if fcntl is None:
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write(path: Path, data: Mapping[str, Any]) -> None:
    """Replace ``path`` with ``data`` atomically, through a temporary file beside it that never outlives a
    failure."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _persist(machine: str, bucket: str, entry: dict[str, Any]) -> None:
    """Merge one decision into the cache file: under the file lock, re-read it, set the entry, write it back.
    A provisional entry does not replace a decided one another process wrote meanwhile."""
    global _memory
    try:
        path = cache_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        with _file_lock(path):
            data = _read(path)
            entries = data[machine] = _buckets(data, machine)
            if not (entry.get("provisional") and _decided(entries.get(bucket))):
                entries[bucket] = entry
            _write(path, data)
        _memory = data
    except (OSError, RuntimeError) as exc:  # a read-only home still tunes, in memory for this process
        warnings.warn(f"torch_sparse_metal: cannot write the tuning cache ({exc}); decisions are kept in memory "
                      f"only (set {_CACHE_ENV} to a writable folder)", stacklevel=3)


def _decided(entry: object) -> bool:
    """Whether a cache entry is a decision to use: a dictionary not marked provisional."""
    return isinstance(entry, dict) and entry.get("provisional", False) is False


def _measure(device: torch.device, candidates: Sequence[Config], run: Callable[[Config], object]) -> dict[str, Any]:
    """Time every candidate with the package's timer (:class:`torch_sparse_metal.timing.Timer`: one warm-up call
    each, then :data:`REPS` interleaved rounds, so that a change of load during the timing reaches all of them
    alike); the entry for the fastest median. It is provisional when its lead over the runner-up is within the
    noise (the larger spread, max - min, of the two's samples)."""
    fns = {label(c): functools.partial(_run_candidate, c, run) for c in candidates}
    timings = timing.Timer(device, REPS).many(fns)
    ms = {k: t.ms for k, t in timings.items()}
    spread = {k: t.spread_ms for k, t in timings.items()}
    best, second = sorted(candidates, key=lambda c: ms[label(c)])[:2]
    lead = ms[label(second)] - ms[label(best)]
    entry = {**best, "ms": _rounded(ms), "spread_ms": _rounded(spread)}
    if lead <= max(spread[label(best)], spread[label(second)]):
        entry["provisional"] = True
    return entry


def _run_candidate(config: Config, run: Callable[[Config], object]) -> object:
    with _candidate(config):
        return run(config)


def _rounded(ms: Mapping[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in ms.items()}


@contextlib.contextmanager
def _candidate(config: Config) -> Iterator[None]:
    """The candidate's variants are in force inside the block (:func:`variant` returns them)."""
    token = _timing.set(config)
    try:
        yield
    finally:
        _timing.reset(token)


def _entry(device: torch.device, bucket: str) -> dict | None:
    """The decision for ``bucket`` on ``device``: this process's, else the cache file's if it is a decided
    dictionary (the file is not trusted; a provisional entry is tuned again)."""
    machine = device_key(device)
    with _lock:
        known = _session.get((machine, bucket))
        if known is None:
            known = _buckets(decisions(), machine).get(bucket)
            known = known if _decided(known) else None
    return known


def cached(device: torch.device, bucket: str, candidates: Sequence[Config]) -> Config | None:
    """The decision cached for ``bucket`` on ``device`` if it is one of ``candidates`` (see the module's notes on
    older entries), else None."""
    known = _entry(device, bucket)
    if known is None:
        return None
    config = {k: known.get(k) for k in candidates[0]}
    return config if config in candidates else None


def choose(device: torch.device, bucket: str, candidates: Sequence[Config],
           run: Callable[[Config], object] | None = None) -> Config | None:
    """The decision for ``bucket`` on ``device`` among ``candidates`` (from :func:`candidates`): the cached one;
    else, given ``run``, ``run(candidate)`` is timed for each candidate with its variants in force, and the
    fastest is cached (provisionally where its lead is within the noise) and returned; else None. The only
    candidate when there is one; None when tuning is off or deterministic algorithms are on."""
    if not _active():
        return None
    if len(candidates) == 1:
        return candidates[0]
    known = cached(device, bucket, candidates)
    if known is not None or run is None:
        return known
    entry = _measure(device, candidates, run)
    machine = device_key(device)
    with _lock:
        _session[(machine, bucket)] = entry
        _persist(machine, bucket, entry)
    return {k: entry[k] for k in candidates[0]}


def tune_forward(device: torch.device, dtype: torch.dtype, in_features: int, out_features: int, nnz: int,
                 batch: int, run: Callable[[], object]) -> Config | None:
    """The forward's decision for this size on ``device``: cached, or tuned now by timing ``run()`` (one forward)
    with each of the device's kernel variants in force. Nothing is timed where the device has no variants."""
    bucket = bucket_key(dtype, in_features, out_features, nnz, batch, "forward")
    return choose(device, bucket, candidates(device.type), lambda _config: run())


def tuned_strategy(device: torch.device, sizes: tuple[int, int, int, int], dtype: torch.dtype,
                   measure: Callable[[str], object] | None, strategies: Sequence[str]) -> str | None:
    """The strategy ``auto`` runs for a backward of ``sizes`` (in, out, nnz, batch) on ``device``, chosen among
    ``strategies`` (:func:`torch_sparse_metal.strategy.tuned_strategies`, which the caller passes) with the
    device's kernel variants: the decision for the size bucket, timed now through ``measure(strategy)`` (a backward
    on real tensors) when there is none yet. The variants are tuned with it, for the strategy that runs. None where
    there is nothing to choose, for symbolic sizes (tracing), and with tuning off or deterministic algorithms on: the
    static rule applies."""
    options = candidates(device.type, strategies)
    if len(options) == 1 or not all(type(n) is int for n in sizes):
        return None
    run = None if measure is None else lambda config: measure(config["strategy"])
    tuned = choose(device, bucket_key(dtype, *sizes), options, run)
    return None if tuned is None else tuned["strategy"]


def variant(device: torch.device, bucket: str, setting: str, strategy: str | None = None) -> Any:
    """The value of kernel variant ``setting`` a backend should run for ``bucket``: the candidate's while one is
    being timed, else the bucket's decision (for a backward, only when the decision was made for ``strategy``,
    the strategy running), else None (the backend's static rule). A dictionary lookup: it never waits on the
    device. The backend checks the value: the cache file is not trusted to hold a valid one."""
    timed = _timing.get()
    if timed is not None:
        return timed.get(setting)
    if not _active():
        return None
    known = _entry(device, bucket)
    if known is None or (strategy is not None and known.get("strategy") != strategy):
        return None
    return known.get(setting)


def tuned_variant(device: torch.device, key: tuple[Any, ...], setting: str, strategy: str | None = None) -> Any:
    """The tuned value of kernel variant ``setting`` for a call on ``device`` whose size is ``key`` (the arguments
    of :func:`bucket_key`), for the backward only where ``strategy`` is the one tuned; None (the backend's static
    rule) without a decision, and always with tuning off (one flag read). Never waits on the device.

    Example:
        >>> tuned_variant(torch.device("cpu"), (torch.float32, 64, 32, 200, 8, "forward"), "values_per_lane") is None
        True
    """
    if not _autotune.enabled:
        return None
    return variant(device, bucket_key(*key), setting, strategy)


def forget() -> None:
    """Drop every cached decision (the file and this process's copy)."""
    global _memory
    with _lock:
        _memory = {}
        _session.clear()
        path = cache_path()
        if path.parent.is_dir():
            with _file_lock(path):
                path.unlink(missing_ok=True)
