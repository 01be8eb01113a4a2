"""Markdown table of the Metal designs (through the CUDA translation) against our CUDA kernels, from the JSON of
one or more ``python -m tsm_dev.metal_bench --device cuda`` runs of the same cases (see
``tsm_dev.metal_bench.metal_table``).

Example:
    python benchmarks/metal_table.py benchmarks/results/metal_h200_2026-12-01/final_graphs_rep*.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tsm_dev lives in the checkout, not installed
from tsm_dev.metal_bench import metal_table  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", nargs="+", type=Path)
    args = parser.parse_args()
    print(metal_table([json.loads(p.read_text()) for p in args.json]))
