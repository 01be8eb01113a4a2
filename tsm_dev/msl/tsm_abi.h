// ABI shared by the MSL-on-CPU runtime (runtime.cpp) and the kernels compiled through metal_compat.h.
// Plain C types only: the kernel translation unit is C++14 without the standard library.
#pragma once

#define TSM_SIMD_WIDTH 32u

extern "C" {

// Built-in values of one lane (Metal attributes), each a 3-vector x, y, z.
struct tsm_ids {
  unsigned thread_position_in_grid[3];
  unsigned thread_position_in_threadgroup[3];
  unsigned threadgroup_position_in_grid[3];
  unsigned threads_per_threadgroup[3];           // actual size of this (possibly partial) group
  unsigned dispatch_threads_per_threadgroup[3];  // size requested at dispatch
  unsigned threads_per_grid[3];
  unsigned threadgroups_per_grid[3];
  unsigned thread_index_in_threadgroup;
  unsigned thread_index_in_simdgroup;
  unsigned simdgroup_index_in_threadgroup;
  unsigned simdgroups_per_threadgroup;
  unsigned threads_per_simdgroup;
};

typedef void (*tsm_entry_fn)(void* const* buffers, const tsm_ids* ids);

// Collective points, implemented by the runtime; they suspend the calling lane (a fiber). `flags` are the
// barrier's mem_flags (1: device, 2: threadgroup): only a barrier with a flag orders that memory.
void tsm_threadgroup_barrier(unsigned flags);
// Publishes `size` bytes of this lane's value to its SIMD-group and waits until every live lane of the
// group has done the same for collective `kind`. Returns the 32 slots of the group (8 bytes each); on
// return *lane is the caller's lane and *mask the lanes that took part.
const unsigned long long* tsm_simd_exchange(const void* value, unsigned size, int kind, unsigned* lane,
                                            unsigned* mask);
// Checks (and counts, for the traffic model) an atomic read-modify-write of `bytes` bytes at `p` that the kernel
// code then performs uninstrumented.
void tsm_atomic_access(volatile void* p, unsigned long bytes);
// Aborts the dispatch with a message (raised as an exception in Python).
void tsm_fail(const char* message);
// Storage of threadgroup declaration `id` (`bytes` long, elements of `elem` bytes) for the running threadgroup.
void* tsm_threadgroup_storage(unsigned id, unsigned long bytes, unsigned long elem, const char* name);
}
