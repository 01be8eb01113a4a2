"""Peak memory and step time of one fine-tuning step of a small Llama (built from a config, random weights) on the
CPU: (a) full fine-tuning, (b) LoRA (PEFT), (c) PEFT's Super-Tuning (its sparse method), (d) our SparseDelta, the
adapters on every linear layer of the decoder at the same number of trainable parameters.

    python benchmarks/finetune_memory.py --rounds 9 --steps 3 --out benchmarks/results/finetune_cpu_2026-12-07.json

A step is forward, backward, ``AdamW.step`` and ``zero_grad(set_to_none=True)``. Memory, per method:
``resident`` (parameters, buffers and optimizer state held between steps, counted tensor by tensor), ``grad_state``
(the bytes of the trainable parameters' gradients and optimizer state, counted after ``optimizer.step``: what an
adapter's training costs beyond the frozen model) and ``step_peak`` (the most bytes allocated during one step above
what was allocated before it, from torch's CPU memory profiler: activations, gradients and temporaries). Time: the
median step over ``--rounds`` rounds of ``--steps`` steps, the methods interleaved in each round so that they share
the machine's load; each ratio is given as the median and the range of the per-round ratios.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

METHODS = ("full", "lora", "supertuning", "sparse_delta")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(args: argparse.Namespace) -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                      num_attention_heads=args.heads, num_key_value_heads=args.heads,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _target_weights(model: nn.Module) -> int:
    return sum(m.weight.numel() for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS)


def _lora_params(model: nn.Module, r: int) -> int:
    return sum(r * (m.in_features + m.out_features) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in TARGETS)


def build(method: str, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model of ``method`` and its AdamW over the trainable parameters."""
    model = _model(args)
    density = _lora_params(model, args.rank) / _target_weights(model)  # same trainable count as LoRA
    if method == "lora":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                                           target_modules=TARGETS))
    elif method == "supertuning":
        import peft

        model = peft.get_peft_model(model, peft.SupertuningConfig(target_modules=TARGETS, sparsity=1 - density))
    elif method == "sparse_delta":
        from torch_sparse_metal import add_sparse_deltas

        add_sparse_deltas(model, TARGETS, density=density, generator=torch.Generator().manual_seed(0))
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    return model, torch.optim.AdamW(params, lr=1e-4)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


def step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def step_peak(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> int:
    """The most bytes allocated during one step above what was allocated at its start (torch's profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(model, opt, ids)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return max(totals, default=0)


def measure_memory(method: str, args: argparse.Namespace, ids: torch.Tensor) -> dict:
    model, opt = build(method, args)
    for _ in range(2):  # optimizer state exists from the first step on
        step(model, opt, ids)
    trainable = [p for p in model.parameters() if p.requires_grad]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    grad_state = _bytes(p.grad for p in trainable) + _bytes(_state_tensors(opt))
    opt.zero_grad(set_to_none=True)
    resident = _bytes(model.parameters()) + _bytes(model.buffers()) + _bytes(_state_tensors(opt))
    return {"trainable": sum(p.numel() for p in trainable), "resident_bytes": resident,
            "grad_state_bytes": grad_state, "step_peak_bytes": step_peak(model, opt, ids)}


def measure_time(methods: list[str], args: argparse.Namespace, ids: torch.Tensor) -> dict[str, list[float]]:
    """Per method, the median step time (s) of each round; the methods take turns within a round."""
    built = {method: build(method, args) for method in methods}
    for model, opt in built.values():
        step(model, opt, ids)
    rounds: dict[str, list[float]] = {method: [] for method in methods}
    for _ in range(args.rounds):
        for method, (model, opt) in built.items():
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                step(model, opt, ids)
                times.append(time.perf_counter() - start)
            rounds[method].append(statistics.median(times))
    return rounds


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    return f"{os.cpu_count()} x {model}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank; the sparse methods match its parameter count")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: steadier on a machine that other work shares)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    memory = {method: measure_memory(method, args, ids) for method in methods}
    rounds = measure_time(methods, args, ids)
    reference = "lora" if "lora" in methods else methods[0]
    result = {
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.date.today().isoformat(),
        "cpu": _cpu(), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "config": {k: getattr(args, k) for k in ("hidden", "intermediate", "layers", "heads", "vocab", "batch", "seq",
                                                 "rank", "rounds", "steps")},
        "methods": {},
    }
    for method in methods:
        ratios = [t / r for t, r in zip(rounds[method], rounds[reference])]
        result["methods"][method] = {
            **memory[method],
            "step_s_median": statistics.median(rounds[method]),
            "step_s_rounds": rounds[method],
            f"time_vs_{reference}_median": statistics.median(ratios),
            f"time_vs_{reference}_range": [min(ratios), max(ratios)],
        }
    print(f"{'method':<13} {'trainable':>10} {'grad+state MB':>14} {'step peak MB':>13} {'resident MB':>12} "
          f"{'step ms':>8} {'vs ' + reference:>18}")
    for method, r in result["methods"].items():
        low, high = r[f"time_vs_{reference}_range"]
        print(f"{method:<13} {r['trainable']:>10} {r['grad_state_bytes'] / 2**20:>14.3f} "
              f"{r['step_peak_bytes'] / 2**20:>13.1f} {r['resident_bytes'] / 2**20:>12.1f} "
              f"{1e3 * r['step_s_median']:>8.1f} {r[f'time_vs_{reference}_median']:>8.2f} "
              f"({low:.2f}-{high:.2f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
