"""Memory-traffic and contention model of the MSL-on-CPU executor (docs/metal.md, "Traffic model").

Off unless asked for: ``kernel(..., traffic=True)`` returns a :class:`DispatchTraffic` for that dispatch, and
``with record() as dispatches:`` collects one for every dispatch the block makes (through the real host code,
e.g. ``MetalCsrLinear.forward``). The counts come from the checker's hooks (traffic.cpp): an instruction is one
(SIMD-group, access site, n-th execution of that site by the lane), i.e. what a 32-wide SIMT machine issues once
for the SIMD-group; its lanes' addresses give the segments it touches. 32-byte segments are CUDA's sectors and
instructions its per-warp requests, so the numbers compare with Nsight Compute's ``l1tex__t_sectors_*`` and
``l1tex__t_requests_*`` (benchmarks/traffic_validate.py).

Example:
    >>> import torch
    >>> from tsm_dev.msl import compile_shader
    >>> lib = compile_shader("kernel void k(device float* o [[buffer(0)]], device const float* a [[buffer(1)]], "
    ...                      "uint i [[thread_position_in_grid]]) { o[i] = a[i]; }")
    >>> t = lib.k(torch.zeros(64), torch.ones(64), threads=64, group_size=64, traffic=True)
    >>> t.device["load"].instructions, t.device["load"].seg32, t.buffers[1].footprint_bytes
    (2, 8, 256)
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["OPS", "BufferTraffic", "DispatchTraffic", "OpTraffic", "TrafficStruct", "occupancy", "record"]

#: Access classes, in the order of the C arrays (tsm_check::kLoad, kStore, kAtomicOp).
OPS = ("load", "store", "atomic")
_MAX_BUFFERS = 32  # tsm_check::kTrafficMaxBuffers


class _Op(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint64) for n in ("instructions", "lanes", "bytes", "seg32", "seg64", "seg128",
                                               "wavefronts")]


class _Buffer(ctypes.Structure):
    _fields_ = [("instructions", ctypes.c_uint64 * 3), ("lanes", ctypes.c_uint64 * 3), ("bytes", ctypes.c_uint64 * 3),
                ("sectors", ctypes.c_uint64 * 3), ("footprint_sectors", ctypes.c_uint64)]


class TrafficStruct(ctypes.Structure):
    """``tsm_check::Traffic`` (checker.h)."""

    _fields_ = [("device", _Op * 3), ("threadgroup", _Op * 3), ("constant", _Op),
                *[(n, ctypes.c_uint64) for n in ("atomic_addresses", "atomic_simd_same", "atomic_group_same",
                                                 "atomic_shared_addresses", "barriers", "max_barriers", "groups",
                                                 "simdgroups", "threads")],
                ("buffers", _Buffer * _MAX_BUFFERS)]


@dataclass
class OpTraffic:
    """One class of access (loads, stores or atomics) to one memory space, summed over a dispatch."""

    instructions: int = 0  #: SIMD-group instructions (CUDA: requests)
    lanes: int = 0         #: lane accesses
    bytes: int = 0         #: bytes the lanes asked for
    seg32: int = 0         #: distinct 32-byte segments per instruction, summed (CUDA: sectors)
    seg64: int = 0
    seg128: int = 0
    wavefronts: int = 0    #: threadgroup memory only: bank passes (32 banks of 4 bytes)

    def per_instruction(self, what: str) -> float:
        return getattr(self, what) / self.instructions if self.instructions else 0.0


@dataclass
class BufferTraffic:
    """What one bound argument saw."""

    name: str
    scalar: bool
    instructions: dict[str, int]
    bytes: dict[str, int]        #: requested by the lanes, per access class
    sectors: dict[str, int]      #: 32-byte sectors the instructions touched (bytes moved = 32 x this)
    footprint_bytes: int         #: distinct 32-byte sectors over the dispatch, x 32 (what DRAM must move at least)


@dataclass
class DispatchTraffic:
    """The model's counts for one dispatch (see the module docstring)."""

    kernel: str
    grid: tuple[int, int, int]
    group: tuple[int, int, int]
    threadgroup_memory: int      #: bytes per threadgroup (static)
    device: dict[str, OpTraffic]
    threadgroup: dict[str, OpTraffic]
    constant: OpTraffic          #: loads of scalar arguments (uniforms on a GPU: no memory traffic)
    atomic_addresses: int        #: distinct addresses updated atomically, per threadgroup, summed
    atomic_simd_same: int        #: atomic lane accesses whose address another lane of the same instruction hits
    atomic_group_same: int       #: atomic lane accesses to an address another SIMD-group of the threadgroup updates
    atomic_shared_addresses: int  #: addresses updated atomically by more than one threadgroup
    barriers: int                #: threadgroup barriers, summed over threadgroups
    max_barriers: int            #: the most any one threadgroup passed
    groups: int
    simdgroups: int
    threads: int
    buffers: dict[int, BufferTraffic] = field(default_factory=dict)

    @property
    def threads_per_group(self) -> int:
        return self.group[0] * self.group[1] * self.group[2]

    def occupancy(self) -> dict[str, Any]:
        return occupancy(self.threads_per_group, self.threadgroup_memory)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["occupancy"] = self.occupancy()
        return d

    @classmethod
    def from_struct(cls, s: TrafficStruct, kernel: str, grid: tuple[int, int, int], group: tuple[int, int, int],
                    threadgroup_memory: int, names: dict[int, str], scalars: set[int], nargs: int
                    ) -> DispatchTraffic:
        def op(o: _Op) -> OpTraffic:
            return OpTraffic(*(int(getattr(o, n)) for n, _ in _Op._fields_))

        buffers = {}
        for i in range(min(nargs, _MAX_BUFFERS)):
            b = s.buffers[i]
            buffers[i] = BufferTraffic(names.get(i, f"arg{i}"), i in scalars,
                                       dict(zip(OPS, map(int, b.instructions))), dict(zip(OPS, map(int, b.bytes))),
                                       dict(zip(OPS, map(int, b.sectors))), int(b.footprint_sectors) * 32)
        return cls(kernel, grid, group, threadgroup_memory, {k: op(s.device[i]) for i, k in enumerate(OPS)},
                   {k: op(s.threadgroup[i]) for i, k in enumerate(OPS)}, op(s.constant),
                   *(int(getattr(s, n)) for n in ("atomic_addresses", "atomic_simd_same", "atomic_group_same",
                                                  "atomic_shared_addresses", "barriers", "max_barriers", "groups",
                                                  "simdgroups", "threads")), buffers=buffers)


#: Apple GPU limits the occupancy bound uses: the executor's (executor.py, docs/metal.md "Verified without a
#: Mac"): 32 KiB of threadgroup memory and 1024 threads per threadgroup. Apple documents no per-core figures, so
#: the bound takes a core to hold at most that much threadgroup memory and that many threads; registers, the
#: other limit, cannot be seen on the CPU.
APPLE_THREADGROUP_MEMORY = 32 * 1024
APPLE_THREADS = 1024


def occupancy(threads_per_group: int, threadgroup_memory: int) -> dict[str, Any]:
    """Threadgroups (and SIMD-groups) a core can hold by threadgroup memory and by threads, and which binds."""
    by_threads = APPLE_THREADS // max(threads_per_group, 1)
    by_memory = APPLE_THREADGROUP_MEMORY // threadgroup_memory if threadgroup_memory else by_threads
    groups = min(by_threads, by_memory)
    return {"groups": groups, "simdgroups": groups * -(-threads_per_group // 32),
            "limited_by": "threadgroup memory" if by_memory < by_threads else "threads",
            "groups_by_memory": by_memory, "groups_by_threads": by_threads}


_local = threading.local()


def recorder() -> list[DispatchTraffic] | None:
    """The list :func:`record` collects into on this thread, if any."""
    return getattr(_local, "dispatches", None)


@contextmanager
def record() -> Iterator[list[DispatchTraffic]]:
    """Every executor dispatch on this thread inside the block gets the traffic model; yields their reports."""
    previous = recorder()
    _local.dispatches = dispatches = []
    try:
        yield dispatches
    finally:
        _local.dispatches = previous
