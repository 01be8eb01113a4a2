"""The Metal backend's platform facts, used when MPS is used or something fails: the torch and macOS checks
(:func:`check_mps_support`), the Metal language version ``torch.mps.compile_shader`` compiles at, and the errors of a
library that fails to compile, a kernel whose pipeline cannot be created, or a library that lacks a kernel (what the
user reports, and how).
"""

from __future__ import annotations

import platform
from typing import Any

import torch

from torch_sparse_metal.backends.metal_contract import (
    KERNEL_DTYPES,
    METAL_TYPE_VERSIONS,
    MIN_MACOS,
    MIN_TORCH,
    TORCH_MIN_MACOS,
    MetalUnavailable,
)
from torch_sparse_metal.settings import text

__all__ = ["check_mps_support", "compile_error", "metal_version", "missing_kernel_error", "pipeline_error"]
#: The command whose output a report of a failure carries.
REPORT_COMMAND = "python -m torch_sparse_metal_tools.selfcheck --json report.json"


def _release(text: str) -> tuple[int, int]:
    """``"2.15.0a0+git1"`` -> ``(2, 15)``, ``"26.1"`` -> ``(26, 1)``."""
    parts = (text.split("+")[0].split(".") + ["0"])[:2]
    return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts)  # type: ignore[return-value]


def check_mps_support(torch_version: str | None = None, mac_version: str | None = None) -> None:
    """Raise a clear error if this torch or macOS cannot run the Metal kernels (only called when MPS is used).
    ``torch_version`` and ``mac_version`` default to this process's (``torch.__version__``,
    ``platform.mac_ver()``)."""
    torch_version = torch.__version__ if torch_version is None else torch_version
    mac = platform.mac_ver()[0] if mac_version is None else mac_version
    release = _release(torch_version)
    if release < MIN_TORCH or not hasattr(torch.mps, "compile_shader"):
        raise RuntimeError(f"torch_sparse_metal's Metal kernels need torch >= {'.'.join(map(str, MIN_TORCH))} "
                           f"(torch.mps.compile_shader); this is torch {torch_version}")
    if mac and _release(mac) < MIN_MACOS:
        raise RuntimeError(f"torch_sparse_metal's Metal kernels need macOS >= {'.'.join(map(str, MIN_MACOS))} "
                           f"(Metal 3.1); this is macOS {mac}")
    newer = [(first, macos) for first, macos in TORCH_MIN_MACOS if release >= first]
    if mac and newer and _release(mac) < newer[-1][1]:
        first, macos = newer[-1]
        raise RuntimeError(f"torch {torch_version} runs MPS on macOS >= {'.'.join(map(str, macos))} only; this is "
                           f"macOS {mac}: update macOS, or install torch < {'.'.join(map(str, first))}")
    if not torch.backends.mps.is_available():
        raise RuntimeError("MPS is not available on this machine (torch.backends.mps.is_available() is False)")


def metal_version(torch_version: str | None = None, mac_version: str | None = None) -> str:
    """The Metal language version ``torch.mps.compile_shader`` compiles at here, as text: it depends on torch and
    macOS (docs/metal.md, "Supported versions"; ``PYTORCH_MPS_METAL_VERSION`` where torch >= 2.15 reads it).

    Example:
        >>> metal_version("2.13.0", "15.2"), metal_version("2.10.1", "26.0"), metal_version("2.7.0", "13.6")
        ('3.2', '3.1', '3.0')
    """
    release = _release(torch.__version__ if torch_version is None else torch_version)
    mac = _release((platform.mac_ver()[0] if mac_version is None else mac_version) or "0")
    if release >= (2, 15) and text("PYTORCH_MPS_METAL_VERSION"):
        return str(text("PYTORCH_MPS_METAL_VERSION"))
    if mac == (0, 0):
        return "unknown (not macOS)"
    if release >= (2, 13):
        return "4.0" if mac >= (26, 0) else "3.2" if mac >= (15, 0) else "3.1"
    return "3.0" if mac < (14, 0) else "3.1"


def _unavailable(host: Any, dtype: torch.dtype, what: str, error: BaseException, log: str) -> MetalUnavailable:
    """The error of ``host``'s kernels of ``dtype`` that cannot run here (``what`` happened): the family, dtype,
    Metal language, torch and macOS versions, where to report it, and ``error`` under the heading ``log``."""
    return MetalUnavailable(
        f"torch_sparse_metal: the Metal kernels of {host.family} for {dtype} {what} (Metal language "
        f"{metal_version()}, torch {torch.__version__}, macOS {platform.mac_ver()[0] or 'none'}); other dtypes are "
        f"not affected. Please report it in an issue of torch_sparse_metal, with this message and the report of "
        f"`{REPORT_COMMAND}` attached.\n"
        f"{log}:\n{type(error).__name__}: {error}", host.family, dtype)


def compile_error(host: Any, dtype: torch.dtype, error: BaseException) -> MetalUnavailable:
    """The error of ``host``'s library for ``dtype`` that failed to compile, with the compiler's log."""
    return _unavailable(host, dtype, "failed to compile", error, "Compiler log")


def pipeline_error(host: Any, dtype: torch.dtype, name: str, error: BaseException) -> MetalUnavailable:
    """The error of kernel ``name`` of ``host``'s library for ``dtype``, which compiled, but whose pipeline could not
    be created (the step where Apple's back-end compiler turns the kernel into GPU code), with torch's error."""
    return _unavailable(host, dtype, f"cannot run: the library compiled, but the pipeline of kernel {name} could not "
                        "be created (Apple's back-end compiler, at the kernel's first dispatch)", error,
                        "Pipeline error")


def missing_kernel_error(name: str, dtype: torch.dtype) -> RuntimeError:
    """The error of a compiled library that lacks kernel ``name`` (of ``dtype``)."""
    version, mac = METAL_TYPE_VERSIONS.get(KERNEL_DTYPES[dtype], (None, None))
    if version is None:
        return RuntimeError(f"the compiled Metal library has no kernel {name}: the shaders and the host code "
                            "disagree (reinstall torch_sparse_metal)")
    return RuntimeError(f"this Mac's Metal compiler built no {dtype} kernels (they need Metal "
                        f"{version // 100}.{version % 100 // 10}, {mac} or newer); use float32 or float16")
