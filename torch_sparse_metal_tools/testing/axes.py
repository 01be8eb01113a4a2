"""The test matrix, from the op contract (``csrc/contract.h``): devices, dtypes, strategies, and the error bound
a result in each dtype must meet. Every backend's tests take their axes from here.

Example:
    >>> from torch_sparse_metal_tools.testing import axes
    >>> "cpu" in axes.DEVICES and torch.bfloat16 in axes.dtypes("cpu")
    True
"""

from __future__ import annotations

import torch

from torch_sparse_metal import devices
from torch_sparse_metal.contract import DTYPES, supported_dtypes
from torch_sparse_metal.strategy import CONCRETE

__all__ = ["DEVICES", "STRATEGIES", "assert_within_bound", "dtypes", "error_bound"]

#: Device types with kernels that this machine runs (the CPU always; CUDA and MPS when torch sees them).
DEVICES = devices.available()
#: The concrete backward strategies, as the ops take them.
STRATEGIES = tuple(s.value for s in CONCRETE)


def dtypes(device_type: str) -> tuple[torch.dtype, ...]:
    """The value dtypes with kernels on ``device_type``."""
    return supported_dtypes(device_type)


def error_bound(dtype: torch.dtype, terms: int, magnitude: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on ``|result - exact|`` for a sum of ``terms`` products computed by the kernels in
    ``dtype`` from inputs already in ``dtype`` (the float64 reference uses the same rounded inputs):

    - summing in the accumulate type (float32 for the 16-bit types) in any order: at most
      ``gamma_n * sum|products|`` with ``gamma_n = n u / (1 - n u)`` (Higham, *Accuracy and Stability of Numerical
      Algorithms*, 2nd ed., eq. 3.5), ``u`` the accumulate type's unit roundoff and ``magnitude`` = sum|products|;
    - then one rounding to ``dtype``: at most ``u_dtype * |exact|`` (plus the same factor on the first term).

    A product missing or counted twice is off by about ``magnitude / terms``, far outside the bound.
    """
    u_acc = torch.finfo(DTYPES[dtype].accumulate).eps / 2
    u_out = torch.finfo(dtype).eps / 2
    n = max(terms, 1)
    gamma = n * u_acc / (1 - n * u_acc)
    return (1 + u_out) * gamma * magnitude + u_out * exact.abs() + torch.finfo(dtype).tiny


def assert_within_bound(what: str, got: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, terms: int,
                        dtype: torch.dtype) -> None:
    """``got`` (any device, ``dtype``) against the float64 ``exact`` within :func:`error_bound`; NaN (an element
    the kernels never wrote, under poisoning) fails."""
    got = got.detach().double().cpu()
    assert got.shape == exact.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(exact.shape)}"
    err = (got - exact).abs()
    bound = error_bound(dtype, terms, magnitude, exact)
    bad = ~(err <= bound)  # NaN compares false
    if bad.any():
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(f"{what} ({dtype}, {terms} terms): {int(bad.sum())} of {got.numel()} elements outside "
                             f"the bound; first at flat index {i}: got {got.flatten()[i].item()!r}, exact "
                             f"{exact.flatten()[i].item()!r}, bound {bound.flatten()[i].item():.3g}")
