"""Docstring examples of the Metal hosts (torch_sparse_metal/backends/) run on CPU tensors: their ``compile_shader``
is the repository's MSL-on-CPU executor (tsm_dev.msl), standing in for ``torch.mps.compile_shader`` as it does in the
tests, so that the shipped examples themselves import no development tool."""

import pytest
from _pytest.doctest import DoctestItem


@pytest.fixture(autouse=True)
def _metal_executor_for_doctests(request, doctest_namespace):
    if isinstance(request.node, DoctestItem):
        from tsm_dev.msl import compile_shader

        doctest_namespace["compile_shader"] = compile_shader
