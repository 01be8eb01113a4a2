"""Markdown table of the Metal designs (through the CUDA translation) against our CUDA kernels, from the JSON of
one or more ``python -m torch_sparse_metal.bench --device cuda --metal-designs`` runs of the same cases (see
``torch_sparse_metal.bench.metal_table``).

Example:
    python benchmarks/metal_table.py benchmarks/results/metal_h200_2026-12-01/final_graphs_rep*.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from torch_sparse_metal.bench import metal_table

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", type=Path)
    args = parser.parse_args()
    print(metal_table([json.loads(p.read_text()) for p in args.json]))
