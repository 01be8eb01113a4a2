"""Failures that only a Mac produces, simulated over the executor for tests of the hosts' fail-safe: a library that
compiles but whose kernels' pipelines cannot be created (:class:`FailingPipelines`), as Apple's back-end compiler
can refuse a kernel after the Metal front end accepted the library.

Example:
    >>> from tsm_dev.msl import compile_shader
    >>> compile_fn = FailingPipelines(compile_shader, lambda name: name.endswith("_bfloat"), reason="internal error")
    >>> lib = compile_fn("kernel void k_bfloat(device int* o [[buffer(0)]]) { o[0] = 1; }")
    >>> lib.k_bfloat
    Traceback (most recent call last):
    ...
    RuntimeError: Failed to created pipeline state object, error: internal error
    >>> compile_fn.attempts
    ['k_bfloat']
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["PIPELINE_ERROR", "FailingPipelines"]

#: What ``torch.mps.compile_shader``'s library raises where Metal cannot create a kernel's pipeline: a RuntimeError
#: (``TORCH_CHECK`` in ``MetalShaderLibrary::getLibraryPipelineState``, aten/src/ATen/native/mps/OperationUtils.mm,
#: spelled as torch spells it), followed by Metal's description of the error.
PIPELINE_ERROR = "Failed to created pipeline state object, error: "
#: The description a simulated failure carries (an internal error of the back-end compiler, as Metal reports one).
INTERNAL_ERROR = 'Error Domain=AGXMetal Code=3 "Compiler encountered an internal error"'


class FailingPipelines:
    """A compile function over ``compile_fn`` (the executor's) whose libraries cannot create the pipeline of each
    kernel that ``fails`` picks by name: looking one up raises torch's RuntimeError, at every lookup (torch keeps
    only the pipelines it created, so it tries again each time). ``attempts`` lists those lookups, in order."""

    def __init__(self, compile_fn: Callable[[str], Any], fails: Callable[[str], bool], reason: str = INTERNAL_ERROR):
        self._compile_fn, self._fails, self._reason = compile_fn, fails, reason
        self.attempts: list[str] = []

    def __call__(self, source: str) -> Any:
        return _Library(self._compile_fn(source), self)


class _Library:
    """A compiled library whose picked kernels' pipelines fail (:class:`FailingPipelines`)."""

    def __init__(self, library: Any, faults: FailingPipelines):
        self._library, self._faults = library, faults

    def __getattr__(self, name: str) -> Any:
        faults = self.__dict__["_faults"]
        if not name.startswith("__") and faults._fails(name):
            faults.attempts.append(name)
            raise RuntimeError(PIPELINE_ERROR + faults._reason)
        return getattr(self.__dict__["_library"], name)

    def __dir__(self) -> list[str]:
        return dir(self._library)
