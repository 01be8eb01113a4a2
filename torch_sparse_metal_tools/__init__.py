"""The commands that ship beside the library, in the same wheel: each runs as ``python -m`` from an installed wheel.

- :mod:`.selfcheck`: ``python -m torch_sparse_metal_tools.selfcheck``, every kernel against float64 and the CPU
  backend, with a PASS/FAIL verdict and a timing table (the check a Mac user runs).
- :mod:`.bench`: ``python -m torch_sparse_metal_tools.bench``, the benchmark tables, JSON and plots.
- :mod:`.tune`: ``python -m torch_sparse_metal_tools.tune``, tunes ``auto`` ahead of a run, shows or clears the
  decisions.
- :mod:`.cli`, :mod:`.argtypes`, :mod:`.progress`: the command lines' shared helpers (device arguments, checked
  argument types, progress bars), also used by the training example (``examples/char_lm``).
- :mod:`.testing`: the float64 references and test axes that the self-check and the test suite share.

``import torch_sparse_metal`` loads none of these; they import the library, never the other way round.
"""
