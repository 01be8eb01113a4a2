"""The Metal machinery every MPS host shares (``backends/mps_unstructured_csr_linear.py``: the unstructured layout's;
``backends/mps_vector_csr_linear.py``: the vector layout's): the shader files joined behind the host's constants and
our common header, the platform checks, the Metal type of each dtype, :func:`strategy_methods` (a host's kernels of
each backward strategy), and :class:`MetalHost`, one compiled library per instance and dtype with its kernel lookup,
the fall-back of a (family, dtype) whose kernels cannot run here to the reference path, launch sizes, poisoned outputs
and index-error words.

Example (on CPU tensors, with the MSL-on-CPU executor as ``compile_shader``, as the tests run it; on a Mac,
``torch.mps.compile_shader`` and ``device_type="mps"``)::

    >>> host = MetalHost(compile_shader, ("vector_csr_linear.metal",), device_type="cpu")
    >>> host.kernel("vector_spmm_v8", torch.float32).thread_execution_width
    32
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from torch_sparse_metal import settings
from torch_sparse_metal.backends import metal_platform, metal_source, mps_reference
from torch_sparse_metal.backends.metal_contract import (
    COMMON_HEADER,
    KERNEL_DTYPES,
    METAL_TYPE_VERSIONS,
    SHADER_CONSTANTS,
    SIMD_WIDTH,
    TARGET_ROWS,
    MetalUnavailable,
)
from torch_sparse_metal.backends.metal_platform import check_mps_support
from torch_sparse_metal.contract import INDEX_ARRAYS, STRATEGY_SPECS, Strategy

__all__ = [
    "CALLS_BY_PATH",
    "COMMON_HEADER",
    "KERNEL_DTYPES",
    "METAL_TYPE_VERSIONS",
    "MPS_ERROR_WORDS",
    "SHADER_CONSTANTS",
    "SIMD_WIDTH",
    "TARGET_ROWS",
    "MetalHost",
    "MetalUnavailable",
    "check_mps_support",
    "reference_forced",
    "strategy_methods",
    "use_reference",
]

#: What ``torch.mps.compile_shader``'s library raises for a kernel it does not hold (a RuntimeError from
#: ``MetalShaderLibrary::getLibraryPipelineState``, aten/src/ATen/native/mps/OperationUtils.mm).
_MISSING_FUNCTION = "Failed to create function state object for"
#: The MPS devices' error words, shared by every process-wide host, so that ``take_index_errors`` (and
#: :func:`torch_sparse_metal.check_index_errors`) sees every layout's kernels.
MPS_ERROR_WORDS: dict[torch.device, torch.Tensor] = {}
#: Calls of every host in this process by ``(family, dtype, path)``: ``path`` is ``"metal"`` (the family's kernels
#: ran) or ``"reference"`` (the reference path ran instead), so that the self-check can tell which really ran.
CALLS_BY_PATH: Counter[tuple[str, torch.dtype, str]] = Counter()
_calls_lock = threading.Lock()
_Result = TypeVar("_Result")


_force_reference: bool | None = None


def use_reference(on: bool | None = True) -> None:
    """Run every MPS op on the reference path (torch's own ops, :mod:`.mps_reference`) instead of the Metal kernels:
    ``True``/``False``; ``None`` follows ``TORCH_SPARSE_METAL_METAL`` (:mod:`torch_sparse_metal.settings`)."""
    global _force_reference
    _force_reference = settings.switch("use_reference(on)", on, allow_none=True)


def reference_forced() -> bool:
    """Whether the reference path is asked for (:func:`use_reference`, else ``TORCH_SPARSE_METAL_METAL``)."""
    if _force_reference is not None:
        return _force_reference
    return settings.choice("TORCH_SPARSE_METAL_METAL", ("kernels", "reference"), "kernels") == "reference"


def strategy_methods(host: type) -> dict[Strategy, Callable[..., Any]]:
    """The backward of each strategy of the contract on ``host``: its method named after the strategy (as the C++
    layouts name theirs, run_strategy in csrc/contract.h). A strategy added to csrc/contract.h that the host lacks is
    an ImportError naming it, at registration, instead of another strategy's kernels running.

    Example:
        >>> class Host:
        ...     def fused_atomic(self): ...
        >>> strategy_methods(Host)
        Traceback (most recent call last):
        ...
        ImportError: Host has no Metal kernels for strategies ['atomic_free'] (a method each, named after it)
    """
    missing = [s.value for s in STRATEGY_SPECS if not callable(getattr(host, s.value, None))]
    if missing:
        raise ImportError(f"{host.__name__} has no Metal kernels for strategies {missing} (a method each, named after "
                          "it)")
    return {s: getattr(host, s.value) for s in STRATEGY_SPECS}


class MetalHost:
    """What an op family's Metal host is built on: one compiled library per instance and dtype (lazily, once), so
    that a dtype whose kernels cannot run here costs only that family's calls of that dtype, which then run the
    reference path (:mod:`.mps_reference`, built from torch's own ops; also where the user asks for it:
    :func:`use_reference`). Kernels cannot run where the library fails to compile, or where a kernel's pipeline
    cannot be created (Apple's back-end compiler, at the kernel's first dispatch; :meth:`metal_or_reference`).

    ``compile_fn`` maps Metal source to a library object with one attribute per kernel, as
    ``torch.mps.compile_shader`` does; ``shader_files`` are the family's files in ``shaders/``. ``device_type`` is
    the device the tensors must be on (``"mps"``, or ``"cpu"`` under the executor). ``poison=True`` fills every
    output the kernels fully overwrite with NaN instead of leaving it uninitialised, so an element a kernel misses
    shows up in tests; by default it follows ``TORCH_SPARSE_METAL_POISON=1``, the switch the CPU kernels and
    tests/conftest.py use. ``error_words``: the per-device index-error words the kernels set (a fresh set by
    default; the process-wide MPS hosts share :data:`MPS_ERROR_WORDS`).
    """

    def __init__(self, compile_fn: Callable[[str], Any], shader_files: Sequence[str], device_type: str = "mps", *,
                 poison: bool | None = None, check_platform: Callable[[], None] | None = None,
                 error_words: dict[torch.device, torch.Tensor] | None = None):
        self.shader_files = tuple(shader_files)
        self._compile_fn = compile_fn
        self.device_type = device_type
        self.poison = settings.flag("TORCH_SPARSE_METAL_POISON", False) if poison is None else poison
        self._check_platform = check_platform
        self._libraries: dict[torch.dtype, Any] = {}
        #: dtype -> why this family's kernels of that dtype cannot run here (its library's compilation, or a kernel's
        #: pipeline creation); remembered, never retried.
        self.failures: dict[torch.dtype, MetalUnavailable] = {}
        self._lock = threading.Lock()
        self._error_words = {} if error_words is None else error_words

    @property
    def family(self) -> str:
        """The family's name in messages and in :data:`CALLS_BY_PATH`: its shader files."""
        return ", ".join(self.shader_files)

    def kernel_names(self, dtype: torch.dtype) -> list[str]:
        """Every kernel of ``dtype`` that this family dispatches (each host names its own)."""
        raise NotImplementedError(f"{type(self).__name__} does not list its kernels")

    # -------------------------------------------------------------------------------------------- library
    def source(self, dtype: torch.dtype | None = None) -> str:
        """The Metal source this host compiles for ``dtype`` (every dtype's kernels: None)."""
        return metal_source.load_source(self.shader_files, dtypes=None if dtype is None else (dtype,))

    @property
    def library(self) -> Any:
        """float32's compiled library (kept for callers of the one-library host; see :meth:`library_for`)."""
        return self.library_for(torch.float32)

    def library_for(self, dtype: torch.dtype) -> Any:
        """``dtype``'s compiled library (compiled on first use, once; a failure is remembered and raised again)."""
        lib = self._libraries.get(dtype)
        if lib is None:
            with self._lock:
                if dtype in self.failures:
                    raise self.failures[dtype]
                if dtype not in self._libraries:
                    if self._check_platform is not None:
                        self._check_platform()
                    source = self.source(dtype)  # outside the try: an error of ours is raised, never a fall-back
                    try:
                        self._libraries[dtype] = self._compile_fn(source)
                    except Exception as e:  # noqa: BLE001 - whatever the compiler raised: its log is the message
                        self.failures[dtype] = metal_platform.compile_error(self, dtype, e)
                        raise self.failures[dtype] from e
                lib = self._libraries[dtype]
        return lib

    def runs_reference(self, dtype: torch.dtype) -> bool:
        """Whether ``dtype``'s calls run the reference path: asked for (:func:`use_reference`), or this family's
        kernels of ``dtype`` cannot run here (:attr:`failures`; a library that fails to compile now is warned about
        once per process)."""
        if reference_forced() or dtype in self.failures:
            return True
        if dtype in self._libraries:
            return False
        try:
            self.library_for(dtype)
        except MetalUnavailable as e:  # the compiler's failure; the platform's refusal (no MPS) is raised as it is
            mps_reference.warn_fallback(e)
            return True
        return False

    def metal_or_reference(self, dtype: torch.dtype, kernels: Callable[[], _Result], reference: str,
                           *args: Any) -> _Result:
        """One call of this family in ``dtype``, its arguments checked: ``kernels()``, the Metal path, unless the
        dtype runs the reference path (:meth:`runs_reference`); the reference path's function of the same op
        (``reference``, a name in :mod:`.mps_reference`) on ``args`` instead, and also where a kernel's pipeline
        cannot be created at its first dispatch (:meth:`pipeline`): remembered for the family and dtype, so later
        calls go straight to the reference path, and warned about once per process. The kernels write only outputs
        of their own, so the reference path's result replaces whatever they began. Each call is counted in
        :data:`CALLS_BY_PATH` by the path that produced its result."""
        path = "reference"
        if not self.runs_reference(dtype):
            try:
                result = kernels()
                path = "metal"
            except MetalUnavailable as e:
                mps_reference.warn_fallback(e)
        if path == "reference":
            result = getattr(mps_reference, reference)(*args)
        with _calls_lock:
            CALLS_BY_PATH[self.family, dtype, path] += 1
        return result

    def run_forward(self, x: torch.Tensor, weight: torch.Tensor, index: tuple[torch.Tensor, ...], sizes: Any
                    ) -> torch.Tensor:
        """The layout's forward of arguments already checked (``sizes``: what the checks returned): its Metal kernels
        (``_forward_kernels``), or the reference path where they cannot run (:meth:`metal_or_reference`)."""
        return self.metal_or_reference(x.dtype, lambda: self._forward_kernels(x, weight, index, sizes), "forward",
                                       x, weight, index, sizes)

    def run_backward(self, grad_out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     index: tuple[torch.Tensor, ...], sizes: Any, strategy: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layout's backward of arguments already checked: its Metal kernels (``_backward_kernels``), or the
        reference path where they cannot run (:meth:`metal_or_reference`)."""
        return self.metal_or_reference(x.dtype, lambda: self._backward_kernels(grad_out, x, weight, index, sizes,
                                                                               strategy), "backward",
                                       grad_out, x, weight, index, sizes)

    def pipeline(self, name: str, dtype: torch.dtype) -> Any:
        """Kernel ``name`` of ``dtype``'s library, its pipeline created (``torch.mps.compile_shader``'s library
        creates it at this lookup and keeps only the ones it created). A kernel the library lacks is an error; a
        pipeline that cannot be created makes the family's kernels of ``dtype`` unavailable (:attr:`failures`):
        :class:`MetalUnavailable`, which :meth:`metal_or_reference` answers with the reference path."""
        lib = self.library_for(dtype)
        try:
            return getattr(lib, name)
        except RuntimeError as e:
            if _MISSING_FUNCTION in str(e):  # torch's answer for a kernel the library lacks
                raise metal_platform.missing_kernel_error(name, dtype) from e
            with self._lock:
                failure = self.failures.setdefault(dtype, metal_platform.pipeline_error(self, dtype, name, e))
            raise failure from e

    def kernel(self, stage: str, dtype: torch.dtype, p: int | None = None) -> Any:
        """The kernel ``<stage>_<Metal type>[_p<P>]`` of ``dtype``'s library (:meth:`pipeline`), e.g.
        ``kernel("spmm", torch.float32, 4)``."""
        return self.pipeline(f"{stage}_{KERNEL_DTYPES[dtype]}" + ("" if p is None else f"_p{p}"), dtype)

    # ------------------------------------------------------------------------------------------ launches
    @staticmethod
    def _rows(fn: Any, p: int | None = None) -> int:
        """SIMD-groups per threadgroup: TARGET_ROWS, within the pipeline's thread limit and, for the tiled
        kernels, the rows their threadgroup tile holds (its static length: (32 * P + 1) floats a row)."""
        width = int(fn.thread_execution_width)
        if width != SIMD_WIDTH:
            raise RuntimeError(f"the Metal kernels are written for {SIMD_WIDTH}-wide SIMD-groups; this GPU's "
                               f"threadExecutionWidth is {width}")
        rows = min(TARGET_ROWS, int(fn.max_threads_per_threadgroup) // width)
        tile_bytes = int(getattr(fn, "static_thread_group_memory_length", 0) or 0)
        if p is not None and tile_bytes:  # a pipeline that reports no length: the shaders' tile holds TARGET_ROWS
            rows = min(rows, tile_bytes // ((SIMD_WIDTH * p + 1) * 4))
        if rows < 1:
            raise RuntimeError(f"kernel {fn} allows too few threads per threadgroup "
                               f"({fn.max_threads_per_threadgroup}) for one SIMD-group")
        return rows

    def _empty(self, shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """An output on ``like``'s device, of ``like``'s dtype unless ``dtype`` is given: uninitialised, or NaN
        when poisoning."""
        dtype = like.dtype if dtype is None else dtype
        if self.poison:
            return torch.full(shape, float("nan"), dtype=dtype, device=like.device)
        return torch.empty(shape, dtype=dtype, device=like.device)

    # -------------------------------------------------------------------------------------- index errors
    def _errors(self, device: torch.device, first: str) -> torch.Tensor:
        """The error words from index array ``first`` on (a kernel's pointer array, then its index array)."""
        words = self._error_words.get(device)
        if words is None:
            words = self._error_words[device] = torch.zeros(len(INDEX_ARRAYS), dtype=torch.int32, device=device)
        return words[INDEX_ARRAYS.index(first):]

    def take_index_errors(self, device: torch.device) -> list[int]:
        """Reads and clears ``device``'s error words (one per index array of ``INDEX_ARRAYS``; nonzero where a
        kernel met an out-of-range index). Waits for the device."""
        words = self._error_words.get(torch.device(device))
        if words is None:
            return [0] * len(INDEX_ARRAYS)
        seen = words.tolist()
        words.zero_()
        return seen

    # --------------------------------------------------------------------------------------------- checks
    def _check_device(self, x: torch.Tensor) -> None:
        """What only this backend requires; the op's own checks are the Python boundary's (ops/_csr_linear.py)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a tensor, got {type(x).__name__}")
        if x.device.type != self.device_type:
            raise RuntimeError(f"the Metal kernels run on {self.device_type} tensors, got x on {x.device}")
        if x.dtype not in KERNEL_DTYPES:
            names = ", ".join(str(d) for d in KERNEL_DTYPES)
            raise TypeError(f"x has dtype {x.dtype}; the Metal kernels support {names}")
