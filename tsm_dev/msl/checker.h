// Interface between the executor's scheduler (runtime.cpp) and its memory checker (checker.cpp).
//
// Kernels are compiled with g++'s ThreadSanitizer instrumentation, but against the checker's own __tsan_*
// callbacks instead of libtsan: every load, store and atomic of kernel code arrives here with its address
// and size before it happens. The checker then
// - binds each argument as a private copy with a red zone on both sides (exact size: a store one past the end
//   is an error naming the argument and index, never a write into a neighbouring tensor);
// - keeps a shadow record of the last writer and the readers of each element (threadgroup, lane, barrier
//   interval), which turns a conflict between two lanes in one barrier interval, or between two threadgroups
//   of one dispatch, into an error even when the order the lanes ran in happened to give the right answer;
// - counts accesses against a per-dispatch time budget (a lane spinning on an atomic no one will change
//   becomes an error, not a hang).
// On request the same hooks feed the traffic model (traffic.cpp): per SIMD-group memory instruction, the segments
// its lanes touch, bytes per buffer, atomics and their address conflicts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tsm_abi.h"

namespace tsm_check {

enum : uint32_t {
  kCopyBack = 1,  // copy the private copy back after the dispatch (tensors)
  kWritable = 2,  // the kernel declares it writable: its elements are tracked for races (reads never race)
  kScalar = 4,    // a Python scalar or list (a `constant` argument): not device-memory traffic
};

// One kernel argument as the Python driver describes it (a tensor's bytes, or a scalar's packed bytes).
struct ArgSpec {
  void* data;          // may be null when bytes == 0 (an empty tensor)
  uint64_t bytes;      // exactly what the kernel may touch
  uint32_t elem;       // element size: the unit of indices in messages and of race tracking
  uint32_t flags;      // kCopyBack | kWritable
  const char* label;   // "argument 0 'out' (float32)"
  uint64_t view_offset;  // bytes from the start of its storage (a GPU buffer's aligned base) to `data`
};

// ------------------------------------------------------------------------------------------ traffic model
// Counters of one dispatch, filled when the driver passes a Traffic to begin_dispatch (mirrored by ctypes in
// traffic.py). One instruction = one (SIMD-group, access site, n-th execution of that site by the lane).
enum : int { kLoad = 0, kStore = 1, kAtomicOp = 2, kTrafficMaxBuffers = 32 };
struct TrafficOp {
  uint64_t instructions;  // SIMD-group instructions (CUDA: requests)
  uint64_t lanes;         // lane accesses
  uint64_t bytes;         // bytes the lanes asked for
  uint64_t seg32, seg64, seg128;  // distinct aligned segments per instruction, summed (seg32: CUDA's sectors)
  uint64_t wavefronts;    // threadgroup memory: per instruction the most distinct 4-byte words in one of 32 banks
};
struct TrafficBuffer {
  uint64_t instructions[3], lanes[3], bytes[3], sectors[3];  // by kLoad / kStore / kAtomicOp
  uint64_t footprint_sectors;                                // distinct 32-byte sectors over the dispatch
};
struct Traffic {
  TrafficOp device[3];       // tensor arguments, by kLoad / kStore / kAtomicOp
  TrafficOp threadgroup[3];  // threadgroup arrays
  TrafficOp constant;        // loads of scalar arguments (`constant T&`; on the GPU a uniform, no memory traffic)
  uint64_t atomic_addresses;       // distinct device addresses updated atomically, per threadgroup, summed
  uint64_t atomic_simd_same;       // atomic lane accesses whose address another lane of the same instruction hits
  uint64_t atomic_group_same;      // ... that another SIMD-group of the same threadgroup also updates
  uint64_t atomic_shared_addresses;  // device addresses updated atomically by more than one threadgroup
  uint64_t barriers, max_barriers;   // threadgroup barriers executed (summed over threadgroups; most in one)
  uint64_t groups, simdgroups, threads;
  TrafficBuffer buffers[kTrafficMaxBuffers];  // by argument index
};

// The lane now running on this OS thread, kept current by the scheduler.
struct LaneState {
  uintptr_t stack_lo = 0;  // the lane's own stack: its local variables, never checked
  uintptr_t stack_bytes = 0;
  uint32_t group = 0;      // linear threadgroup index in the dispatch
  uint32_t lane = 0;       // thread_index_in_threadgroup
  uint32_t epoch_tg = 0;   // barrier intervals of the group, counted by barriers that order threadgroup memory
  uint32_t epoch_dev = 0;  // ... and device memory
  uint32_t barriers = 0;   // barriers the group has passed (any mem_flags)
  uint32_t threads = 0;    // lanes of the group
};

struct Memory;  // one dispatch: private copies, shadows, time budget

// Binds the arguments of one dispatch: fills `table` with pointers into private copies. Returns null with
// `error` set when memory runs out.
// `traffic` (may be null: the model is off) receives the dispatch's counters at end_dispatch.
Memory* begin_dispatch(const ArgSpec* args, int nargs, void** table, const unsigned* ngroups, double watchdog_s,
                       Traffic* traffic, std::string* error);
// Copies private copies back (also after a failed dispatch: what ran before the failure stays visible) and
// frees the dispatch.
void end_dispatch(Memory* m);
// Per OS worker thread: attach before running groups, detach after. `lane` is kept current by the scheduler.
void attach_worker(Memory* m, LaneState* lane);
void detach_worker();
// Start of a threadgroup on this worker: forget what the previous one left in threadgroup memory.
void begin_group();
// End of a threadgroup that ran to completion: the traffic model counts its instructions.
void end_group();
// Asks a running dispatch to stop (another worker failed): lanes fail at their next checked access.
void abort_dispatch(Memory* m);

}  // namespace tsm_check
