"""Steps per second and GPU-busy fraction of the training example's step: the README's model (d_model 256, 4 layers,
density 1/4, batch 16 x 256) and its dense twin at equal nonzeros, float32 and bfloat16 autocast, eager and replayed
from a CUDA graph (``Trainer(graphs=True)``), each in its own trainer, one after the other in one process.

Wall time per step: ``--steps`` steps between two synchronisations, after ``--warmup`` steps (the graph is captured in
the warm-up). GPU busy: the CUDA kernels' device time of ``--profile-steps`` steps (torch.profiler, summed over every
kernel, graph replays included) over their wall time. Fixed topology (no RigL updates): the step's cost, not the
updates'. Run on a CUDA machine:

    python benchmarks/train_step_profile.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from char_lm.data import load_corpus
from char_lm.loop import TrainConfig, Trainer
from char_lm.model import ModelConfig
from torch.profiler import ProfilerActivity, profile


def kernel_ms(prof) -> float:
    """Device milliseconds of every CUDA kernel the profiler saw."""
    total_us = 0.0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total_us += event.device_time_total if hasattr(event, "device_time_total") else event.cuda_time_total
    return total_us / 1e3


def measure(sparse: bool, dtype: str, graphs: bool, corpus, device: torch.device, args) -> dict:
    model_cfg = ModelConfig(vocab_size=corpus.vocab.size, context=256, d_model=256, n_layers=4, n_heads=4,
                            density=0.25)
    if not sparse:
        model_cfg = model_cfg.dense_equivalent()
    cfg = TrainConfig(steps=10**9, batch_size=16, dtype=dtype, eval_chars=None, warmup_steps=10)
    trainer = Trainer(model_cfg, cfg, corpus, device, progress=False, verbose=False, graphs=graphs)
    for _ in range(args.warmup):
        trainer.train_step(0.1)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        trainer.train_step(0.1)
    torch.cuda.synchronize(device)
    wall_ms = (time.perf_counter() - t0) * 1e3 / args.steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.profile_steps):
            trainer.train_step(0.1)
        torch.cuda.synchronize(device)
        profiled_wall = (time.perf_counter() - t0) * 1e3 / args.profile_steps
    kernels = kernel_ms(prof) / args.profile_steps
    nonzeros = sum(int(p.numel()) for p in trainer.model.parameters())
    row = {"model": "sparse" if sparse else "dense twin", "d_model": model_cfg.d_model, "dtype": dtype,
           "graphs": graphs, "wall_ms_per_step": round(wall_ms, 3), "steps_per_s": round(1e3 / wall_ms, 1),
           "kernel_ms_per_step": round(kernels, 3), "profiled_wall_ms_per_step": round(profiled_wall, 3),
           "gpu_busy": round(kernels / profiled_wall, 3), "parameters": nonzeros}
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--profile-steps", type=int, default=50)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    corpus = load_corpus(None, allow_download=False)
    rows = [measure(sparse, dtype, graphs, corpus, device, args)
            for dtype in ("float32", "bfloat16") for sparse in (True, False) for graphs in (False, True)]
    meta = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
