"""How a generated entry point passes a kernel's parameters, shared by the CPU executor and the CUDA translation.

Each target keeps the built-ins of a thread in a ``tsm_ids`` struct (``tsm_abi.h``); a parameter with a
built-in attribute is read from it, converted to the type the kernel declares.

Example:
    >>> from tsm_dev.msl.source import Param
    >>> builtin_argument(Param("builtin", None, "thread_index_in_simdgroup", "uint", "lane"), "t.")
    '(uint)(t.thread_index_in_simdgroup)'
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

import torch

from .source import Kernel, MslError, Param

__all__ = ["SCALAR_CASTS", "builtin_argument", "kernel_call", "scalar_bytes"]

#: ``arg_casts`` names: the type a Python scalar (or each element of a list) is bound as, and its struct format
#: (None: bfloat16, which struct lacks; torch rounds it).
SCALAR_CASTS = {"int64": "q", "int32": "i", "int16": "h", "int8": "b", "uint8": "B", "bool": "?",
                "float32": "f", "fp32": "f", "float": "f", "float16": "e", "fp16": "e", "half": "e",
                "bfloat16": None, "bf16": None, "bfloat": None}

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


def scalar_bytes(i: int, a: Any, cast: str | None) -> bytes:
    """Bytes of argument ``i``, a Python scalar or list, as ``compile_shader`` binds it: an int as int64, a float
    as float32, a bool as one byte, unless ``cast`` (a key of :data:`SCALAR_CASTS`) names another type."""
    if cast is not None and cast not in SCALAR_CASTS:
        raise MslError(f"argument {i}: unsupported arg_cast {cast!r}; known: {sorted(SCALAR_CASTS)}")
    values = list(a) if isinstance(a, (list, tuple)) else [a]
    if not all(isinstance(v, (int, float)) for v in values):
        raise MslError(f"argument {i}: cannot bind a {type(a).__name__}")
    if cast is None:
        cast = "bool" if isinstance(a, bool) else "int64" if all(isinstance(v, int) for v in values) else "float32"
    fmt = SCALAR_CASTS[cast]
    try:
        if fmt is None:  # bfloat16: rounded to nearest even by torch, bound as its 16 bits
            fmt, values = "h", torch.tensor(values, dtype=torch.bfloat16).view(torch.int16).tolist()
        return struct.pack(f"<{len(values)}{fmt}", *values)
    except struct.error as e:
        raise MslError(f"argument {i}: {a!r} does not fit arg_cast {cast!r}: {e}") from None
