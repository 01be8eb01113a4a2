"""SparseLinear under DistributedDataParallel with evolving topology: 2 gloo processes on CPU.

The ranks are launched by ``tsm_dev.gloo.launch``. The same training function runs in the ranks and, without
torch.distributed, in this process as the single-process reference on the concatenated batch.
"""

from __future__ import annotations

import os
import time
import warnings

import pytest
import torch
from torch import nn

from torch_sparse_metal import SparseLinear
from torch_sparse_metal.distributed import is_main_process, rewrap, wrap
from torch_sparse_metal.evolve import DynamicSparsity
from torch_sparse_metal.pruning import GradualPruning
from tsm_dev.gloo import PG_TIMEOUT_S, WORLD, launch, launch_errors

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

BATCH = 8  # global batch, split between the ranks
STEPS = 7  # updates at steps 3 and 6


# ------------------------------------------------------------------------------------------- the training run
def _model(seed: int) -> nn.Module:
    """An unstructured layer and a vector layer (block 8: whole vectors are dropped, grown and broadcast)."""
    g = torch.Generator().manual_seed(seed)
    return nn.Sequential(SparseLinear(12, 16, density=0.3, block=8, generator=g), nn.Tanh(),
                         SparseLinear(16, 3, density=0.4, generator=g))


def _setup(net: nn.Module, mode: str, generator_seed: int):
    opt = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.01)
    model = wrap(net)  # DDP broadcasts rank 0's parameters and topology buffers
    if mode == "gmp":  # gradual magnitude pruning, updates at steps 3 and 6 too
        return model, opt, GradualPruning(net, opt, final_density=0.1, end_step=6, prune_every=3)
    evo = DynamicSparsity(net, opt, prune_every=3, total_steps=STEPS + 1, drop_fraction=0.4, grow_to=0.5, mode=mode,
                          generator=torch.Generator().manual_seed(generator_seed))
    return model, opt, evo


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, 3, generator=g)
    n = BATCH // world
    return x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]


def _train(model, opt, evo, steps: range, rank: int, world: int, die_at: tuple[int, str] | None = None,
           out: str = ""):
    for step in steps:
        if die_at == (step, "forward"):
            os._exit(3)
        x, y = _batch(step, rank, world)
        (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if die_at == (step, "hang"):  # alive but silent, until the other rank has given up
            while not os.path.exists(os.path.join(out, "error0.txt")):
                time.sleep(0.05)
        if die_at in ((step, "update"), (step, "hang")):
            os._exit(3)
        if evo.step():
            model = rewrap(model)
    return model


def _snapshot(net: nn.Module, opt, evo) -> dict:
    layers = [m for m in net.modules() if isinstance(m, SparseLinear)]
    return {"indices": [m.indices() for m in layers], "weight": [m.weight.detach().clone() for m in layers],
            "bias": [m.bias.detach().clone() for m in layers], "history": evo.history,
            "state": [{k: v.clone() for k, v in opt.state[m.weight].items()} for m in layers]}


def _checkpoint(net: nn.Module, opt, evo) -> dict:
    return {"model": net.state_dict(), "optimizer": opt.state_dict(), "evolve": evo.state_dict()}


def _resume(path, rank: int, world: int, mode: str) -> dict:
    ckpt = torch.load(path, weights_only=True)
    net = _model(999)  # another topology: the checkpoint's replaces it
    net.load_state_dict(ckpt["model"])
    model, opt, evo = _setup(net, mode, generator_seed=555 + rank)
    opt.load_state_dict(ckpt["optimizer"])
    evo.load_state_dict(ckpt["evolve"])  # rank 0's generator state included
    _train(model, opt, evo, range(evo.steps + 1, STEPS + 2), rank, world)
    return _snapshot(net, opt, evo)


# ------------------------------------------------------------------------------------------- what the ranks run
def _train_worker(rank: int, world: int, out: str, mode: str) -> None:
    # Every rank seeds differently: DDP must start them from rank 0's model, and rank 0 decides the updates.
    torch.manual_seed(1000 + rank)
    net = _model(100 + rank)
    model, opt, evo = _setup(net, mode, generator_seed=7 + rank)
    _train(model, opt, evo, range(1, STEPS + 1), rank, world)
    torch.save(_snapshot(net, opt, evo), os.path.join(out, f"rank{rank}.pt"))


def _checkpoint_worker(rank: int, world: int, out: str, mode: str) -> None:
    net = _model(100 + rank)
    model, opt, evo = _setup(net, mode, generator_seed=7 + rank)
    _train(model, opt, evo, range(1, 5), rank, world)
    path = os.path.join(out, "ckpt.pt")
    if is_main_process():
        torch.save(_checkpoint(net, opt, evo), path)
        with open(os.path.join(out, "saves.log"), "a") as f:
            f.write(f"rank {rank}\n")
    torch.distributed.barrier()
    torch.save(_resume(path, rank, world, mode), os.path.join(out, f"resumed{rank}.pt"))


def _dying_worker(rank: int, world: int, out: str, where: str) -> None:
    net = _model(100)
    model, opt, evo = _setup(net, "set", generator_seed=7)
    _train(model, opt, evo, range(1, STEPS + 1), rank, world, die_at=(3, where) if rank == 1 else None, out=out)


def _mismatch_worker(rank: int, world: int, out: str) -> None:
    net = _model(100 + rank)  # another topology on each rank, and DDP told not to broadcast buffers
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # broadcast_buffers is deprecated from torch 2.13
        model = wrap(net, broadcast_buffers=False)
    evo = DynamicSparsity(net, opt, prune_every=2, total_steps=4, generator=torch.Generator().manual_seed(7))
    _train(model, opt, evo, range(1, 3), rank, world)


def _clock_worker(rank: int, world: int, out: str) -> None:
    """A run budgeted in time whose ranks read different clocks; then an update not followed by rewrap(), and a
    replaced wrapper used again."""
    net = _model(100)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    model = first = wrap(net)
    evo = DynamicSparsity(net, opt, prune_every=3, total_steps=None, stop_fraction=0.75,
                          generator=torch.Generator().manual_seed(7))
    for step in range(1, STEPS + 1):
        x, y = _batch(step, rank, world)
        (model(x) - y).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if evo.step(progress=step / 8 + 0.2 * rank):  # rank 1 is past stop_fraction at step 6, rank 0 is not
            model = rewrap(model)
    evo.update()
    errors = {}
    for name, wrapper in (("forgotten", model), ("replaced", first)):
        try:
            wrapper(_batch(0, rank, world)[0])
            errors[name] = "no error"
        except RuntimeError as exc:
            errors[name] = str(exc)
    torch.save({"history": evo.history, **errors}, os.path.join(out, f"rank{rank}.pt"))


def _assert_close(a: dict, b: dict, exact_topology: bool = True) -> None:
    assert a["history"] == b["history"]
    for ia, ib in zip(a["indices"], b["indices"]):
        assert torch.equal(ia, ib)
    for key in ("weight", "bias"):
        for ta, tb in zip(a[key], b[key]):
            torch.testing.assert_close(ta, tb, atol=2e-5, rtol=1e-4)
    for sa, sb in zip(a["state"], b["state"]):
        assert sa.keys() == sb.keys()
        for k in sa:
            torch.testing.assert_close(sa[k], sb[k], atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------- tests
@pytest.fixture(scope="module", params=["set", "rigl", "gmp"])
def trained(request, tmp_path_factory):
    """Both ranks' states after a 2-process run with two topology updates (that grow or prune the layers)."""
    out = tmp_path_factory.mktemp(f"ddp_{request.param}")
    codes = launch(_train_worker, out, request.param)
    assert codes == [0] * WORLD, launch_errors(out)
    return request.param, [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def test_ddp_equals_single_process_on_the_concatenated_batch(trained):
    mode, ranks = trained
    net = _model(100)
    model, opt, evo = _setup(net, mode, generator_seed=7)
    _train(model, opt, evo, range(1, STEPS + 1), rank=0, world=1)
    single = _snapshot(net, opt, evo)
    assert len(single["history"]) == 3 and single["history"][-1][1] != single["history"][0][1]  # 2 updates, grown
    _assert_close(ranks[0], single)


def test_ranks_agree_despite_per_rank_seeds(trained):
    """DDP re-broadcasts rank 0's buffers and parameters and would hide a topology decided per rank; the optimizer
    state, remapped by each rank's own plan, would not."""
    _, (r0, r1) = trained
    assert r0["history"] == r1["history"]
    for a, b in zip(r0["indices"], r1["indices"]):
        assert torch.equal(a, b)
    for key in ("weight", "bias"):
        for a, b in zip(r0[key], r1[key]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for a, b in zip(r0["state"], r1["state"]):
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=0)


def test_ranks_built_with_different_topologies_fail_at_the_first_update(tmp_path):
    codes = launch(_mismatch_worker, tmp_path)
    assert codes == [1, 1]
    assert "the ranks' layers did not hold the same topology before the update" in launch_errors(tmp_path)


@pytest.fixture(scope="module")
def clocked(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp_clock")
    codes = launch(_clock_worker, out)
    assert codes == [0] * WORLD, launch_errors(out)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]


def test_rank_0_clock_decides_when_runs_are_budgeted_in_time(clocked):
    assert [s for s, _ in clocked[0]["history"]] == [0, 3, 6, 7]  # 7: the explicit update() at the end
    assert clocked[0]["history"] == clocked[1]["history"]


def test_forward_after_an_update_without_rewrap_raises(clocked):
    for rank in clocked:
        assert "rebuild it with model = torch_sparse_metal.distributed.rewrap(model)" in rank["forgotten"]
        assert "replaced by rewrap(); use the one it returned" in rank["replaced"]


def test_checkpoint_saved_once_resumes_on_another_world_size(tmp_path):
    codes = launch(_checkpoint_worker, tmp_path, "set")
    assert codes == [0] * WORLD, launch_errors(tmp_path)
    assert (tmp_path / "saves.log").read_text() == "rank 0\n"
    two = torch.load(tmp_path / "resumed0.pt", weights_only=True)
    one = _resume(tmp_path / "ckpt.pt", rank=0, world=1, mode="set")
    assert len(one["history"]) == 3  # the update at step 6 happened after the resume
    _assert_close(two, one)


@pytest.mark.parametrize("where", ["forward", "update", "hang"])
def test_a_dead_rank_makes_the_other_fail_not_hang(tmp_path, where):
    """Rank 1 exits before the forward or before the topology update of step 3, or stops answering there: rank 0
    raises (a peer's socket closes at once; a silent peer runs into the process group's timeout)."""
    timeout = 3.0 if where == "hang" else PG_TIMEOUT_S  # well inside DEADLINE_S, which only kills a hung rank
    codes = launch(_dying_worker, tmp_path, where, timeout=timeout)
    assert codes[0] == 1, f"rank 0 should fail, exit code {codes[0]} (None: still waiting at the deadline)"
    assert codes[1] == 3
    error = launch_errors(tmp_path)
    if where == "forward":  # inside DDP: gloo's own message
        assert "by peer" in error, error
    else:
        assert "topology update at step 3 failed on rank 0 of 2: another rank died or stopped answering" in error
    if where == "hang":  # the silent peer leaves only once rank 0 has failed: rank 0 gave up on the group's timeout
        assert f"Timed out waiting {round(timeout * 1000)}ms" in error, error


def test_without_torch_distributed_nothing_changes():
    from torch_sparse_metal.distributed import LOCAL, resolve_sync

    assert not torch.distributed.is_initialized()
    net = _model(0)
    assert wrap(net) is net and rewrap(net) is net and is_main_process()
    assert resolve_sync() is None and resolve_sync(LOCAL) is None
    with pytest.raises(ValueError, match="process_group must be"):
        resolve_sync("world")
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        DynamicSparsity(net, torch.optim.SGD(net.parameters(), lr=0.1), total_steps=4, process_group=object())


def _rewrap_worker(rank: int, world: int, out: str) -> None:
    net = _model(0)
    ddp = nn.parallel.DistributedDataParallel(net)
    try:
        rewrap(ddp)
        raise AssertionError("rewrap of a directly built DDP did not raise")
    except TypeError as exc:
        assert "cannot recover the arguments" in str(exc), exc
    again = rewrap(ddp, find_unused_parameters=False)
    assert isinstance(again, nn.parallel.DistributedDataParallel) and again.module is net
    again(torch.randn(2, 12)).sum().backward()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    assert DynamicSparsity(net, opt, total_steps=4)._sync is None  # one rank: nothing to agree on


def test_rewrap_needs_the_arguments_of_a_wrapper_built_directly(tmp_path):
    """One rank (in a child process with a deadline, like every launch here: a process group initialised inside
    the pytest process can hang it): a directly built DDP cannot be rebuilt without its arguments; with them it
    can."""
    codes = launch(_rewrap_worker, tmp_path, world=1)
    assert codes == [0], launch_errors(tmp_path, world=1) or f"exit codes {codes}"
