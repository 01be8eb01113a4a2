"""Compares two runs of benchmarks/transformer_shapes.py case by case: ours fwd and step (us) and the step's ratio to
dense bf16 (each run against its own dense baseline).

    python benchmarks/ab_compare.py before.json after.json
"""

import json
import sys


def cases(path: str) -> dict:
    rows = json.load(open(path))["rows"]
    return {(r["out_features"], r["in_features"], r["tokens"], r["density"], r["layout"]): r for r in rows
            if r["method"] == "ours"}


def main() -> None:
    a, b = cases(sys.argv[1]), cases(sys.argv[2])
    print(f"{'case':<36} {'fwd us A -> B':>20} {'step us A -> B':>22} {'step vs bf16 A -> B':>22}")
    for key in a:
        if key not in b:
            continue
        o, i, n, d, v = key
        ra, rb = a[key], b[key]
        lay = "unstr" if v == 1 else f"V{v}"
        name = f"{o}x{i} n{n} {d:.0%} {lay}"
        print(f"{name:<36} {ra['fwd']['ms'] * 1e3:8.1f} -> {rb['fwd']['ms'] * 1e3:8.1f}"
              f"  {ra['step']['ms'] * 1e3:9.1f} -> {rb['step']['ms'] * 1e3:9.1f}"
              f"  {ra['vs']['dense_bf16']['step']['x']:9.2f} -> {rb['vs']['dense_bf16']['step']['x']:6.2f}")


if __name__ == "__main__":
    main()
