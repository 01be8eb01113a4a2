"""Run a function on gloo ranks of spawned CPU processes, for the distributed tests.

Each launch starts the ranks as spawned processes that rendezvous through a file store (no port to race for) and
joins them against a deadline, killing whatever is left, so a hang fails the test instead of the suite. A rank that
raises writes its traceback to ``error<rank>.txt`` in the launch's folder.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

__all__ = ["PG_TIMEOUT_S", "WORLD", "launch", "launch_errors"]

WORLD = 2
DEADLINE_S = 60.0  # per launch: start-up of 2 processes on a loaded 2-core machine included
PG_TIMEOUT_S = 20.0  # the process group's timeout: the longest a collective may wait for a silent peer


def _entry(fn, rank: int, world: int, init: str, out: str, timeout: float, args: tuple) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=timeout))
    try:
        fn(rank, world, out, *args)
    except BaseException:
        with open(os.path.join(out, f"error{rank}.txt"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)  # no teardown: the group may be broken
    gc.collect()  # the run's DDP wrappers and pending work let go of the group while the interpreter is whole
    torch.distributed.barrier()  # no rank tears its gloo context down while the other still talks to it
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    # The results are on disk: skip the interpreter's finalization, where torch's gloo objects still alive then
    # have aborted a rank ("terminate called without an active exception", exit -6) after all its work was done.
    os._exit(0)


def launch(fn, out, *args, world: int = WORLD, timeout: float = PG_TIMEOUT_S) -> list[int | None]:
    """Run ``fn(rank, world, out, *args)`` on ``world`` gloo ranks; their exit codes (None: still running at the
    deadline, then killed). The deadline only stops a hung launch; no test reads the time a launch took."""
    ctx = mp.get_context("spawn")
    init = f"file://{out}/store"
    procs = [ctx.Process(target=_entry, args=(fn, rank, world, init, str(out), timeout, args)) for rank in range(world)]
    start = time.monotonic()
    for p in procs:
        p.start()
    for p in procs:
        p.join(max(0.0, DEADLINE_S - (time.monotonic() - start)))
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return codes


def launch_errors(out, world: int = WORLD) -> str:
    paths = [os.path.join(out, f"error{r}.txt") for r in range(world)]
    return "\n".join(open(p).read() for p in paths if os.path.exists(p))
