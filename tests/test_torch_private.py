"""The private torch symbols of the op core: all of them come from torch_sparse_metal/_torch_private.py, each name
there is torch's own object (not a stand-in), and the running torch is a release they were checked against."""

from __future__ import annotations

import ast
from pathlib import Path

import torch
from torch.autograd import forward_ad

from torch_sparse_metal import _torch_private

PACKAGE = Path(_torch_private.__file__).parent
#: The op core: the modules that enter the autograd rule.
OP_CORE = [PACKAGE / "functional.py", *sorted((PACKAGE / "ops").glob("*.py"))]


def _private_uses(path: Path) -> list[str]:
    """``torch._x`` attribute chains and ``from torch._x`` / ``torch.m._x`` imports in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            found += [f"{node.module}.{a.name}" for a in node.names
                      if any(p.startswith("_") for p in [*node.module.split("."), a.name])]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain = ast.unparse(node)
            if chain.startswith(("torch.", "forward_ad.")):
                found.append(chain)
    return found


def test_the_op_core_reaches_private_torch_only_through_one_module():
    assert {str(p.relative_to(PACKAGE)): _private_uses(p) for p in OP_CORE} == {
        str(p.relative_to(PACKAGE)): [] for p in OP_CORE}
    assert _private_uses(PACKAGE / "_torch_private.py")  # the module itself does use them


def test_the_names_are_torchs_own_and_this_torch_was_checked():
    assert _torch_private.AutoDispatchBelowAutograd is torch._C._AutoDispatchBelowAutograd
    assert _torch_private.make_autograd_impl is torch._library.autograd.make_autograd_impl
    assert _torch_private.peek_interpreter_stack is torch._C._functorch.peek_interpreter_stack
    assert ".".join(torch.__version__.split("+")[0].split(".")[:2]) in _torch_private.CHECKED_TORCH
    assert _torch_private.forward_ad_level() == -1
    with forward_ad.dual_level():
        assert _torch_private.forward_ad_level() == 0 and _torch_private.forward_grad_enabled()
