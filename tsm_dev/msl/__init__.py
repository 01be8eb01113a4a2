"""MSL-on-CPU executor and strict clang syntax pass for the Metal kernels (see docs/metal.md).

Example:
    >>> from tsm_dev.msl import compile_shader
    >>> lib = compile_shader("kernel void k(device int* o [[buffer(0)]], uint i [[thread_position_in_grid]]) "
    ...                      "{ o[i] = int(i); }")
    >>> dir(lib)
    ['k']
"""

from .executor import (
    EXECUTED,
    MAX_THREADGROUP_MEMORY,
    MAX_THREADS_PER_THREADGROUP,
    THREAD_EXECUTION_WIDTH,
    KernelFunction,
    ShaderLibrary,
    cache_dir,
    compile_shader,
)
from .source import MslCompileError, MslError, kernel_names

__all__ = [
    "EXECUTED",
    "MAX_THREADGROUP_MEMORY",
    "MAX_THREADS_PER_THREADGROUP",
    "THREAD_EXECUTION_WIDTH",
    "KernelFunction",
    "MslCompileError",
    "MslError",
    "ShaderLibrary",
    "cache_dir",
    "compile_shader",
    "kernel_names",
]
