"""How a generated entry point passes a kernel's parameters, shared by the CPU executor and the CUDA translation.

Each target keeps the built-ins of a thread in a ``tsm_ids`` struct (``tsm_abi.h``); a parameter with a
built-in attribute is read from it, converted to the type the kernel declares.

Example:
    >>> from tsm_dev.msl.source import Param
    >>> builtin_argument(Param("builtin", None, "thread_index_in_simdgroup", "uint", "lane"), "t.")
    '(uint)(t.thread_index_in_simdgroup)'
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any

import torch

from .source import Kernel, MslError, Param

__all__ = ["SCALAR_CASTS", "arg_cast", "builtin_argument", "kernel_call", "scalar_bytes"]

#: The integer ``arg_casts`` names: struct format and value range.
_INT_CASTS = {"int32": ("i", -2**31, 2**31), "int16": ("h", -2**15, 2**15), "int8": ("b", -2**7, 2**7),
              "uint8": ("B", 0, 2**8)}
#: The ``arg_casts`` names torch accepts (torch/csrc/mps/Module.cpp, ``OptionalArgCaster::setValue``).
SCALAR_CASTS = ("fp16", "bf16", *_INT_CASTS)
_INT64 = (-2**63, 2**63)

#: Built-ins that are one number in ``tsm_ids`` (the others are 3-vectors, bound as the declared scalar or vector).
_SCALAR_FIELDS = {
    "thread_index_in_threadgroup": "thread_index_in_threadgroup",
    "thread_index_in_simdgroup": "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup": "simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup": "simdgroups_per_threadgroup",
    "threads_per_simdgroup": "threads_per_simdgroup",
    "thread_execution_width": "threads_per_simdgroup",
}


def builtin_argument(p: Param, ids: str) -> str:
    """C++ expression for built-in parameter ``p``, the ids struct reached through ``ids`` (``"t->"``, ``"t."``)."""
    field = _SCALAR_FIELDS.get(p.attr)
    if field is not None:
        return f"({p.type})({ids}{field})"
    return f"tsm_bind::builtin<{p.type}>::get({ids}{p.attr})"


def kernel_call(k: Kernel, buffer_argument: Callable[[Param], str], ids: str) -> str:
    """The call of kernel ``k`` from a generated entry point: each ``[[buffer(i)]]`` parameter as
    ``buffer_argument`` spells it for the target, each built-in read from the ids struct through ``ids``."""
    function = k.function + (f"<{k.template_args}>" if k.template_args is not None else "")
    args = [buffer_argument(p) if p.kind == "buffer" else builtin_argument(p, ids) for p in k.params]
    return f"{function}({', '.join(args)});"


def arg_cast(arg_casts: Any, i: int) -> str | None:
    """The cast of scalar argument ``i``: ``arg_casts`` is None, one name for every scalar, or ``{index: name}``
    (torch/csrc/mps/Module.cpp, ``OptionalArgCaster``)."""
    if arg_casts is None:
        return None
    if isinstance(arg_casts, str):
        return arg_casts
    if isinstance(arg_casts, dict):
        return arg_casts.get(i)
    raise MslError(f"Unexpected caster arg type {type(arg_casts).__name__}")


def scalar_bytes(i: int, a: Any, cast: str | None) -> bytes:
    """Bytes of argument ``i``, a Python scalar or a non-empty list or tuple of them, as torch binds it
    (torch/csrc/mps/Module.cpp, ``OptionalArgCaster::setValue``): a ``float`` as float32, an ``int`` (a ``bool``
    too: it is a Python int) as int64; a list takes its first element's kind, and a list of ints refuses a float
    in it (a list of floats takes ints). ``cast`` (a key of :data:`SCALAR_CASTS`) converts the float32 or int64
    value, as C++'s static_cast does: to fp16 or bf16 rounded to nearest even, to an integer type truncated toward
    zero. Where torch's static_cast would wrap an integer or be undefined (a float out of range, NaN), this
    raises: such a value is a host bug either way.

    Example:
        >>> list(scalar_bytes(0, True, None))  # int64 1
        [1, 0, 0, 0, 0, 0, 0, 0]
        >>> list(scalar_bytes(0, [2.5, 1], "int32"))  # floats, truncated
        [2, 0, 0, 0, 1, 0, 0, 0]
    """
    if isinstance(a, (list, tuple)):
        if not a:
            raise MslError(f"argument {i}: Empty list/tuple can not be an argument to metal kernel")
        values, first = list(a), a[0]
        if isinstance(first, torch.Tensor):
            raise MslError(f"argument {i}: a list of tensors (an array of GPU addresses) is not emulated")
        if not isinstance(first, (int, float)):
            raise MslError(f"argument {i}: Unexpected argument types")
        is_float = isinstance(first, float)
        if not all(isinstance(v, (int, float) if is_float else int) for v in values):
            raise MslError(f"argument {i}: cannot bind {a!r}: its first element makes it a list of "
                           f"{'floats' if is_float else 'ints'}, and torch cannot cast the others to that")
    elif isinstance(a, (int, float)):
        values, is_float = [a], isinstance(a, float)
    else:
        raise MslError(f"argument {i}: Unsupported argument type {type(a).__name__}")
    if cast is not None and cast not in SCALAR_CASTS:
        raise MslError(f"argument {i}: Unsupported cast instruction {cast!r} (torch knows {', '.join(SCALAR_CASTS)})")
    if is_float:
        as_float32 = torch.tensor(values, dtype=torch.float64).to(torch.float32)
    elif any(not _INT64[0] <= v < _INT64[1] for v in values):
        raise MslError(f"argument {i}: {a!r} does not fit int64")
    if cast is None:
        return as_float32.numpy().tobytes() if is_float else struct.pack(f"<{len(values)}q", *values)
    if cast in ("fp16", "bf16"):
        wide = as_float32 if is_float else torch.tensor(values, dtype=torch.int64).to(torch.float32)
        return wide.to(torch.float16 if cast == "fp16" else torch.bfloat16).view(torch.int16).numpy().tobytes()
    ints = [int(v) if math.isfinite(v) else None for v in as_float32.tolist()] if is_float else values
    fmt, lo, hi = _INT_CASTS[cast]
    if any(v is None or not lo <= v < hi for v in ints):
        raise MslError(f"argument {i}: {a!r} does not fit arg_cast {cast!r} (torch's static_cast would wrap it or "
                       "be undefined)")
    return struct.pack(f"<{len(ints)}{fmt}", *ints)
