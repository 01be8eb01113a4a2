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

import torch
from char_lm import CharTransformer, ModelConfig, WindowSampler, evaluate_bpc, pick_device
from char_lm.cli import check_corpus_fits, check_density, load_corpus_checked

from torch_sparse_metal import SparseLinear, sparsify
from torch_sparse_metal_tools.argtypes import existing_path, fraction, non_negative_int, positive_int, seed
from torch_sparse_metal_tools.cli import device_type, print_openmp_note, wait_passively
from torch_sparse_metal_tools.progress import progress_bar

N_LAYERS = N_HEADS = 2


def train(model: torch.nn.Module, sampler: WindowSampler, steps: int, lr: float, progress: bool = True,
          desc: str = "train") -> None:
    """AdamW with a cosine schedule; the loss stays on the device (no host read per step). Progress: a bar on a
    terminal, else a plain line at least every 30 s; none with ``progress=False``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.99))
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(steps, 1), eta_min=lr / 10)
    model.train()
    for _ in progress_bar(range(steps), desc=desc, unit="step", enabled=progress):
        x, y = sampler.sample()
        loss = model.loss(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()


def nonzero_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # SparseLinear stores only its edges


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=existing_path, default=None,
                   help="a text file or WikiText folder (default: the bundled corpus)")
    p.add_argument("--device", type=device_type(allow_auto=True), default="cpu",
                   help="auto (cuda, then mps, then cpu), cpu, cuda, cuda:1, mps")
    p.add_argument("--steps", type=positive_int, default=1000, help="dense training steps (default %(default)s)")
    p.add_argument("--finetune-steps", type=non_negative_int, default=300,
                   help="fine-tuning steps after sparsify; 0: report the pruned model as it is (default %(default)s)")
    p.add_argument("--density", type=fraction, default=0.25,
                   help="fraction of each block matrix kept, in (0, 1] (default %(default)s)")
    p.add_argument("--d-model", type=positive_int, default=128, help=f"width, a multiple of {N_HEADS} (heads)")
    p.add_argument("--context", type=positive_int, default=128, help="characters per window")
    p.add_argument("--batch-size", type=positive_int, default=8)
    p.add_argument("--eval-chars", type=positive_int, default=1 << 15, help="validation characters per evaluation")
    p.add_argument("--seed", type=seed, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[torch.device, object]:
    """Everything the types cannot check, before the dense training starts: the device, the model's shape, the
    density against the smallest block matrix, and the corpus (loaded here) against the context."""
    try:
        device = pick_device(str(args.device))
    except (RuntimeError, ValueError) as exc:
        parser.error(str(exc))
    if args.d_model % N_HEADS:
        parser.error(f"--d-model {args.d_model} must be a multiple of the model's {N_HEADS} heads")
    check_density(parser, args.density, args.d_model)
    corpus = load_corpus_checked(parser, args.data, allow_download=False)
    check_corpus_fits(parser, corpus, args.context, args.eval_chars)
    return device, corpus


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = build_parser()
    args = parser.parse_args(argv)
    device, corpus = _check(parser, args)
    print_openmp_note(device)
    progress = not args.no_progress

    torch.manual_seed(args.seed)
    corpus = corpus.to(device)
    cfg = ModelConfig(vocab_size=corpus.vocab.size, context=args.context, d_model=args.d_model, n_layers=N_LAYERS,
                      n_heads=N_HEADS, sparse=False)
    model = CharTransformer(cfg, generator=torch.Generator().manual_seed(args.seed)).to(device)
    sampler = WindowSampler(corpus.train, cfg.context, args.batch_size, seed=args.seed + 1)

    def bpc() -> float:
        return evaluate_bpc(model, corpus.valid, args.eval_chars, 64)

    train(model, sampler, args.steps, lr=2e-3, progress=progress, desc="dense training")
    results = {"dense": bpc()}
    dense_params = nonzero_params(model)
    # the block matrices only: embeddings and the output head stay dense
    sparsify(model, density=args.density, filter=lambda name, module: name.startswith("blocks."))
    results["sparsified"] = bpc()
    train(model, sampler, args.finetune_steps, lr=1e-3, progress=progress, desc="fine-tuning")
    results["fine-tuned"] = bpc()
    layers = sum(isinstance(m, SparseLinear) for m in model.modules())
    print(f"| model | nonzero parameters | val BPC |\n|---|---|---|\n| dense, {args.steps} steps | {dense_params:,} | "
          f"{results['dense']:.4f} |\n| sparsified to density {args.density:g} ({layers} SparseLinear layers) | "
          f"{nonzero_params(model):,} | {results['sparsified']:.4f} |\n| fine-tuned {args.finetune_steps} steps | "
          f"{nonzero_params(model):,} | {results['fine-tuned']:.4f} |")
    return results


if __name__ == "__main__":
    wait_passively()
    main()
