"""Where a module sits in a model: every name it is registered under, and replacing it there."""

from __future__ import annotations

from torch import nn

__all__ = ["registered_names", "set_submodule"]


def registered_names(model: nn.Module, module: nn.Module) -> list[str]:
    """Every name under which ``module`` is registered in ``model`` (a shared module has several)."""
    return [name for name, m in model.named_modules(remove_duplicate=False) if m is module]


def set_submodule(model: nn.Module, name: str, module: nn.Module | None) -> None:
    """Register ``module`` under the dotted ``name`` of ``model`` (None leaves the slot empty)."""
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent), child, module)
