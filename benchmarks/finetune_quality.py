"""Quality of sparse fine-tuning against LoRA on a small, real domain shift, on the CPU: a character-level
Transformer (``examples/char_lm``, dense) pre-trained briefly on English prose (the bundled corpus), then fine-tuned
on Python source code (modules of the running Python's standard library) by (a) full fine-tuning, (b) LoRA (PEFT),
(c) PEFT's Super-Tuning (its sparse method: the largest-magnitude weights), (d) our SparseDelta with random
connections and (e) our SparseDelta with the connections of the largest accumulated gradient; the adapters sit on
the four matrices of every block at LoRA's parameter count.

    python benchmarks/finetune_quality.py --out benchmarks/results/finetune_quality_cpu_2026-12-07

Protocol. Each seed pre-trains its own model (the seed also draws the adapters' initialisation, the random
connections and the batches). The code is split per file, 80% train / 10% validation / 10% test. The learning rate
of each method is chosen from ``--lrs`` by the validation loss of seed ``--seeds[0]``; every seed then fine-tunes at
that rate and the test loss (bits per character) is reported: median and range over the seeds. The English
validation loss after fine-tuning shows what each method forgets. Everything fine-tunes for the same steps, batches
and schedule (AdamW, linear warm-up, cosine decay). The gradient selection spends ``--calibration`` extra forward and
backward passes on training batches before fine-tuning.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time

import torch
from torch import nn

METHODS = ("full", "lora", "supertuning", "delta_random", "delta_gradient")
TARGETS = ["qkv", "proj", "fc", "out"]
CODE_MODULES = ("textwrap", "shlex", "heapq", "graphlib", "string")
SPLITS = (0.8, 0.1, 0.1)


def _code_texts() -> dict[str, str]:
    texts = {}
    for name in CODE_MODULES:
        spec = importlib.util.find_spec(name)
        with open(spec.origin, encoding="utf-8") as f:
            texts[name] = f.read()
    return texts


def _split(text: str) -> tuple[str, str, str]:
    a = int(len(text) * SPLITS[0])
    b = int(len(text) * (SPLITS[0] + SPLITS[1]))
    return text[:a], text[a:b], text[b:]


class Data:
    """The English corpus (pre-training; its validation split measures forgetting) and the code (fine-tuning), over
    one character vocabulary."""

    def __init__(self) -> None:
        from char_lm.data import fallback_text

        english = fallback_text()
        code = _code_texts()
        chars = sorted(set(english).union(*code.values()))
        self.vocab = {c: i for i, c in enumerate(chars)}
        cut = int(len(english) * 0.9)
        self.english_train, self.english_valid = self.encode(english[:cut]), self.encode(english[cut:])
        parts = [_split(text) for text in code.values()]
        self.code_train, self.code_valid, self.code_test = (self.encode("".join(p[k] for p in parts)) for k in range(3))
        digest = hashlib.sha256("".join(code.values()).encode()).hexdigest()
        self.describe = {
            "vocab": len(chars),
            "english_chars": len(english),
            "code_modules": list(CODE_MODULES),
            "code_sha256": digest,
            "code_chars": sum(len(t) for t in code.values()),
            "code_splits_chars": [len(self.code_train), len(self.code_valid), len(self.code_test)],
        }

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.vocab[c] for c in text], dtype=torch.long)


def batch(tokens: torch.Tensor, context: int, size: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    start = torch.randint(0, tokens.numel() - context - 1, (size, 1), generator=generator)
    window = tokens[start + torch.arange(context + 1)]
    return window[:, :-1], window[:, 1:]


@torch.no_grad()
def bits_per_char(model: nn.Module, tokens: torch.Tensor, context: int) -> float:
    """Mean cross-entropy (bits per character) over consecutive non-overlapping windows of the split."""
    from char_lm.data import eval_windows

    model.eval()
    x, y = eval_windows(tokens, context)
    total = sum(float(model(xb, yb, "sum")) for xb, yb in zip(x.split(64), y.split(64)))
    model.train()
    return total / y.numel() / math.log(2)


def _schedule(step: int, steps: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def train(model: nn.Module, tokens: torch.Tensor, lr: float, steps: int, args, generator: torch.Generator) -> None:
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, steps, args.warmup))
    model.train()
    for _ in range(steps):
        x, y = batch(tokens, args.context, args.batch, generator)
        model(x, y).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)


def pretrain(data: Data, args, seed: int) -> tuple[dict[str, torch.Tensor], object]:
    from char_lm.model import CharTransformer, ModelConfig

    cfg = ModelConfig(
        vocab_size=len(data.vocab),
        context=args.context,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        sparse=False,
    )
    torch.manual_seed(seed)
    model = CharTransformer(cfg, generator=torch.Generator().manual_seed(seed))
    train(
        model,
        data.english_train,
        args.pretrain_lr,
        args.pretrain_steps,
        args,
        torch.Generator().manual_seed(10_000 + seed),
    )
    return {k: v.clone() for k, v in model.state_dict().items()}, cfg


def _density(model: nn.Module, rank: int) -> tuple[float, int]:
    """The uniform density of the target layers with LoRA rank ``rank``'s parameter count, and that count."""
    layers = [m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS]
    lora = sum(rank * (m.in_features + m.out_features) for m in layers)
    return lora / sum(m.weight.numel() for m in layers), lora


def adapt(method: str, state: dict, cfg, data: Data, args, seed: int) -> nn.Module:
    """The pre-trained model with ``method``'s trainable parameters (seeded by ``seed``)."""
    from char_lm.model import CharTransformer

    model = CharTransformer(cfg)
    model.load_state_dict(state)
    density, _ = _density(model, args.rank)
    torch.manual_seed(20_000 + seed)  # LoRA's A initialisation
    if method == "lora":
        import peft

        model = peft.get_peft_model(
            model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=TARGETS)
        )
    elif method == "supertuning":
        import peft

        model = peft.get_peft_model(model, peft.SupertuningConfig(target_modules=TARGETS, sparsity=1 - density))
    elif method.startswith("delta"):
        from torch_sparse_metal import add_sparse_deltas
        from torch_sparse_metal.finetune import accumulated_gradients

        scores = None
        if method == "delta_gradient":
            g = torch.Generator().manual_seed(30_000 + seed)
            batches = [batch(data.code_train, args.context, args.batch, g) for _ in range(args.calibration)]
            scores = accumulated_gradients(model, TARGETS, batches, lambda m, xy: m(*xy))
        add_sparse_deltas(
            model, TARGETS, density=density, scores=scores, generator=torch.Generator().manual_seed(40_000 + seed)
        )
    elif method != "full":
        raise ValueError(method)
    return model


def finetune(method: str, state: dict, cfg, data: Data, args, seed: int, lr: float) -> dict:
    model = adapt(method, state, cfg, data, args, seed)
    start = time.perf_counter()
    train(model, data.code_train, lr, args.steps, args, torch.Generator().manual_seed(50_000 + seed))
    seconds = time.perf_counter() - start
    return {
        "method": method,
        "seed": seed,
        "lr": lr,
        "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "code_valid_bpc": bits_per_char(model, data.code_valid, args.context),
        "code_test_bpc": bits_per_char(model, data.code_test, args.context),
        "english_valid_bpc": bits_per_char(model, data.english_valid, args.context),
        "train_s": round(seconds, 2),
    }


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def report(result: dict) -> str:
    meta, runs = result["meta"], result["runs"]
    seeds = meta["seeds"]
    lines = [
        f"Fine-tuning an English-pretrained character Transformer on Python source: test bits per character, "
        f"median (min-max) over seeds {', '.join(map(str, seeds))}. Command: `{meta['command']}`. Machine: "
        f"{meta['cpu']}, {meta['threads']} thread(s), torch {meta['torch']}, peft {meta['peft']}, Python "
        f"{meta['python']}.",
        "",
        "| method | trainable | lr (chosen on validation) | code test bpc | English valid bpc after |",
        "|---|---|---|---|---|",
    ]
    base = [r for r in runs if r["method"] == "pretrained"]
    lines.append(
        f"| pre-trained, not fine-tuned | 0 | - | {_spread([r['code_test_bpc'] for r in base])} | "
        f"{_spread([r['english_valid_bpc'] for r in base])} |"
    )
    for method in meta["methods"]:
        final = [r for r in runs if r["method"] == method and r["phase"] == "final"]
        if not final:
            continue
        lines.append(
            f"| {method} | {final[0]['trainable']:,} | {final[0]['lr']:g} | "
            f"{_spread([r['code_test_bpc'] for r in final])} | "
            f"{_spread([r['english_valid_bpc'] for r in final])} |"
        )
    lines += [
        "",
        "Learning-rate sweep (seed " + str(seeds[0]) + ", code validation bpc):",
        "",
        "| method | " + " | ".join(f"{lr:g}" for lr in meta["lrs"]) + " |",
        "|---|" + "---|" * len(meta["lrs"]),
    ]
    for method in meta["methods"]:
        sweep = {r["lr"]: r["code_valid_bpc"] for r in runs if r["method"] == method and r["phase"] == "sweep"}
        lines.append(
            f"| {method} | " + " | ".join(f"{sweep[lr]:.3f}" if lr in sweep else "-" for lr in meta["lrs"]) + " |"
        )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--pretrain-steps", type=int, default=1200)
    parser.add_argument("--pretrain-lr", type=float, default=2e-3)
    parser.add_argument("--steps", type=int, default=300, help="fine-tuning steps")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--rank", type=int, default=4, help="LoRA rank; the sparse methods match its parameter count")
    parser.add_argument(
        "--calibration", type=int, default=8, help="batches whose gradient chooses delta_gradient's connections"
    )
    parser.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2,1e-1,3e-1")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", help="write quality.json and quality.md into this folder")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    try:
        lrs = [float(v) for v in args.lrs.split(",")]
    except ValueError:
        parser.error(f"--lrs must be comma-separated numbers, got {args.lrs!r}")
    if not all(lr > 0 for lr in lrs):
        parser.error(f"--lrs must be positive, got {args.lrs!r}")
    torch.set_num_threads(args.threads)
    import peft

    data = Data()
    runs = []
    pretrained = {}
    for seed in args.seeds:
        start = time.perf_counter()
        pretrained[seed] = pretrain(data, args, seed)
        state, cfg = pretrained[seed]
        from char_lm.model import CharTransformer

        model = CharTransformer(cfg)
        model.load_state_dict(state)
        runs.append(
            {
                "method": "pretrained",
                "phase": "final",
                "seed": seed,
                "trainable": 0,
                "lr": None,
                "code_valid_bpc": bits_per_char(model, data.code_valid, args.context),
                "code_test_bpc": bits_per_char(model, data.code_test, args.context),
                "english_valid_bpc": bits_per_char(model, data.english_valid, args.context),
                "train_s": round(time.perf_counter() - start, 2),
            }
        )
        print(runs[-1], flush=True)
    first = args.seeds[0]
    chosen = {}
    for method in methods:
        sweep = []
        for lr in lrs:
            sweep.append({**finetune(method, *pretrained[first], data, args, first, lr), "phase": "sweep"})
            print(sweep[-1], flush=True)
        runs += sweep
        best = min(sweep, key=lambda r: r["code_valid_bpc"])
        chosen[method] = best["lr"]
        runs.append({**best, "phase": "final"})
        for seed in args.seeds[1:]:
            runs.append({**finetune(method, *pretrained[seed], data, args, seed, best["lr"]), "phase": "final"})
            print(runs[-1], flush=True)
    result = {
        "meta": {
            "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
            "date": datetime.date.today().isoformat(),
            "cpu": _cpu(),
            "cores": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "peft": peft.__version__,
            "python": platform.python_version(),
            "methods": methods,
            "lrs": lrs,
            "seeds": args.seeds,
            "chosen_lr": chosen,
            "targets": TARGETS,
            "data": data.describe,
            "config": {
                k: getattr(args, k)
                for k in (
                    "d_model",
                    "layers",
                    "heads",
                    "context",
                    "batch",
                    "pretrain_steps",
                    "pretrain_lr",
                    "steps",
                    "warmup",
                    "rank",
                    "calibration",
                )
            },
            "density": _density(adapt("full", *pretrained[first], data, args, first), args.rank)[0],
        },
        "runs": runs,
    }
    text = report(result)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "quality.json"), "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
        with open(os.path.join(args.out, "quality.md"), "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
