"""The rule behind ``backward="auto"``: which of the contract's strategies (:class:`Strategy`) a backward runs.

``fused_atomic``: one pass; a worker owns (source, batch chunk) of grad_x and adds into grad_w atomically.
``atomic_free``: two passes with exclusive ownership: grad_w per edge, then grad_x per source.

``auto`` is resolved when the backward runs. By default it is tuned on the machine (:mod:`torch_sparse_metal.tuning`:
the first backward of a size bucket times both strategies, on MPS each with each kernel variant, once, and the
decision is cached on disk). Without a decision (``TORCH_SPARSE_METAL_TUNE=0``, or a bucket first met where tensors
are not real) it follows the static rule, from the device and the problem size only (never from tensor values, so
it costs no host synchronisation): ``fused_atomic`` on every device. It reads each output-gradient row once for
both gradients where the two-pass strategy reads it twice, and that second read costs more than the atomics; the
measurements behind the rule, per device, are in docs/strategies.md.

Under ``torch.use_deterministic_algorithms(True)``, ``auto`` runs ``atomic_free`` (deterministic on every
device), whatever the tuning cache says; an explicit ``fused_atomic`` where its sum order is not fixed
(:func:`deterministic`) raises, or warns with ``warn_only=True``, as torch's nondeterministic ops do
(:func:`check_deterministic`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from . import tuning
from .contract import Strategy

__all__ = ["CONCRETE", "Strategy", "check_deterministic", "deterministic", "parse_strategy", "resolve_strategy",
           "static_strategy"]

#: The strategies ``auto`` chooses between, in the contract's order.
CONCRETE = tuple(s for s in Strategy if s is not Strategy.AUTO)
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
                     measure: Callable[[Strategy], object] | None = None) -> Strategy:
    """The concrete strategy a backward on ``device`` with these sizes runs.

    ``auto``: the tuned decision for this size bucket on this machine (:mod:`torch_sparse_metal.tuning`); if
    there is none yet and ``measure`` (a backward with a given strategy on real tensors) is given, it is tuned
    now, each strategy with each of the device's kernel variants (the backend reads the variant of the decision
    when it runs); otherwise, with ``TORCH_SPARSE_METAL_TUNE=0``, or for symbolic sizes (tracing), the static
    rule above. Under deterministic algorithms ``auto`` is ``atomic_free``, neither tuned nor read from the cache.
    """
    strategy = parse_strategy(strategy)
    if strategy is not Strategy.AUTO:
        return strategy
    if torch.are_deterministic_algorithms_enabled():
        return Strategy.ATOMIC_FREE
    sizes = (in_features, out_features, nnz, batch)
    if all(type(n) is int for n in sizes):  # symbolic while torch.compile traces dynamic shapes: no bucket
        bucket = tuning.bucket_key(dtype, *sizes)
        run = None if measure is None else lambda config: measure(Strategy(config["strategy"]))
        tuned = tuning.choose(device, bucket, tuning.candidates(device.type, _VALUES), run)  # None with tuning off
        if tuned is not None:
            return Strategy(tuned["strategy"])
    return static_strategy(device, in_features, out_features, nnz, batch)


def static_strategy(device: torch.device, in_features: int, out_features: int, nnz: int, batch: int) -> Strategy:
    """The documented rule ``auto`` follows without tuning (the same on every device and size measured so far)."""
    del device, in_features, out_features, nnz, batch
    return Strategy.FUSED_ATOMIC


def deterministic(strategy: Strategy | str, device: torch.device) -> bool:
    """Whether ``strategy``'s backward kernels give the same bits on every run with the same inputs and settings.

    ``atomic_free`` always: every gradient element has one owner, which sums in a fixed order. ``fused_atomic``
    on the CPU with at most two threads: csrc/cpu/csr_linear_cpu.cpp splits the batch into one chunk per thread
    (at most), whose partial weight gradients are added into a zeroed buffer atomically, in the order the
    threads finish; two partial sums added onto zero give the same bits in either order (float addition is
    commutative), three or more do not. On CUDA and Metal it adds with float atomics: never.

    Example:
        >>> deterministic("atomic_free", torch.device("cuda"))
        True
        >>> deterministic("fused_atomic", torch.device("cuda"))
        False
    """
    strategy = parse_strategy(strategy)
    if strategy is Strategy.AUTO:
        raise ValueError("deterministic() takes a concrete strategy: resolve 'auto' first (resolve_strategy)")
    if strategy is not Strategy.FUSED_ATOMIC or device.type == "meta":  # meta: nothing is computed
        return True
    return device.type == "cpu" and torch.get_num_threads() <= 2


def check_deterministic(strategy: Strategy | str, device: torch.device) -> None:
    """Torch's contract for ops without a deterministic implementation, for the backward kernels about to run:
    under ``torch.use_deterministic_algorithms(True)``, a RuntimeError if ``strategy`` is not
    :func:`deterministic` on ``device``; a UserWarning instead with ``warn_only=True``.

    Example:
        >>> torch.use_deterministic_algorithms(True)
        >>> check_deterministic("fused_atomic", torch.device("cuda"))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: csr_linear_backward with backward='fused_atomic' does not have a deterministic implementation ...
        >>> torch.use_deterministic_algorithms(False)
    """
    if not torch.are_deterministic_algorithms_enabled() or deterministic(strategy, device):
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    where = f"the CPU with {torch.get_num_threads()} threads" if device.type == "cpu" else device.type
    fix = "Use backward='atomic_free' or 'auto' (which runs atomic_free while deterministic algorithms are on)"
    if device.type == "cpu":
        fix += ", or at most two CPU threads (torch.set_num_threads(2))"
    message = (f"csr_linear_backward with backward='{parse_strategy(strategy)}' does not have a deterministic "
               f"implementation on {where}, but you set 'torch.use_deterministic_algorithms(True"
               f"{', warn_only=True' if warn_only else ''})'. {fix}.")
    if warn_only:
        warnings.warn(message, UserWarning, stacklevel=3)
    else:
        raise RuntimeError(message)
