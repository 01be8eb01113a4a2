#!/usr/bin/env python
"""Sparsify an existing dense model in one call, then fine-tune it: the char-level Transformer of the training
example, trained dense, its block matrices replaced by SparseLinear layers that keep the largest weights.

Prints the validation BPC of the dense model, of the pruned model before any fine-tuning, and after
fine-tuning, with the nonzero parameter counts. Offline it uses the corpus bundled with the package.

Example:
    python examples/sparsify_model.py --steps 1000 --finetune-steps 300 --density 0.25 --device cpu
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from torch_sparse_metal import SparseLinear, sparsify
from torch_sparse_metal.train import CharTransformer, ModelConfig, WindowSampler, evaluate_bpc, load_corpus


def train(model: torch.nn.Module, sampler: WindowSampler, steps: int, lr: float) -> None:
    """AdamW with a cosine schedule; the loss stays on the device (no host read per step)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.99))
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps, eta_min=lr / 10)
    model.train()
    for _ in range(steps):
        x, y = sampler.sample()
        loss = model.loss(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()


def nonzero_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # SparseLinear stores only its edges


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=None, help="a text file or WikiText folder (default: bundled)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=1000, help="dense training steps")
    p.add_argument("--finetune-steps", type=int, default=300, help="fine-tuning steps after sparsify")
    p.add_argument("--density", type=float, default=0.25, help="fraction of each block matrix kept")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--eval-chars", type=int, default=1 << 15)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    torch.manual_seed(args.seed)
    corpus = load_corpus(args.data, allow_download=False).to(args.device)
    cfg = ModelConfig(vocab_size=corpus.vocab.size, context=args.context, d_model=args.d_model, n_layers=2,
                      n_heads=2, sparse=False)
    model = CharTransformer(cfg, generator=torch.Generator().manual_seed(args.seed)).to(args.device)
    sampler = WindowSampler(corpus.train, cfg.context, args.batch_size, seed=args.seed + 1)

    def bpc() -> float:
        return evaluate_bpc(model, corpus.valid, args.eval_chars, 64)

    train(model, sampler, args.steps, lr=2e-3)
    results = {"dense": bpc()}
    dense_params = nonzero_params(model)
    # the block matrices only: embeddings and the output head stay dense
    sparsify(model, density=args.density, filter=lambda name, module: name.startswith("blocks."))
    results["sparsified"] = bpc()
    train(model, sampler, args.finetune_steps, lr=1e-3)
    results["fine-tuned"] = bpc()
    layers = sum(isinstance(m, SparseLinear) for m in model.modules())
    print(f"| model | nonzero parameters | val BPC |\n|---|---|---|\n| dense, {args.steps} steps | {dense_params:,} | "
          f"{results['dense']:.4f} |\n| sparsified to density {args.density:g} ({layers} SparseLinear layers) | "
          f"{nonzero_params(model):,} | {results['sparsified']:.4f} |\n| fine-tuned {args.finetune_steps} steps | "
          f"{nonzero_params(model):,} | {results['fine-tuned']:.4f} |")
    return results


if __name__ == "__main__":
    main()
