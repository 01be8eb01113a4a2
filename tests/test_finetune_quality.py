"""benchmarks/finetune_quality.py: the adapters it compares hold LoRA's trainable parameter count and train only
their own parameters, each starts from the pre-trained function, and its bits-per-character metric is the float64
cross-entropy of every predicted character of a split."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "examples"))
_spec = importlib.util.spec_from_file_location("finetune_quality", REPO / "benchmarks" / "finetune_quality.py")
finetune_quality = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(finetune_quality)

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def setup():
    args = finetune_quality.build_parser().parse_args(
        [
            "--d-model",
            "16",
            "--layers",
            "1",
            "--heads",
            "2",
            "--context",
            "16",
            "--batch",
            "4",
            "--pretrain-steps",
            "5",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--rank",
            "2",
            "--calibration",
            "2",
        ]
    )
    data = finetune_quality.Data()
    seed = int(torch.randint(2**20, (1,)))
    state, cfg = finetune_quality.pretrain(data, args, seed)
    return args, data, seed, state, cfg


def test_adapters_hold_loras_parameter_count_and_start_from_the_pretrained_function(setup):
    args, data, seed, state, cfg = setup
    x = data.code_valid[: 3 * args.context].view(3, args.context)
    full = finetune_quality.adapt("full", state, cfg, data, args, seed)
    expected = full(x)
    lora_count = None
    for method in finetune_quality.METHODS:
        model = finetune_quality.adapt(method, state, cfg, data, args, seed)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        count = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if method == "full":
            assert count == sum(p.numel() for p in model.parameters())
        else:
            assert all(any(k in n for k in ("lora_", "supertuning", "delta.weight")) for n in names), (method, names)
        if method == "lora":
            lora_count = count
        torch.testing.assert_close(model(x), expected, rtol=0, atol=0, msg=f"{method}, seed {seed}")
    _, lora = finetune_quality._density(full, args.rank)
    assert lora_count == lora
    for method in ("supertuning", "delta_random", "delta_gradient"):
        model = finetune_quality.adapt(method, state, cfg, data, args, seed)
        count = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert abs(count - lora) <= 4 * args.layers, (method, count, lora)  # rounding per layer


def test_bits_per_char_is_the_float64_cross_entropy_of_every_predicted_character(setup):
    args, data, seed, state, cfg = setup
    model = finetune_quality.adapt("full", state, cfg, data, args, seed)
    tokens = data.code_test[: 5 * args.context + 1]
    got = finetune_quality.bits_per_char(model, tokens, args.context)
    with torch.no_grad():
        x, y = tokens[:-1].view(5, args.context), tokens[1:].view(5, args.context)
        logp = torch.log_softmax(model(x).double(), dim=-1)
        expected = -logp.gather(-1, y.unsqueeze(-1)).mean().item() / math.log(2)
    assert got == pytest.approx(expected, rel=1e-5)
