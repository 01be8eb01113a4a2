"""Several processes under ``torchrun``: the launch, the process group, and what the ranks must agree on.

``torchrun --nproc-per-node N examples/train_wikitext103.py ...`` starts N copies of the command with
``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` in their environment. :func:`torchrun_launch` reads them (None
without torchrun, or with one process in all: then the run is the plain single-process one). Each process
trains on its own windows (:func:`rank_seed`) under ``DistributedDataParallel``; the training loop agrees on
the training loss and the training clock only where it reads the device anyway, every ``--log-every`` steps
(:func:`mean_over_ranks_`, :func:`max_over_ranks`); docs/training.md, "Several GPUs (torchrun)".

Example:
    >>> torchrun_launch({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"})
    Launch(rank=1, world_size=2, local_rank=1, local_world_size=2)
    >>> torchrun_launch({}) is None
    True
"""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = ["Launch", "destroy_process_group", "init_process_group", "max_over_ranks", "mean_over_ranks_",
           "process_device", "rank_and_world", "rank_seed", "torchrun_launch"]

#: Default of ``--dist-timeout``: how long a collective waits for a silent rank before the run fails.
DEFAULT_TIMEOUT_MINUTES = 5.0


@dataclass(frozen=True)
class Launch:
    """This process's place in a torchrun launch."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def torchrun_launch(environ: Mapping[str, str] = os.environ) -> Launch | None:
    """The launch torchrun describes in ``environ``; None without torchrun or with a world of one process
    (nothing to agree on: the run is exactly the single-process one). Raises ValueError on malformed values."""
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    if not all(name in environ for name in names):
        return None
    try:
        rank, world, local = (int(environ[name]) for name in names)
        local_world = int(environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        raise ValueError("RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE must be integers (as torchrun sets "
                         "them)") from None
    if world <= 1:
        return None
    if not 0 <= rank < world or not 0 <= local < local_world:
        raise ValueError(f"RANK {rank} / WORLD_SIZE {world}, LOCAL_RANK {local} / LOCAL_WORLD_SIZE {local_world}: "
                         "not a place in the launch")
    return Launch(rank, world, local, local_world)


def process_device(device: torch.device, launch: Launch) -> torch.device:
    """This process's device: ``cuda`` (``--device cuda`` or ``auto``) becomes ``cuda:LOCAL_RANK``; the CPU stays.

    Raises ValueError for a device the processes cannot share: an explicit ``cuda:N`` with several processes
    on this host (all would use one GPU), MPS (torch.distributed has no backend for its tensors), or fewer GPUs
    than processes on this host.
    """
    if device.type == "cpu":
        return device
    if device.type == "mps":
        raise ValueError("--device mps under torchrun: torch.distributed has no backend for MPS tensors; "
                         "use --device cpu, or run without torchrun")
    if device.index is not None:
        if launch.local_world_size > 1:
            raise ValueError(f"--device {device} under torchrun with {launch.local_world_size} processes on this "
                             "host: all would use one GPU; give --device cuda (process i takes cuda:i)")
        return device
    count = torch.cuda.device_count()
    if launch.local_rank >= count:
        raise ValueError(f"torchrun started {launch.local_world_size} processes on this host, which has {count} "
                         f"CUDA device{'s' * (count != 1)}: give --nproc-per-node {count} or fewer")
    return torch.device("cuda", launch.local_rank)


def init_process_group(device: torch.device, timeout_minutes: float) -> None:
    """NCCL for CUDA, gloo for the CPU, rendezvous from torchrun's environment; every collective then fails
    after ``timeout_minutes`` of waiting for a silent rank instead of hanging."""
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's communicators bind to the current device
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, timeout=datetime.timedelta(minutes=timeout_minutes))


def destroy_process_group() -> None:
    """Tear the process group down, if one is up."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def rank_and_world() -> tuple[int, int]:
    """``(rank, world size)`` of the default process group; ``(0, 1)`` without torch.distributed.

    Example:
        >>> rank_and_world()
        (0, 1)
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def rank_seed(seed: int, rank: int, step: int, stream: str) -> int:
    """A seed for rank ``rank``'s own random ``stream`` (training windows, dropout), from ``--seed`` and the step
    the stream starts at: distinct per rank, per stream and per resume, and the same in every run.

    Example:
        >>> rank_seed(0, 1, 0, "windows") == rank_seed(0, 1, 0, "windows") != rank_seed(0, 2, 0, "windows")
        True
    """
    digest = hashlib.blake2b(f"{seed}:{rank}:{step}:{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # below 2**63, as torch generators take it


def mean_over_ranks_(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` averaged over the ranks, in place (a no-op in one process)."""
    world = rank_and_world()[1]
    if world > 1:
        torch.distributed.all_reduce(tensor)
        tensor.div_(world)
    return tensor


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest ``value`` over the ranks (``value`` in one process)."""
    if rank_and_world()[1] == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t.item())
