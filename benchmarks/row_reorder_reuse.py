"""How much operand reuse a row reordering can create: the staged column unions of row windows, in the
topology's own order and after reordering its rows (issue #27, item 5).

A kernel that stages, for a window of R consecutive CSR rows, the union of their columns reads each staged
gathered row once per window instead of once per edge: the gathered traffic falls by ``reuse = E / sum_w |U_w|``
(E edges, U_w the column union of window w). With uniform density d, ``|U_w| = u * cols`` with
``u = 1 - (1 - d)^R`` (``expected_reuse``). A reordering helps only if it puts rows with shared columns into the
same window; this script measures the reuse in three orders:

- ``identity``: the rows as stored;
- ``minhash``: rows sorted by a few MinHash signatures of their column sets (the locality-sensitive hashing of
  Jiang, Hong and Agrawal, PPoPP 2020, reduced to its sort key);
- ``greedy``: each window filled by taking, one at a time, the unplaced row with the most columns in the
  window's union so far (an upper-bound-style heuristic: O(rows x E) work).

It runs on the CPU and needs no GPU. Usage:
    python benchmarks/row_reorder_reuse.py --json benchmarks/results/row_reorder_reuse.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from torch_sparse_metal import CSRTopology
from torch_sparse_metal.devices import cpu_model


def expected_reuse(density: float, rows_per_window: int) -> float:
    """``R d / u`` with ``u = 1 - (1 - d)^R``: the reuse of staged column unions under uniform density."""
    u = 1.0 - (1.0 - density) ** rows_per_window
    return rows_per_window * density / u if u > 0 else 1.0


def row_sets(topo: CSRTopology) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The forward's CSR (output rows over input columns) as (row_ptr, col) int64, and the column count."""
    return topo.col_ptr.long(), topo.src_by_dst.long(), topo.in_features


def window_reuse(row_ptr: torch.Tensor, col: torch.Tensor, cols: int, order: torch.Tensor, window: int) -> float:
    """E / (sum over windows of consecutive rows in ``order`` of their column-union size)."""
    rows = order.numel()
    counts = row_ptr[1:] - row_ptr[:-1]
    # Each edge's window, after the reordering: position of its row in `order`, divided by the window size.
    position = torch.empty_like(order)
    position[order] = torch.arange(rows)
    edge_row = torch.repeat_interleave(torch.arange(rows), counts)
    key = (position[edge_row] // window) * cols + col
    staged = torch.unique(key).numel()
    return col.numel() / staged if staged else 1.0


def minhash_order(row_ptr: torch.Tensor, col: torch.Tensor, cols: int, hashes: int, seed: int) -> torch.Tensor:
    """Rows sorted lexicographically by ``hashes`` MinHash values of their column sets (empty rows last)."""
    g = torch.Generator().manual_seed(seed)
    rows = row_ptr.numel() - 1
    counts = row_ptr[1:] - row_ptr[:-1]
    edge_row = torch.repeat_interleave(torch.arange(rows), counts)
    keys = []
    for _ in range(hashes):
        perm = torch.randperm(cols, generator=g)
        h = torch.full((rows,), cols, dtype=torch.long)
        h.scatter_reduce_(0, edge_row, perm[col], reduce="amin")
        keys.append(h)
    order = torch.arange(rows)
    for h in reversed(keys):  # stable sorts from the least significant key: lexicographic order
        order = order[torch.sort(h[order], stable=True).indices]
    return order


def greedy_order(row_ptr: torch.Tensor, col: torch.Tensor, cols: int, window: int) -> torch.Tensor:
    """Windows filled greedily: the next row is the unplaced one sharing most columns with the window's union."""
    rows = row_ptr.numel() - 1
    counts = row_ptr[1:] - row_ptr[:-1]
    edge_row = torch.repeat_interleave(torch.arange(rows), counts)
    placed = torch.zeros(rows, dtype=torch.bool)
    order: list[int] = []
    while len(order) < rows:
        union = torch.zeros(cols, dtype=torch.bool)
        for _ in range(min(window, rows - len(order))):
            overlap = torch.zeros(rows, dtype=torch.long)
            overlap.index_add_(0, edge_row, union[col].long())
            overlap[placed] = -1
            r = int(overlap.argmax())
            placed[r] = True
            order.append(r)
            union[col[row_ptr[r]:row_ptr[r + 1]]] = True
    return torch.tensor(order)


def measure(features: int, density: float, windows: list[int], greedy: bool, seed: int) -> list[dict]:
    """One random topology of ``features`` x ``features``: reuse per window size and order."""
    g = torch.Generator().manual_seed(seed)
    topo = CSRTopology.random(features, features, density, generator=g)
    row_ptr, col, cols = row_sets(topo)
    out = []
    for window in windows:
        orders = {"identity": torch.arange(features), "minhash": minhash_order(row_ptr, col, cols, 4, seed)}
        t0 = time.perf_counter()
        if greedy:
            orders["greedy"] = greedy_order(row_ptr, col, cols, window)
        greedy_s = time.perf_counter() - t0
        for name, order in orders.items():
            out.append({"features": features, "density": density, "edges": topo.nnz, "window": window,
                        "order": name, "reuse": window_reuse(row_ptr, col, cols, order, window),
                        "expected_uniform": expected_reuse(density, window),
                        **({"seconds": greedy_s} if name == "greedy" else {})})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.05])
    parser.add_argument("--windows", type=int, nargs="+", default=[32, 128, 256])
    parser.add_argument("--greedy-max-features", type=int, default=4096,
                        help="run the O(rows x E) greedy order only up to this size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = []
    for f in args.features:
        for d in args.densities:
            rows += measure(f, d, args.windows, f <= args.greedy_max_features, args.seed)
    print(f"{'features':>8} {'density':>7} {'window':>6} {'order':>8} {'reuse':>6} {'uniform':>7}")
    for r in rows:
        print(f"{r['features']:>8} {r['density']:>7.3f} {r['window']:>6} {r['order']:>8} {r['reuse']:>6.2f} "
              f"{r['expected_uniform']:>7.2f}")
    if args.json:
        meta = {"cpu": cpu_model(), "torch": torch.__version__, "seed": args.seed}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
