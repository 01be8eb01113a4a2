"""The rule behind ``backward="auto"``: which of the contract's strategies (:class:`Strategy`) a backward runs.

``fused_atomic``: one pass; a worker owns (source, batch chunk) of grad_x and adds into grad_w atomically.
``atomic_free``: two passes with exclusive ownership: grad_w per edge, then grad_x per source.

``auto`` is resolved when the backward runs, by the static rule: ``fused_atomic`` on every device and size
(:data:`STATIC`). It reads each output-gradient row once for both gradients where the two-pass strategy reads it
twice, and that second read costs more than the atomics; it won beyond the timing noise wherever measured (the
CPU, an H200, and the published M1 Pro figures: docs/strategies.md), so no backend times the strategies. Tuning
is opt-in (:mod:`torch_sparse_metal.tuning`, off by default): with it on, a backend that measures otherwise and
declares ``Backend.tunes_strategy`` has both strategies timed at the first backward of a size bucket and the
decision cached (on MPS the kernel variant ``values_per_lane`` of the static strategy is tuned so). The rule reads
no tensor value, so it costs no host synchronisation.

The vector layout (``SparseLinear(block=V)``) follows the same rule: no backend times its strategies. On CUDA
with 16-bit values both strategies compute grad_x with the same tensor-core kernel where its tile fits, and differ
in how grad_w is summed. At the transformer shapes measured (docs/benchmarks.md) neither won everywhere:
``atomic_free`` by up to 1.16x, ``fused_atomic`` by up to 2x, so the static rule stays.

Under ``torch.use_deterministic_algorithms(True)``, ``auto`` runs :data:`DETERMINISTIC` (a strategy deterministic on
every device), whatever the tuning cache says; an explicit strategy whose sum order is not fixed
(:func:`deterministic`) raises, or warns with ``warn_only=True``, as torch's nondeterministic ops do
(:func:`check_deterministic`). What makes a strategy deterministic is its row of the contract
(``contract.STRATEGY_SPECS``), never its name.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from . import _autotune, devices, tuning
from .contract import STRATEGY_SPECS, Strategy

__all__ = ["CONCRETE", "DETERMINISTIC", "STATIC", "Strategy", "check_deterministic", "deterministic",
           "parse_strategy", "resolve_strategy", "static_strategy", "tuned_strategies"]

#: The concrete strategies, in the contract's order.
CONCRETE = tuple(STRATEGY_SPECS)
#: The static rule: the strategy ``auto`` runs wherever the strategies are not tuned (every device and layout today).
STATIC = Strategy.FUSED_ATOMIC
#: The strategy ``auto`` runs under deterministic algorithms: the first of the contract's that is deterministic on
#: every device.
DETERMINISTIC = next(s for s, spec in STRATEGY_SPECS.items() if spec.deterministic)
_BY_VALUE = {s.value: s for s in Strategy}  # members hash as their values: a lookup for both
_VALUES = tuple(s.value for s in CONCRETE)

def parse_strategy(value: str | Strategy) -> Strategy:
    """Validate a user's strategy name.

    Example:
        >>> parse_strategy("atomic_free")
        <Strategy.ATOMIC_FREE: 'atomic_free'>
    """
    try:
        return _BY_VALUE[value]
    except (KeyError, TypeError):
        choices = ", ".join(repr(s.value) for s in Strategy)
        raise ValueError(f"backward must be one of {choices}, got {value!r}") from None


def resolve_strategy(strategy: Strategy | str, device: torch.device, in_features: int, out_features: int, nnz: int,
                     batch: int, *, dtype: torch.dtype = torch.float32,
                     measure: Callable[[Strategy], object] | None = None, block: int = 1) -> Strategy:
    """The concrete strategy a backward on ``device`` with these sizes runs.

    ``auto``: :data:`STATIC`. With tuning on (opt-in, :mod:`torch_sparse_metal.tuning`) and a backend that tunes
    something (the strategies: :func:`tuned_strategies`; or kernel variants, MPS): the decision for this size
    bucket on this machine, tuned now if there is none yet and ``measure`` (a backward with a given strategy on
    real tensors) is given; the backend reads the variants of the decision when it runs. Nothing is timed for
    symbolic sizes (tracing), nor for the vector layout (``block`` > 1: the tuned variants are the unstructured
    kernels'). Under deterministic algorithms ``auto`` is :data:`DETERMINISTIC`, neither tuned nor read from the
    cache. With tuning off this reads one flag: no file, lock or tuner module.

    Example:
        >>> resolve_strategy("auto", torch.device("cpu"), 64, 32, 200, 8)
        <Strategy.FUSED_ATOMIC: 'fused_atomic'>
    """
    strategy = parse_strategy(strategy)
    if strategy is not Strategy.AUTO:
        return strategy
    if torch.are_deterministic_algorithms_enabled():
        return DETERMINISTIC
    if not _autotune.enabled or block != 1:
        return STATIC
    run = None if measure is None else lambda name: measure(Strategy(name))
    tuned = tuning.tuned_strategy(device, (in_features, out_features, nnz, batch), dtype, run,
                                  tuned_strategies(device.type))
    return STATIC if tuned is None else Strategy(tuned)


def tuned_strategies(device_type: str) -> tuple[str, ...]:
    """The strategies ``auto`` chooses between on ``device_type``: every concrete one where the backend declares
    that they measurably differ (``Backend.tunes_strategy``), else only the static rule's.

    Example:
        >>> tuned_strategies("cpu"), tuned_strategies("cuda"), tuned_strategies("mps")
        (('fused_atomic',), ('fused_atomic',), ('fused_atomic',))
    """
    backend = devices.get(device_type)
    return _VALUES if backend is not None and backend.tunes_strategy else (STATIC.value,)


def static_strategy() -> Strategy:
    """The rule ``auto`` follows without tuning: :data:`STATIC`, the same on every device and size measured.

    Example:
        >>> static_strategy()
        <Strategy.FUSED_ATOMIC: 'fused_atomic'>
    """
    return STATIC


def deterministic(strategy: Strategy | str, device: torch.device) -> bool:
    """Whether ``strategy``'s backward kernels give the same bits on every run with the same inputs and settings.

    From its row of the contract (``contract.STRATEGY_SPECS``): a deterministic strategy always (every gradient
    element has one owner, which sums in a fixed order). One whose partial weight gradients meet in atomic adds
    (``accumulates``) only on the CPU with at most two threads: the CPU kernels split the batch into one chunk per
    thread (at most), whose partial sums are added into a zeroed buffer in the order the threads finish; two
    partial sums added onto zero give the same bits in either order (float addition is commutative), three or more
    do not. On CUDA and Metal such a strategy adds with float atomics: never.

    Example:
        >>> deterministic("atomic_free", torch.device("cuda"))
        True
        >>> deterministic("fused_atomic", torch.device("cuda"))
        False
    """
    strategy = parse_strategy(strategy)
    if strategy is Strategy.AUTO:
        raise ValueError("deterministic() takes a concrete strategy: resolve 'auto' first (resolve_strategy)")
    spec = STRATEGY_SPECS[strategy]
    if spec.deterministic or device.type == "meta":  # meta: nothing is computed
        return True
    return spec.accumulates and device.type == "cpu" and torch.get_num_threads() <= 2


def check_deterministic(strategy: Strategy | str, device: torch.device) -> None:
    """Torch's contract for ops without a deterministic implementation, for the backward kernels about to run:
    under ``torch.use_deterministic_algorithms(True)``, a RuntimeError if ``strategy`` is not
    :func:`deterministic` on ``device``; a UserWarning instead with ``warn_only=True``.

    Example:
        >>> torch.use_deterministic_algorithms(True)
        >>> check_deterministic("fused_atomic", torch.device("cuda"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: the sparse layer's backward with backward='fused_atomic' does not have a deterministic ...
        >>> torch.use_deterministic_algorithms(False)
    """
    if not torch.are_deterministic_algorithms_enabled() or deterministic(strategy, device):
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    where = f"the CPU with {torch.get_num_threads()} threads" if device.type == "cpu" else device.type
    fix = (f"Use backward='{DETERMINISTIC}' or 'auto' (which runs {DETERMINISTIC} while deterministic algorithms are "
           "on)")
    if device.type == "cpu":
        fix += ", or at most two CPU threads (torch.set_num_threads(2))"
    message = (f"the sparse layer's backward with backward='{parse_strategy(strategy)}' does not have a deterministic "
               f"implementation on {where}, but you set 'torch.use_deterministic_algorithms(True"
               f"{', warn_only=True' if warn_only else ''})'. {fix}.")
    if warn_only:
        warnings.warn(message, UserWarning, stacklevel=3)
    else:
        raise RuntimeError(message)
