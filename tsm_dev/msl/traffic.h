// Memory-traffic and contention model of the MSL-on-CPU executor (opt-in per dispatch; docs/metal.md, "Traffic
// model"). The checker forwards every checked access of kernel code with the address of its call site (the
// instruction); an instruction of a SIMD-group is one (SIMD-group, site, n-th execution of the site by the lane),
// which groups the lanes of one SIMT instruction without knowing the control flow. At the end of a threadgroup
// each instruction's lanes are reduced to segments touched, bytes per buffer, bank wavefronts and atomic
// conflicts; workers add their sums into the dispatch's Traffic at the end.
#pragma once

#include <cstdint>

#include "checker.h"

namespace tsm_traffic {

// A tensor or scalar argument as the model sees it.
struct Buffer {
  uint64_t bytes;
  uint64_t view_offset;  // where the argument starts in its (GPU-aligned) storage: segments are counted from there
  bool scalar;
};

struct Model;

Model* begin(tsm_check::Traffic* out, const Buffer* buffers, int nbuffers);
// `buffer` >= 0: argument index; < 0: threadgroup array -1 - buffer. `offset` is the byte offset in it.
void access(Model* m, const tsm_check::LaneState& lane, int buffer, uint64_t offset, uint32_t bytes, int kind,
            uintptr_t site);
void begin_group(Model* m);
void end_group(Model* m, const tsm_check::LaneState& lane);
// Per worker thread, after its last group: adds its sums to the dispatch's.
void detach(Model* m);
// Writes the counters out and frees the model.
void end(Model* m);

}  // namespace tsm_traffic
