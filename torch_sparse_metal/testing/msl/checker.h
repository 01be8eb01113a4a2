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
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tsm_abi.h"

namespace tsm_check {

enum : uint32_t {
  kCopyBack = 1,  // copy the private copy back after the dispatch (tensors)
  kWritable = 2,  // the kernel declares it writable: its elements are tracked for races (reads never race)
};

// One kernel argument as the Python driver describes it (a tensor's bytes, or a scalar's packed bytes).
struct ArgSpec {
  void* data;          // may be null when bytes == 0 (an empty tensor)
  uint64_t bytes;      // exactly what the kernel may touch
  uint32_t elem;       // element size: the unit of indices in messages and of race tracking
  uint32_t flags;      // kCopyBack | kWritable
  const char* label;   // "argument 0 'out' (float32)"
};

// The lane now running on this OS thread, kept current by the scheduler.
struct LaneState {
  uintptr_t stack_lo = 0;  // the lane's own stack: its local variables, never checked
  uintptr_t stack_bytes = 0;
  uint32_t group = 0;      // linear threadgroup index in the dispatch
  uint32_t lane = 0;       // thread_index_in_threadgroup
  uint32_t epoch_tg = 0;   // barrier intervals of the group, counted by barriers that order threadgroup memory
  uint32_t epoch_dev = 0;  // ... and device memory
};

struct Memory;  // one dispatch: private copies, shadows, time budget

// Binds the arguments of one dispatch: fills `table` with pointers into private copies. Returns null with
// `error` set when memory runs out.
Memory* begin_dispatch(const ArgSpec* args, int nargs, void** table, const unsigned* ngroups, double watchdog_s,
                       std::string* error);
// Copies private copies back (also after a failed dispatch: what ran before the failure stays visible) and
// frees the dispatch.
void end_dispatch(Memory* m);
// Per OS worker thread: attach before running groups, detach after. `lane` is kept current by the scheduler.
void attach_worker(Memory* m, LaneState* lane);
void detach_worker();
// Start of a threadgroup on this worker: forget what the previous one left in threadgroup memory.
void begin_group();
// Asks a running dispatch to stop (another worker failed): lanes fail at their next checked access.
void abort_dispatch(Memory* m);

}  // namespace tsm_check
