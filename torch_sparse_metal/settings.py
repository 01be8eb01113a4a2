"""The package's environment settings, read through one parser.

Every setting is named ``TORCH_SPARSE_METAL_*``. A boolean accepts what torch's own switches accept: ``1``/``0``,
``true``/``false``, ``yes``/``no``, ``on``/``off`` (any case, surrounding spaces ignored); a choice accepts one of
its values (any case). An empty value counts as unset. Anything else raises a ``ValueError`` that names the
variable, its value and the accepted values, instead of being taken silently for the default.

- ``TORCH_SPARSE_METAL_TUNE`` (boolean, default off; read at import): ``auto`` is tuned on the machine
  (:mod:`.tuning`, which :func:`.tuning.enable` also turns on or off later).
- ``TORCH_SPARSE_METAL_CACHE_DIR`` (a folder): where the tuning cache lives (:func:`.tuning.cache_path`).
- ``TORCH_SPARSE_METAL_CPU_KERNELS`` (``native`` or ``generic``, default native): the CPU kernel set at import
  (:mod:`.backends.cpu`).
- ``TORCH_SPARSE_METAL_POISON`` (boolean, default off): outputs the kernels overwrite start as NaN (tests;
  :mod:`.backends.mps`; :mod:`.backends.cpu` passes it to the C++ kernels of the CPU and CUDA).
- ``TORCH_SPARSE_METAL_SPARSE_MPS`` (boolean, default on; read at import): off, importing the package registers
  no kernel for torch's own sparse ops on MPS (:mod:`.sparse_mps_ops`, whose ``register()`` and ``unregister()``
  also switch them at run time).
- ``TORCH_SPARSE_METAL_METAL`` (``kernels`` or ``reference``, default kernels; read at each MPS call until
  :func:`.backends.mps.use_reference` decides): ``reference`` runs the MPS ops on the reference path built from
  torch's own ops (:mod:`.backends.mps_reference`) instead of the Metal kernels.
- ``TORCH_SPARSE_METAL_PASSIVE_WAIT`` (set by the commands, not by hand): ``1`` beside ``OMP_WAIT_POLICY=passive``
  where a command chose passive OpenMP waits itself (:func:`._cli.wait_passively`), so that its start-up line
  says so.

The package's on/off switches set from code (:func:`.tuning.enable`, :func:`.backends.metal.use_reference`) take
``True`` or ``False`` only, checked by :func:`switch`, as torch's own do (``torch.use_deterministic_algorithms``).

Example:
    >>> import os
    >>> os.environ["TORCH_SPARSE_METAL_EXAMPLE"] = " Off "
    >>> flag("TORCH_SPARSE_METAL_EXAMPLE", default=True)
    False
    >>> os.environ["TORCH_SPARSE_METAL_EXAMPLE"] = "maybe"
    >>> flag("TORCH_SPARSE_METAL_EXAMPLE", default=True)
    Traceback (most recent call last):
    ...
    ValueError: TORCH_SPARSE_METAL_EXAMPLE='maybe' is not a boolean: use one of 1, 0, true, false, yes, no, on, off
    >>> del os.environ["TORCH_SPARSE_METAL_EXAMPLE"]
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["FALSE", "TRUE", "choice", "flag", "switch", "text"]

#: The boolean spellings, lower case.
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def text(name: str) -> str | None:
    """The stripped value of environment variable ``name``; None when it is unset or empty."""
    value = os.environ.get(name, "").strip()
    return value or None


def flag(name: str, default: bool) -> bool:
    """The boolean setting ``name`` (``default`` when unset or empty)."""
    value = text(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in TRUE:
        return True
    if lowered in FALSE:
        return False
    accepted = ", ".join(v for pair in zip(TRUE, FALSE) for v in pair)
    raise ValueError(f"{name}={os.environ[name]!r} is not a boolean: use one of {accepted}")


def choice(name: str, choices: Sequence[str], default: str) -> str:
    """The setting ``name``, one of ``choices`` (lower-case names; ``default`` when unset or empty)."""
    value = text(name)
    if value is None:
        return default
    if value.lower() in choices:
        return value.lower()
    raise ValueError(f"{name}={os.environ[name]!r} is not one of {', '.join(choices)}")


def switch(name: str, value: object, *, allow_none: bool = False) -> bool | None:
    """``value`` for the on/off switch ``name`` when it is a ``bool`` (or None, with ``allow_none``); anything else
    raises a ``TypeError`` naming the switch. ``bool()`` of a string is True for ``"off"``, ``"false"`` and ``"0"``
    alike, so a switch that took any value would turn on what the caller meant to turn off.

    Example:
        >>> switch("enable(on)", False)
        False
        >>> switch("enable(on)", "off")
        Traceback (most recent call last):
        ...
        TypeError: enable(on) must be True or False, got 'off' (str)
    """
    if isinstance(value, bool) or (allow_none and value is None):
        return value
    accepted = "True, False or None" if allow_none else "True or False"
    raise TypeError(f"{name} must be {accepted}, got {value!r} ({type(value).__name__})")
