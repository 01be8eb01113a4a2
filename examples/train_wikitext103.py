#!/usr/bin/env python
"""Train a character-level Transformer with SparseLinear layers on WikiText-103, sync-free.

Runs offline: without ``--data`` and without the optional ``datasets`` package (or hub access) it says so and
trains on the small corpus bundled with the package. Outputs go to ``--out`` (``log.json``, ``bpc.png``,
``checkpoint.pt``); ``--resume DIR`` continues a run exactly where it stopped.

Example:
    python examples/train_wikitext103.py --minutes 2 --device cpu
    python examples/train_wikitext103.py --data /path/to/wikitext-103-raw --minutes 4 --density 0.25
    python examples/train_wikitext103.py --data /path/to/wikitext-103-raw --minutes 4 --density 0.25 --dense
"""

from char_lm.cli import main

from torch_sparse_metal_tools.cli import wait_passively

if __name__ == "__main__":
    wait_passively()  # OpenMP threads sleep while they wait, unless OMP_WAIT_POLICY says otherwise
    raise SystemExit(main())
