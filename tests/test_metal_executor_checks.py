"""The executor's checks: each bug that a GPU punishes (out-of-bounds access, data races, divergent barriers,
hangs) is caught in a deliberately buggy kernel, with a message naming the kernel and what was wrong; the
correct variant of each runs clean. The shipped shaders run under the same checks in test_metal_backend.py."""

from __future__ import annotations

import pytest
import torch

from torch_sparse_metal.backends import mps
from tsm_dev.msl import MslError, compile_shader

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

// No bounds check against the buffer: a grid larger than `out` stores past its end.
kernel void store_unguarded(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[i] = 1.0f;
}

// Reads one element before `in` for thread 0.
kernel void load_before(device float* out [[buffer(0)]], device const float* in [[buffer(1)]],
                        uint i [[thread_position_in_grid]]) {
  out[i] = in[int(i) - 1];
}

kernel void copy(device float* out [[buffer(0)]], device const float* in [[buffer(1)]],
                 uint i [[thread_position_in_grid]]) {
  out[i] = in[i];
}

// Casts away the const of an input and stores through it.
kernel void store_through_const(device const float* in [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  ((device float*)in)[i] = 0.0f;
}

// Guarded by a count: correct for any size, an empty `out` included.
kernel void store_guarded(device float* out [[buffer(0)]], constant long& n [[buffer(1)]],
                          uint i [[thread_position_in_grid]]) {
  if (long(i) < n) out[i] = 2.0f;
}

// Every thread stores to element 0 (no atomics).
kernel void store_same(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  out[0] = float(i);
}

// One store per threadgroup, into the same element.
kernel void store_per_group(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]],
                            uint group [[threadgroup_position_in_grid]]) {
  if (lid == 0) out[0] = float(group);
}

// Threadgroup 0 publishes a value that the others read in the same dispatch.
kernel void read_other_group(device float* out [[buffer(0)]], device float* shared_ [[buffer(1)]],
                             uint lid [[thread_position_in_threadgroup]], uint group [[threadgroup_position_in_grid]]) {
  if (group == 0 && lid == 0) shared_[0] = 5.0f;
  if (group != 0 && lid == 0) out[group] = shared_[0];
}

// Eight lanes share each slot of `tile`; each reads back its own store, which a sequential run would accept.
kernel void tile_shared_slot(device float* out [[buffer(0)]], device const float* in [[buffer(1)]],
                             uint gid [[thread_position_in_grid]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float tile[8];
  tile[lid % 8] = in[gid];
  out[gid] = tile[lid % 8];
}

// Reads a neighbour's slot without a barrier (`barrier` != 0: with one, which is correct).
kernel void tile_neighbour(device float* out [[buffer(0)]], device const float* in [[buffer(1)]],
                           constant int& barrier [[buffer(2)]], uint gid [[thread_position_in_grid]],
                           uint lid [[thread_position_in_threadgroup]], uint size [[threads_per_threadgroup]]) {
  threadgroup float tile[64];
  tile[lid] = in[gid];
  if (barrier != 0) threadgroup_barrier(mem_flags::mem_threadgroup);
  out[gid] = tile[(lid + 1) % size];
}

// One past the end of a threadgroup array.
kernel void tile_overflow(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float tile[32];
  tile[lid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = tile[lid];
}

// A lane reads what another lane stored to device memory, after a barrier with `flags` (2: threadgroup only,
// which does not order device memory; 3: device too).
kernel void device_handoff(device float* out [[buffer(0)]], constant int& flags [[buffer(1)]],
                           uint lid [[thread_position_in_threadgroup]]) {
  if (lid == 0) out[0] = 7.0f;
  if (flags == 3) threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
  else threadgroup_barrier(mem_flags::mem_threadgroup);
  if (lid == 1) out[1] = out[0];
}

// A barrier in each arm of a divergent if/else: every lane reaches "a" barrier, but not the same one.
kernel void barrier_both_arms(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float tile[64];
  if (lid < 32) {
    tile[lid] = 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    tile[lid] = 2.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[lid] = tile[lid];
}

// The same barrier reached through one helper called from two arms: two call sites, divergent as well.
inline void sync_tile() { threadgroup_barrier(mem_flags::mem_threadgroup); }
kernel void barrier_helper_arms(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  if (lid % 2 == 0) {
    out[lid] = 1.0f;
    sync_tile();
  } else {
    out[lid] = 2.0f;
    sync_tile();
  }
}

// A hand-made barrier: each lane counts itself in, then spins until every lane has. A GPU guarantees no lane
// progress while another spins (nor threadgroups), and here the first lane to arrive never yields.
kernel void spin_wait(device atomic_int* arrived [[buffer(0)]], uint size [[threads_per_threadgroup]]) {
  atomic_fetch_add_explicit(arrived, 1, memory_order_relaxed);
  while (atomic_load_explicit(arrived, memory_order_relaxed) < int(size)) {
  }
}

// A loop that never ends and touches no memory.
kernel void endless(device uint* out [[buffer(0)]], constant uint& n [[buffer(1)]],
                    uint i [[thread_position_in_grid]]) {
  uint x = i;
  for (uint k = 0; k != n; k += 2) {
    x = x * 3u + k;
  }
  out[i] = x;
}

// Many lanes and groups add into one element atomically: no race.
kernel void atomic_total(device atomic_float* total [[buffer(0)]], device const float* in [[buffer(1)]],
                         uint i [[thread_position_in_grid]]) {
  atomic_fetch_add_explicit(total, in[i], memory_order_relaxed);
}

// A plain store into an element other lanes add to atomically (`count` and `plain` bind one tensor).
kernel void atomic_and_plain(device atomic_int* count [[buffer(0)]], device int* plain [[buffer(1)]],
                             uint i [[thread_position_in_grid]]) {
  if (i == 3) plain[0] = 1;
  else atomic_fetch_add_explicit(count, 1, memory_order_relaxed);
}
"""


@pytest.fixture(scope="module")
def lib():
    return compile_shader(SOURCE, "executor_checks.metal")


# ------------------------------------------------------------------------------------------------ bounds
def test_store_past_the_end_is_reported_and_neighbour_untouched(lib):
    base = torch.zeros(16)
    out, neighbour = base[:5], base[5:]
    with pytest.raises(MslError, match=r"kernel store_unguarded: .*stores to argument 0 'out' \(float32\) at "
                                       r"index 5 .*out of bounds, it has 5 elements"):
        lib.store_unguarded(out, threads=6, group_size=8)  # one thread past the end
    assert torch.all(neighbour == 0), "the out-of-bounds store reached the neighbouring tensor"


def test_load_before_the_start_is_reported(lib):
    with pytest.raises(MslError, match=r"kernel load_before: .*loads argument 1 'in' \(float32\) at index -1 "):
        lib.load_before(torch.zeros(4), torch.ones(4))


def test_expanded_tensor_binds_only_its_storage(lib):
    one = torch.ones(1)
    with pytest.raises(MslError, match=r"argument 1 'in' \(float32\) at index 1 .*it has 1 element\b"):
        lib.copy(torch.zeros(4), one.expand(4), threads=2)  # thread 1 reads past the one element


def test_store_through_a_read_only_argument(lib):
    x = torch.ones(4)
    with pytest.raises(MslError, match=r"store_through_const: .*stores to argument 0 'in' \(float32\), which the "
                                       r"kernel declares read-only"):
        lib.store_through_const(x)
    assert torch.all(x == 1), "a read-only argument is not copied back"


def test_empty_tensor_binds_a_zero_length_buffer(lib):
    empty = torch.empty(0)
    lib.store_guarded(empty, 0, threads=4)  # guarded: nothing touched, no crash
    with pytest.raises(MslError, match=r"store_unguarded: .*argument 0 'out' \(float32\) at index 0 .*it has "
                                       r"0 elements"):
        lib.store_unguarded(empty, threads=1)


def test_threadgroup_array_overflow_is_reported(lib):
    with pytest.raises(MslError, match=r"tile_overflow: .*stores to threadgroup array 'tile' at index 32 .*out of "
                                       r"bounds, it has 32 elements"):
        lib.tile_overflow(torch.zeros(33), threads=33, group_size=33)
    out = torch.zeros(32)
    lib.tile_overflow(out, threads=32, group_size=32)
    assert torch.all(out == 1)


# ------------------------------------------------------------------------------------------------- races
def test_two_lanes_storing_one_element(lib):
    with pytest.raises(MslError, match=r"store_same: .*stores to argument 0 'out' \(float32\) at index 0: data "
                                       r"race, thread \d+ of this threadgroup stored to it in the same barrier "
                                       r"interval"):
        lib.store_same(torch.zeros(4), threads=32, group_size=32)


def test_two_threadgroups_storing_one_element(lib):
    with pytest.raises(MslError, match=r"store_per_group: .*data race, threadgroup \(\d, 0, 0\) stored to it in "
                                       r"the same dispatch"):
        lib.store_per_group(torch.zeros(4), threads=64, group_size=16)
    lib.store_per_group(torch.zeros(4), threads=16, group_size=16)  # one group: fine


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_threadgroup_reading_another_groups_store(lib, seed):
    """Whichever group runs first (the order is shuffled by the seed): the store and the load conflict."""
    with pytest.raises(MslError, match=r"read_other_group: .*argument 1 'shared_' \(float32\) at index 0: data "
                                       r"race, (threadgroup \(\d, 0, 0\)|several threadgroups) (loaded|stored to) "
                                       r"it in the same dispatch"):
        lib.read_other_group(torch.zeros(4), torch.zeros(1), threads=128, group_size=32, seed=seed)


def test_threadgroup_race_hidden_by_reading_back_own_store(lib):
    x = torch.arange(64.0)
    with pytest.raises(MslError, match=r"tile_shared_slot: .*threadgroup array 'tile' at index \d: data race"):
        lib.tile_shared_slot(torch.zeros(64), x, threads=64, group_size=64)


def test_threadgroup_read_without_barrier(lib):
    x = torch.arange(64.0)
    with pytest.raises(MslError, match=r"tile_neighbour: .*threadgroup array 'tile' at index \d+(: data race|, "
                                       r"which no thread of this threadgroup has stored to yet)"):
        lib.tile_neighbour(torch.zeros(64), x, 0, threads=64, group_size=64, arg_casts={2: "int32"})
    out = torch.zeros(64)
    lib.tile_neighbour(out, x, 1, threads=64, group_size=64, arg_casts={2: "int32"})
    assert torch.equal(out, torch.roll(x, -1))


def test_device_memory_needs_a_device_barrier(lib):
    with pytest.raises(MslError, match=r"device_handoff: .*loads argument 0 'out' \(float32\) at index 0: data "
                                       r"race, thread 0 of this threadgroup stored to it .*mem_flags::mem_device"):
        lib.device_handoff(torch.zeros(2), 2, threads=32, group_size=32, arg_casts={1: "int32"})
    out = torch.zeros(2)
    lib.device_handoff(out, 3, threads=32, group_size=32, arg_casts={1: "int32"})
    assert out.tolist() == [7.0, 7.0]


def test_atomics_do_not_race_but_a_plain_store_among_them_does(lib):
    total = torch.zeros(1)
    lib.atomic_total(total, torch.ones(4096), threads=4096, group_size=256)
    assert total.item() == 4096
    with pytest.raises(MslError, match=r"atomic_and_plain: .*argument 0 'count' \(int32\) at index 0: data race"):
        count = torch.zeros(1, dtype=torch.int32)
        lib.atomic_and_plain(count, count, threads=32, group_size=32)


# -------------------------------------------------------------------------------------- barriers, hangs
def test_barrier_in_both_arms_of_an_if_else(lib):
    with pytest.raises(MslError, match=r"barrier_both_arms: .*threadgroup_barrier in divergent control flow: "
                                       r"lanes .* wait at one barrier and lanes .* at another"):
        lib.barrier_both_arms(torch.zeros(64), threads=64, group_size=64)
    lib.barrier_both_arms(torch.zeros(64), threads=32, group_size=32)  # uniform: every lane takes one arm


def test_barrier_in_a_helper_called_from_both_arms(lib):
    with pytest.raises(MslError, match=r"barrier_helper_arms: .*divergent control flow"):
        lib.barrier_helper_arms(torch.zeros(64), threads=64, group_size=64)


def test_spin_wait_is_stopped_by_the_watchdog(lib):
    with pytest.raises(MslError, match=r"spin_wait: .*thread \d+ .*time budget of 0.5 s ran out \(watchdog\)"):
        lib.spin_wait(torch.zeros(1, dtype=torch.int32), threads=32, group_size=32, watchdog=0.5)


def test_endless_loop_without_memory_access_is_stopped(lib):
    with pytest.raises(MslError, match=r"endless: .*\(watchdog\)"):
        lib.endless(torch.zeros(1, dtype=torch.int32), 7, threads=1, watchdog=0.5, arg_casts={1: "int32"})


# ------------------------------------------------------------------------------------------ real shaders
def test_shipped_shaders_are_checked(tmp_path):
    """The shipped kernels are compiled with the checks: the forward's weight gather over more elements than its
    output holds is reported (the host code sizes every dispatch; here the kernel is called directly, with no
    columns of x to copy: one threadgroup, the gather's). Its index guard keeps a bad index inside the input and
    sets the error word instead."""
    library = compile_shader(mps.load_source(), "csr_linear_library.metal")
    index = torch.tensor([0, 2, 4], dtype=torch.int32)
    error = torch.zeros(1, dtype=torch.int32)
    no_x = (torch.zeros(0), torch.zeros(1, 0))  # its feature-major copy and x: one batch row, no columns
    grid = {"threads": (32, 8), "group_size": (32, 8)}
    with pytest.raises(MslError, match=r"kernel forward_operands_float: .*stores to argument 1 'w_by_dst' "
                                       r"\(float32\) at index 2 .*it has 2 elements"):
        library.forward_operands_float(no_x[0], torch.zeros(2), no_x[1], torch.arange(5.0), index, error, 1, 0, 32, 3,
                                       **grid)
    out = torch.zeros(3)
    library.forward_operands_float(no_x[0], out, no_x[1], torch.arange(4.0), index, error, 1, 0, 32, 3, **grid)
    assert out.tolist() == [0.0, 2.0, 2.0] and error.item() == 1  # index 4 clamped to the last of count = 3
