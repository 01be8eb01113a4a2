"""Bitwise snapshots of everything a failed call must leave alone: a module's parameters and buffers (with their
shapes, dtypes and devices) and every tensor of its optimizers' per-parameter state."""

from __future__ import annotations

import copy

import torch

__all__ = ["snapshot", "changes"]


def snapshot(module: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...] = ()) -> dict:
    state = {f"module.{k}": v.detach().clone() for k, v in
             {**dict(module.named_parameters()), **dict(module.named_buffers())}.items()}
    state["module.shape"] = (getattr(module, "in_features", None), getattr(module, "out_features", None))
    for i, opt in enumerate(optimizers):
        for p, s in opt.state.items():
            for key, value in s.items():
                state[f"opt{i}.{id(p)}.{key}"] = value.clone() if isinstance(value, torch.Tensor) else copy.copy(value)
    state["param_ids"] = [id(p) for p in module.parameters()]
    return state


def changes(before: dict, module: torch.nn.Module, optimizers: tuple[torch.optim.Optimizer, ...] = ()) -> list[str]:
    """Keys whose value differs bitwise (NaNs compare equal to NaNs in the same places) or appeared/vanished."""
    after = snapshot(module, optimizers)
    diff = sorted(set(before) ^ set(after))
    for key in set(before) & set(after):
        a, b = before[key], after[key]
        if isinstance(a, torch.Tensor):
            same = (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and a.device == b.device
                    and torch.equal(_bytes(a), _bytes(b)))
        else:
            same = a == b
        if not same:
            diff.append(key)
    return diff


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
