"""How a generated entry point passes a kernel's parameters, shared by the CPU executor and the CUDA translation.

Each target keeps the built-ins of a thread in a ``tsm_ids`` struct (``tsm_abi.h``); a parameter with a
built-in attribute is read from it, converted to the type the kernel declares.

Example:
    >>> from torch_sparse_metal.testing.msl.source import Param
    >>> builtin_argument(Param("builtin", None, "thread_index_in_simdgroup", "uint", "lane"), "t.")
    '(uint)(t.thread_index_in_simdgroup)'
"""

from __future__ import annotations

from collections.abc import Callable

from .source import Kernel, Param

__all__ = ["builtin_argument", "kernel_call"]

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
