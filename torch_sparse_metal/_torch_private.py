"""Every private torch symbol that the op core (``ops/``, ``functional.py``) uses, in one module, so that a torch
release that moves one breaks here, at import, with the name in the traceback, rather than somewhere in an op.

What each buys:

- ``make_autograd_impl``, ``AutogradInfo``: the Autograd kernel that ``torch.library.register_autograd`` would make
  for ``csr_linear``, built once and called from the op's own Autograd kernel, which first sends dual tensors
  and ``torch.func`` transforms elsewhere (``ops/_csr_linear.py``, ``_op_autograd``). The public
  ``register_autograd`` registers that kernel alone, which would lose forward-mode tangents silently.
- ``AutoDispatchBelowAutograd``: runs the forward op below the Autograd key inside ``CSRLinearFunction``, the eager
  entry of the rule, so an eager step skips the op's Python Autograd kernel (measured in docs/architecture.md,
  "Why the autograd rule has three entries").
- ``TransformType``, ``peek_interpreter_stack``, ``retrieve_all_functorch_interpreters``,
  ``functorch_transforms_active``, ``is_functorch_wrapped_tensor``: which ``torch.func`` transform is running
  (the raw op refuses the differentiating ones; the backward knows forward mode is active; tuning skips wrapped
  tensors).
- ``any_requires_grad``, ``forward_grad_enabled``, ``forward_ad_level``: whether a differentiating transform or a
  ``torch.autograd.forward_ad`` dual level can reach the op.
- ``is_fake``: fake tensors (``torch.compile`` tracing) are never timed by the tuner.
- ``jit_tracing_state``: under ``torch.jit.trace`` ``sparse_linear`` records the op as one node.
- ``global_module_hooks_set``: whether hooks registered for every module (``register_module_forward_hook`` and
  the like) are set: ``SparseDelta``'s fused product, which calls neither of its two modules, then calls them.

Checked against torch 2.13.0, the release this repository's CI installs (tests/test_torch_private.py imports every
name). The package supports torch 2.7 to 2.15 (setup.py); releases other than 2.13 are not installed here, so a name
missing there shows as an ImportError of this module.

Example:
    >>> forward_ad_level()  # no dual level is open
    -1
"""

from __future__ import annotations

from torch._C import _any_requires_grad as any_requires_grad
from torch._C import _are_functorch_transforms_active as functorch_transforms_active
from torch._C import _AutoDispatchBelowAutograd as AutoDispatchBelowAutograd
from torch._C import _get_tracing_state as jit_tracing_state
from torch._C import _is_fwd_grad_enabled as forward_grad_enabled
from torch._C._functorch import TransformType, is_functorch_wrapped_tensor, peek_interpreter_stack
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
from torch._library.autograd import Info as AutogradInfo
from torch._library.autograd import make_autograd_impl
from torch._subclasses.fake_tensor import is_fake
from torch.autograd import forward_ad
from torch.nn.modules import module as _module

#: The torch releases every name here was checked against.
CHECKED_TORCH = ("2.13",)

__all__ = ["CHECKED_TORCH", "AutoDispatchBelowAutograd", "AutogradInfo", "TransformType", "any_requires_grad",
           "forward_ad_level", "forward_grad_enabled", "functorch_transforms_active", "global_module_hooks_set",
           "is_fake",
           "is_functorch_wrapped_tensor", "jit_tracing_state", "make_autograd_impl", "peek_interpreter_stack",
           "retrieve_all_functorch_interpreters"]


def forward_ad_level() -> int:
    """The innermost open ``torch.autograd.forward_ad`` dual level, -1 when none is open (a private attribute)."""
    return forward_ad._current_level


def global_module_hooks_set() -> bool:
    """Whether any global module hook (``torch.nn.modules.module.register_module_forward_hook`` and the like) is
    registered: a call of any module runs them."""
    return bool(_module._global_forward_hooks or _module._global_forward_pre_hooks
                or _module._global_backward_hooks or _module._global_backward_pre_hooks)
