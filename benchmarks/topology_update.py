"""Cost of one topology update (prune + regrow + optimizer-state carry) against one training step.

    python benchmarks/topology_update.py --device cpu [--reps 5] [--out benchmarks/results/topology_cpu.json]

For each case, a SparseLinear layer with AdamW: the median over --reps of (a) one training step (forward,
backward, optimizer step) and (b) one update at drop fraction 0.3 for SET and RigL (RigL's dense gradient
in chunks of 256 output rows), both timed with a device synchronisation at the end. Prints a table and the
ratio update / step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from torch_sparse_metal import SparseLinear
from torch_sparse_metal.evolve import apply_update, plan_update
from torch_sparse_metal.timing import median_ms

# (in, out, edges, batch): the published edge counts (docs/metal.md) in a 1024-wide layer, and 4096^2 at 1% and 5%
CASES = [
    (1024, 1024, 22_000, 256),
    (1024, 1024, 61_000, 256),
    (4096, 4096, 167_772, 256),
    (4096, 4096, 838_861, 256),
]


def run(device: torch.device, reps: int) -> list[dict]:
    rows = []
    for in_f, out_f, edges, batch in CASES:
        g = torch.Generator().manual_seed(0)
        layer = SparseLinear(in_f, out_f, density=edges / (in_f * out_f), device=device, generator=g)
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-3)
        x = torch.randn(batch, in_f, device=device)
        grad_out = torch.randn(batch, out_f, device=device)

        def step(layer=layer, opt=opt, x=x, grad_out=grad_out):
            layer(x).backward(grad_out)
            opt.step()
            opt.zero_grad(set_to_none=True)

        row = dict(in_features=in_f, out_features=out_f, nnz=layer.nnz, batch=batch, device=str(device))
        row["step_ms"] = median_ms(step, device, reps)
        for mode in ("set", "rigl"):
            def update(mode=mode, layer=layer, opt=opt, x=x, grad_out=grad_out, g=g):
                drop = round(0.3 * layer.nnz)
                topology, edge_map = plan_update(layer, drop, drop, mode=mode, grad=(x, grad_out), generator=g)
                apply_update(layer, topology, edge_map, [opt])

            row[f"{mode}_update_ms"] = median_ms(update, device, reps)
        rows.append(row)
        print(f"{in_f}x{out_f} nnz={layer.nnz:>8} B={batch}: step {row['step_ms']:8.2f} ms | "
              f"SET update {row['set_update_ms']:8.2f} ms ({row['set_update_ms'] / row['step_ms']:.1f} steps) | "
              f"RigL update {row['rigl_update_ms']:8.2f} ms ({row['rigl_update_ms'] / row['step_ms']:.1f} steps)",
              flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}")
    rows = run(device, args.reps)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
