// Traffic model of the MSL-on-CPU executor (see traffic.h).
#include "traffic.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace tsm_traffic {
namespace {

using tsm_check::kAtomicOp;
using tsm_check::kLoad;
using tsm_check::kStore;
using tsm_check::Traffic;
using tsm_check::TrafficOp;

// One lane's access, kept until its threadgroup ends (only then are all lanes of an instruction known).
struct Record {
  uintptr_t site;
  uint64_t offset;  // in the buffer's storage (view_offset included)
  uint32_t occurrence;
  uint32_t bytes;
  int32_t buffer;
  uint16_t simd;
  uint8_t op;
};

int op_of(int kind) { return (kind & 2) ? kAtomicOp : (kind & 1) ? kStore : kLoad; }

// Device addresses are kept apart per argument: (argument + 1) above bit 44 (a buffer under 16 TiB).
uint64_t global_address(int buffer, uint64_t offset) { return (uint64_t(buffer + 1) << 44) | offset; }

struct AtomicUse {
  uint32_t simd;
  uint32_t ops;
  bool shared;  // another SIMD-group of the threadgroup updates it too
};

struct WorkerState {
  std::vector<Record> records;
  std::unordered_map<uint64_t, uint32_t> occurrences;  // (lane, site) -> executions so far
  std::unordered_map<uint64_t, AtomicUse> atomics;     // device address -> use in this threadgroup
  std::vector<uint64_t> scratch, scratch2;
  Traffic sums;
};

thread_local WorkerState* t_state = nullptr;

void add(TrafficOp& a, const TrafficOp& b) {
  a.instructions += b.instructions;
  a.lanes += b.lanes;
  a.bytes += b.bytes;
  a.seg32 += b.seg32;
  a.seg64 += b.seg64;
  a.seg128 += b.seg128;
  a.wavefronts += b.wavefronts;
}

uint64_t distinct(std::vector<uint64_t>& v) {
  std::sort(v.begin(), v.end());
  return uint64_t(std::unique(v.begin(), v.end()) - v.begin());
}

}  // namespace

struct Model {
  Traffic* out;
  std::vector<Buffer> buffers;
  std::vector<std::vector<std::atomic<uint64_t>>> footprint;  // per argument, one bit per 32-byte sector
  std::mutex mutex;
  Traffic total;
  std::unordered_map<uint64_t, uint32_t> atomic_owner;  // device address -> threadgroup, or kMany
  std::vector<WorkerState*> workers;
};

namespace {
constexpr uint32_t kMany = ~0u;

WorkerState& state(Model* m) {
  if (!t_state) {
    t_state = new WorkerState();
    std::lock_guard<std::mutex> lock(m->mutex);
    m->workers.push_back(t_state);
  }
  return *t_state;
}

// One SIMD-group instruction: records [b, e) share (simd, site, occurrence).
void instruction(Model* m, WorkerState& s, const Record* b, const Record* e) {
  Traffic& t = s.sums;
  const int op = b->op;
  const bool tg = b->buffer < 0;
  const bool scalar = !tg && m->buffers[size_t(b->buffer)].scalar;
  TrafficOp& cls = tg ? t.threadgroup[op] : scalar ? t.constant : t.device[op];
  cls.instructions += 1;
  for (const Record* r = b; r != e; ++r) {
    cls.lanes += 1;
    cls.bytes += r->bytes;
  }
  if (tg) {  // bank wavefronts: the most distinct 4-byte words any one of 32 banks serves
    s.scratch.clear();
    for (const Record* r = b; r != e; ++r)
      for (uint64_t w = r->offset >> 2; w <= (r->offset + r->bytes - 1) >> 2; ++w)
        s.scratch.push_back((w & 31) << 58 | uint64_t(-r->buffer) << 40 | w);
    const uint64_t n = distinct(s.scratch);
    uint64_t most = 0, run = 0;
    for (uint64_t i = 0; i < n; ++i) {
      run = (i && (s.scratch[i] >> 58) == (s.scratch[i - 1] >> 58)) ? run + 1 : 1;
      most = std::max(most, run);
    }
    cls.wavefronts += most;
    return;
  }
  uint64_t* seg[3] = {&cls.seg32, &cls.seg64, &cls.seg128};
  for (int k = 0; k < 3; ++k) {
    const unsigned shift = 5 + unsigned(k);
    s.scratch.clear();
    for (const Record* r = b; r != e; ++r) {
      const uint64_t lo = global_address(r->buffer, r->offset), hi = lo + r->bytes - 1;
      for (uint64_t g = lo >> shift; g <= hi >> shift; ++g) s.scratch.push_back(g);
    }
    const uint64_t n = distinct(s.scratch);
    *seg[k] += n;
    if (k != 0) continue;
    for (uint64_t i = 0; i < n; ++i) {  // sectors per buffer, and the dispatch's footprint
      const uint64_t sector = s.scratch[i];
      const int buffer = int(sector >> (44 - 5)) - 1;
      tsm_check::TrafficBuffer& tb = t.buffers[buffer];
      tb.sectors[op] += 1;
      const uint64_t bit = sector & ((uint64_t(1) << (44 - 5)) - 1);
      auto& bits = m->footprint[size_t(buffer)];
      if ((bit >> 6) < bits.size()) bits[bit >> 6].fetch_or(uint64_t(1) << (bit & 63), std::memory_order_relaxed);
    }
  }
  for (const Record* r = b; r != e; ++r) {
    tsm_check::TrafficBuffer& tb = t.buffers[r->buffer];
    tb.lanes[op] += 1;
    tb.bytes[op] += r->bytes;
  }
  t.buffers[b->buffer].instructions[op] += 1;
  if (op != kAtomicOp || scalar) return;
  s.scratch.clear();
  for (const Record* r = b; r != e; ++r) s.scratch.push_back(global_address(r->buffer, r->offset));
  std::sort(s.scratch.begin(), s.scratch.end());
  for (size_t i = 0; i < s.scratch.size();) {
    size_t j = i;
    while (j < s.scratch.size() && s.scratch[j] == s.scratch[i]) ++j;
    if (j - i > 1) t.atomic_simd_same += j - i;
    auto it = s.atomics.find(s.scratch[i]);
    if (it == s.atomics.end()) {
      s.atomics.emplace(s.scratch[i], AtomicUse{b->simd, uint32_t(j - i), false});
    } else {
      it->second.shared = it->second.shared || it->second.simd != b->simd;
      it->second.ops += uint32_t(j - i);
    }
    i = j;
  }
}

}  // namespace

Model* begin(Traffic* out, const Buffer* buffers, int nbuffers) {
  Model* m = new Model();
  m->out = out;
  std::memset(&m->total, 0, sizeof m->total);
  m->buffers.assign(buffers, buffers + nbuffers);
  m->footprint = std::vector<std::vector<std::atomic<uint64_t>>>(size_t(nbuffers));
  for (int i = 0; i < nbuffers; ++i) {
    const Buffer& b = buffers[i];
    const uint64_t sectors = ((b.view_offset + b.bytes + 31) >> 5) + 1;
    m->footprint[size_t(i)] = std::vector<std::atomic<uint64_t>>(b.scalar ? 0 : size_t((sectors + 63) >> 6));
  }
  return m;
}

void access(Model* m, const tsm_check::LaneState& lane, int buffer, uint64_t offset, uint32_t bytes, int kind,
            uintptr_t site) {
  if (buffer >= tsm_check::kTrafficMaxBuffers) return;
  WorkerState& s = state(m);
  const uint32_t occurrence = s.occurrences[(uint64_t(lane.lane) << 48) ^ site]++;
  if (buffer >= 0) offset += m->buffers[size_t(buffer)].view_offset;
  s.records.push_back(Record{site, offset, occurrence, bytes, buffer, uint16_t(lane.lane / 32), uint8_t(op_of(kind))});
}

void begin_group(Model* m) {
  WorkerState& s = state(m);
  s.records.clear();
  s.occurrences.clear();
  s.atomics.clear();
}

void end_group(Model* m, const tsm_check::LaneState& lane) {
  WorkerState& s = state(m);
  std::sort(s.records.begin(), s.records.end(), [](const Record& a, const Record& b) {
    if (a.simd != b.simd) return a.simd < b.simd;
    if (a.site != b.site) return a.site < b.site;
    return a.occurrence < b.occurrence;
  });
  for (size_t i = 0; i < s.records.size();) {
    size_t j = i + 1;
    while (j < s.records.size() && s.records[j].simd == s.records[i].simd && s.records[j].site == s.records[i].site &&
           s.records[j].occurrence == s.records[i].occurrence)
      ++j;
    instruction(m, s, s.records.data() + i, s.records.data() + j);
    i = j;
  }
  Traffic& t = s.sums;
  t.groups += 1;
  t.threads += lane.threads;
  t.simdgroups += (lane.threads + 31) / 32;
  t.barriers += lane.barriers;
  t.max_barriers = std::max<uint64_t>(t.max_barriers, lane.barriers);
  t.atomic_addresses += s.atomics.size();
  if (!s.atomics.empty()) {
    std::lock_guard<std::mutex> lock(m->mutex);
    for (const auto& a : s.atomics) {
      if (a.second.shared) t.atomic_group_same += a.second.ops;
      auto it = m->atomic_owner.emplace(a.first, lane.group).first;
      if (it->second != lane.group && it->second != kMany) {
        it->second = kMany;
        m->total.atomic_shared_addresses += 1;
      }
    }
  }
  s.records.clear();
  s.occurrences.clear();
  s.atomics.clear();
}

void detach(Model* m) {
  WorkerState* s = t_state;
  if (!s) return;
  std::lock_guard<std::mutex> lock(m->mutex);
  Traffic& a = m->total;
  const Traffic& b = s->sums;
  for (int k = 0; k < 3; ++k) {
    add(a.device[k], b.device[k]);
    add(a.threadgroup[k], b.threadgroup[k]);
  }
  add(a.constant, b.constant);
  a.atomic_addresses += b.atomic_addresses;
  a.atomic_simd_same += b.atomic_simd_same;
  a.atomic_group_same += b.atomic_group_same;
  a.barriers += b.barriers;
  a.max_barriers = std::max(a.max_barriers, b.max_barriers);
  a.groups += b.groups;
  a.simdgroups += b.simdgroups;
  a.threads += b.threads;
  for (int i = 0; i < tsm_check::kTrafficMaxBuffers; ++i)
    for (int k = 0; k < 3; ++k) {
      a.buffers[i].instructions[k] += b.buffers[i].instructions[k];
      a.buffers[i].lanes[k] += b.buffers[i].lanes[k];
      a.buffers[i].bytes[k] += b.buffers[i].bytes[k];
      a.buffers[i].sectors[k] += b.buffers[i].sectors[k];
    }
  m->workers.erase(std::find(m->workers.begin(), m->workers.end(), s));
  delete s;
  t_state = nullptr;
}

void end(Model* m) {
  for (size_t i = 0; i < m->footprint.size() && i < size_t(tsm_check::kTrafficMaxBuffers); ++i) {
    uint64_t n = 0;
    for (const auto& w : m->footprint[i]) n += uint64_t(__builtin_popcountll(w.load(std::memory_order_relaxed)));
    m->total.buffers[i].footprint_sectors = n;
  }
  for (WorkerState* s : m->workers) delete s;  // workers that failed before detaching
  std::memcpy(m->out, &m->total, sizeof m->total);
  delete m;
}

}  // namespace tsm_traffic
