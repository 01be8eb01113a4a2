"""Sparse fine-tuning under torch.distributed: a model with SparseDelta wrappers trained by 2 gloo processes on CPU,
under DistributedDataParallel (with the deltas' connections dropped and regrown by RigL) and under FSDP2's
``fully_shard``, against the same training in one process on the concatenated batch.

The ranks are launched by ``tsm_dev.gloo.launch``, as in tests/test_distributed.py. Each rank builds its model
from another seed (another base weight and other delta connections): DDP broadcasts rank 0's parameters and
buffers, so the reference is rank 0's model.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from torch_sparse_metal import add_sparse_deltas
from torch_sparse_metal.distributed import rewrap, wrap
from torch_sparse_metal.evolve import DynamicSparsity
from torch_sparse_metal.finetune import sparse_deltas
from tsm_dev.gloo import WORLD, launch, launch_errors

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
    reason="needs torch.distributed with gloo",
)

BATCH = 8  # global batch, split between the ranks
STEPS = 7  # RigL updates at steps 3 and 6


def _model(seed: int) -> nn.Module:
    """A 'pre-trained' MLP with a delta of vectors of 8 outputs on its first layer and an unstructured delta on its
    last; only the deltas train."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(seed)
    add_sparse_deltas(net, ["0"], density=0.25, block=8, generator=g)
    add_sparse_deltas(net, ["4"], density=0.3, generator=g)
    return net


def _batch(seed: int, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    x, y = torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 3, generator=g)
    n = BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def _deltas(net: nn.Module) -> list:
    return [w.delta for w in sparse_deltas(net).values()]


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (FSDP2's shards) as the whole tensor, a plain tensor as a copy."""
    t = t.detach()
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).clone()


def _optimizer(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=0.05, weight_decay=0.01)


def _train(seed: int, rank: int, world: int, how: str) -> dict:
    """Fine-tune rank 0's model (``seed``) ``STEPS`` steps on this rank's share of each batch; every step's delta
    gradients and the final state."""
    net = _model(seed + rank if how == "ddp" else seed)  # FSDP2 shards each rank's own model: no broadcast
    evo = None
    if how == "ddp":
        model = wrap(net)
        opt = _optimizer(net)
        evo = DynamicSparsity(
            _deltas(net),
            opt,
            prune_every=3,
            total_steps=STEPS + 1,
            drop_fraction=0.5,
            mode="rigl",
            generator=torch.Generator().manual_seed(seed + rank),
        )
    elif how == "fsdp2" and world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for wrapper in sparse_deltas(net).values():
            fully_shard(wrapper, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
        opt = _optimizer(net)  # over the sharded parameters, which replace the model's
    else:
        model = net
        opt = _optimizer(net)
    grads = []
    for step in range(1, STEPS + 1):
        x, y = _batch(seed, step, rank, world)
        (model(x) - y).square().mean().backward()
        grads.append([_full(d.weight.grad) for d in _deltas(net)])
        opt.step()
        opt.zero_grad()
        if evo is not None and evo.step():
            model = rewrap(model)
    x = _batch(seed, 0, 0, 1)[0]
    return {
        "grads": grads,
        "indices": [d.indices() for d in _deltas(net)],
        "values": [_full(d.weight) for d in _deltas(net)],
        "state": [{k: _full(v) for k, v in opt.state[d.weight].items()} for d in _deltas(net)],
        "base": {k: _full(v) for k, v in net.state_dict().items() if ".base." in k},
        "history": evo.history if evo is not None else [],
        "output": _full(model(x)),
    }


def _worker(rank: int, world: int, out: str, seed: int, how: str) -> None:
    torch.save(_train(seed, rank, world, how), os.path.join(out, f"rank{rank}.pt"))


def _assert_matches(got: dict, ref: dict, context: str) -> None:
    close = {"rtol": 1e-4, "atol": 2e-6, "msg": lambda m: f"{context}: {m}"}
    assert got["history"] == ref["history"], context
    for a, b in zip(got["indices"], ref["indices"]):
        assert torch.equal(a, b), context
    for step, (ga, gb) in enumerate(zip(got["grads"], ref["grads"], strict=True), start=1):
        for a, b in zip(ga, gb, strict=True):
            torch.testing.assert_close(a, b, **{**close, "msg": lambda m, s=step: f"{context}, step {s}: {m}"})
    for a, b in zip(got["values"], ref["values"], strict=True):
        torch.testing.assert_close(a, b, **close)
    for sa, sb in zip(got["state"], ref["state"], strict=True):
        assert sa.keys() == sb.keys(), context
        for k in sa:
            torch.testing.assert_close(sa[k], sb[k], **close)
    assert got["base"].keys() == ref["base"].keys()
    for k in ref["base"]:  # frozen: rank 0's pre-trained values, untouched
        assert torch.equal(got["base"][k], ref["base"][k]), f"{context}: {k}"
    torch.testing.assert_close(got["output"], ref["output"], **close)


@pytest.mark.parametrize("how", ["ddp", "fsdp2"])
def test_deltas_train_across_ranks_as_in_one_process_on_the_concatenated_batch(tmp_path, how):
    seed = int(torch.randint(2**20, (1,)))
    codes = launch(_worker, tmp_path, seed, how)
    assert codes == [0] * WORLD, launch_errors(tmp_path)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    single = _train(seed, rank=0, world=1, how=how)
    assert single["values"][0].abs().sum() > 0 and single["values"][1].abs().sum() > 0  # the deltas trained
    if how == "ddp":  # two RigL updates that moved connections of both deltas
        assert [s for s, _ in single["history"]] == [0, 3, 6]
        assert not torch.equal(single["indices"][1], _model(seed)[4].delta.indices())
    for rank, got in enumerate(ranks):
        _assert_matches(got, single, f"{how}, rank {rank}, seed {seed}")
