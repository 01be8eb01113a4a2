"""Development tools of torch_sparse_metal, kept in the repository and not installed: the MSL-on-CPU executor, its
checker, the strict clang pass, the CUDA translation and the traffic model (:mod:`.msl`, :mod:`.traffic_model`),
and the fuzz and attack harnesses with crash isolation (:mod:`.fuzz`, :mod:`.op_attacks`, :mod:`.isolated`,
:mod:`.snapshot`). The test suite and the benchmark scripts import them from the repository root (pyproject's
pytest ``pythonpath``); ``import torch_sparse_metal`` loads none of them. docs/metal.md and docs/architecture.md
say what each is for.
"""
