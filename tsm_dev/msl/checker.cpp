// Memory checker of the MSL-on-CPU executor: bounds, data races and the watchdog (see checker.h).
#include "checker.h"

#include <link.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>

#include "traffic.h"

namespace tsm_check {
namespace {

// --------------------------------------------------------------------------------------- shadow words
// Two 64-bit words per element: the last write, and the reads since. Each holds who (threadgroup, lane), when
// (barrier interval of that group) and whether the access was atomic. "Many" readers collapse to kMany*.
constexpr uint64_t kValid = 1ull << 63, kAtomic = 1ull << 62;
constexpr uint32_t kManyGroups = 0x3FFFFFFFu, kManyLanes = 0xFFFu, kEpochMask = 0xFFFFFu;

inline uint64_t pack(uint32_t group, uint32_t lane, uint32_t epoch, bool atomic) {
  return kValid | (atomic ? kAtomic : 0) | (uint64_t(group & kManyGroups) << 32) |
         (uint64_t(lane & kManyLanes) << 20) | (epoch & kEpochMask);
}
inline uint32_t group_of(uint64_t s) { return uint32_t(s >> 32) & kManyGroups; }
inline uint32_t lane_of(uint64_t s) { return uint32_t(s >> 20) & kManyLanes; }
inline uint32_t epoch_of(uint64_t s) { return uint32_t(s) & kEpochMask; }

// Two accesses conflict unless both are atomic, or the same lane made them, or a barrier that orders this
// memory separates them. Threadgroups are never ordered within a dispatch.
inline bool conflicts(uint64_t prev, uint64_t me) {
  if (!(prev & kValid) || (prev & me & kAtomic)) return false;
  if (group_of(prev) != group_of(me)) return true;
  return lane_of(prev) != lane_of(me) && epoch_of(prev) == epoch_of(me);
}

enum Kind { kRead = 0, kWrite = 1, kAtomicRead = 2, kAtomicWrite = 3 };


// Mappings reused across dispatches: a fresh one costs a page fault per page touched, in every dispatch, which
// made the shadow the checker's largest cost.
class Pool {
 public:
  // At least `bytes` (*got: how many), zeroed when `zero`.
  char* take(size_t bytes, bool zero, size_t* got) {
    bytes = (std::max<size_t>(bytes, 1) + 4095) & ~size_t(4095);
    char* p = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = free_.lower_bound(bytes);
      if (it != free_.end() && it->first <= 2 * bytes + (1 << 16)) {
        p = it->second;
        *got = it->first;
        held_ -= it->first;
        free_.erase(it);
      }
    }
    if (p) {
      if (zero) std::memset(p, 0, bytes);
      return p;
    }
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    *got = bytes;
    return m == MAP_FAILED ? nullptr : static_cast<char*>(m);
  }
  void give(char* p, size_t bytes) {
    if (!p) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (held_ + bytes <= kMaxHeld) {
        free_.emplace(bytes, p);
        held_ += bytes;
        return;
      }
    }
    munmap(p, bytes);
  }

 private:
  static constexpr size_t kMaxHeld = size_t(512) << 20;
  std::mutex mutex_;
  std::multimap<size_t, char*> free_;
  size_t held_ = 0;
};
Pool& pool() {
  static Pool* p = new Pool;  // never destroyed: workers may still return memory at exit
  return *p;
}

struct Region {
  uintptr_t lo = 0, hi = 0;  // the bytes a kernel may touch
  uint32_t elem = 1;         // element size (indices in messages)
  uint32_t shift = 0;        // log2 of the shadow granule: the element size when it is a power of two
  bool threadgroup = false;
  bool tracked = true;      // false: a read-only argument, only bounds-checked
  uint64_t* shadow = nullptr;
  size_t shadow_bytes = 0;  // as mapped
  std::string label;
  void release() {
    pool().give(reinterpret_cast<char*>(shadow), shadow_bytes);
    shadow = nullptr;
  }
};

// Red zone on each side of a private copy: an overshoot up to the buffer's own size (at least 4 KiB) is
// attributed to the buffer it came from.
size_t red_zone(size_t bytes) { return (std::max<size_t>(4096, std::min<size_t>(bytes, 1 << 24)) + 63) & ~size_t(63); }

bool init_region(Region& r, uintptr_t lo, size_t bytes, uint32_t elem, bool threadgroup, bool tracked,
                 std::string label) {
  r.lo = lo;
  r.hi = lo + bytes;
  r.elem = elem ? elem : 1;
  r.shift = (r.elem & (r.elem - 1)) == 0 ? unsigned(__builtin_ctz(r.elem)) : 0;
  r.threadgroup = threadgroup;
  r.tracked = tracked;
  r.label = std::move(label);
  if (!tracked) return true;
  r.shadow = reinterpret_cast<uint64_t*>(pool().take(((bytes >> r.shift) + 1) * 16, true, &r.shadow_bytes));
  return r.shadow != nullptr;
}

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// The loaded image of this library: kernels may read their own constant tables.
struct Image {
  std::vector<std::pair<uintptr_t, uintptr_t>> segments;
};
int find_image(dl_phdr_info* info, size_t, void* data) {
  auto* img = static_cast<Image*>(data);
  const uintptr_t me = reinterpret_cast<uintptr_t>(&find_image);
  std::vector<std::pair<uintptr_t, uintptr_t>> segs;
  bool mine = false;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_LOAD) continue;
    uintptr_t lo = info->dlpi_addr + ph.p_vaddr, hi = lo + ph.p_memsz;
    segs.emplace_back(lo, hi);
    if (me >= lo && me < hi) mine = true;
  }
  if (!mine) return 0;
  img->segments = segs;
  return 1;
}
const Image& image() {
  static Image img;
  static std::once_flag once;
  std::call_once(once, [] { dl_iterate_phdr(find_image, &img); });
  return img;
}

}  // namespace

struct Memory {
  struct Block {
    char* host;
    char* map;
    size_t map_bytes;
    char* copy;
    size_t bytes;
    uint32_t flags;
  };
  std::vector<Block> blocks;
  std::vector<Region> regions;
  unsigned ngroups[3];
  int64_t deadline_ns;
  double watchdog_s;
  std::atomic<bool> aborted{false};
  tsm_traffic::Model* model = nullptr;  // the traffic model, when asked for
  ~Memory() {
    for (Block& b : blocks) pool().give(b.map, b.map_bytes);
    for (Region& r : regions) r.release();
  }
};

namespace {

struct Worker {
  Memory* m = nullptr;
  LaneState* lane = nullptr;
  std::vector<Region> tg;           // threadgroup arrays, by declaration id
  std::vector<char*> tg_maps;
  std::vector<size_t> tg_map_bytes;
  uint64_t ticks = 0;
  Region* last = nullptr;  // where the previous access went
  tsm_traffic::Model* model = nullptr;
  void release_tg() {
    last = nullptr;
    for (size_t i = 0; i < tg.size(); ++i) {
      tg[i].release();
      pool().give(tg_maps[i], tg_map_bytes[i]);
    }
    tg.clear();
    tg_maps.clear();
    tg_map_bytes.clear();
  }
};

// One pointer, initial-exec: the hooks run on every access of kernel code. The Worker itself lives on the heap:
// every compiled library carries its own copy of this file, and a library with initial-exec TLS takes its whole
// TLS from the process's small static reserve (a large one there fails to load after a few dozen libraries).
__attribute__((tls_model("initial-exec"))) thread_local Worker* t_worker = nullptr;

std::string who(const Worker& w, uint32_t group, uint32_t lane) {
  if (group == kManyGroups) return "several threadgroups";
  if (group != w.lane->group) {
    const unsigned* n = w.m->ngroups;
    return "threadgroup (" + std::to_string(group % n[0]) + ", " + std::to_string(group / n[0] % n[1]) + ", " +
           std::to_string(group / (uint64_t(n[0]) * n[1])) + ")";
  }
  if (lane == kManyLanes) return "several threads of this threadgroup";
  return "thread " + std::to_string(lane) + " of this threadgroup";
}

const char* verb(int kind) {
  switch (kind) {
    case kRead: return "loads";
    case kWrite: return "stores to";
    case kAtomicRead: return "atomically loads";
    default: return "atomically updates";
  }
}

[[noreturn]] void fail(const Worker& w, const std::string& what) {
  std::string msg = "thread " + std::to_string(w.lane->lane) + " (thread_index_in_threadgroup) " + what;
  tsm_fail(msg.c_str());
  __builtin_trap();
}

int64_t index_of(const Region& r, uintptr_t a) {
  const int64_t off = int64_t(a) - int64_t(r.lo);
  return off >= 0 ? off / r.elem : -((-off + r.elem - 1) / r.elem);
}

[[noreturn]] void race(const Worker& w, const Region& r, uintptr_t a, int kind, uint64_t prev, bool prev_write) {
  std::string prev_who = who(w, group_of(prev), lane_of(prev));
  std::string prev_verb = std::string(prev & kAtomic ? "atomically " : "") + (prev_write ? "stored to" : "loaded");
  std::string why = group_of(prev) != w.lane->group
                        ? "in the same dispatch (threadgroups run in no fixed order: use atomics, or give each "
                          "element one owning threadgroup)"
                        : std::string("in the same barrier interval (no threadgroup_barrier(") +
                              (r.threadgroup ? "mem_flags::mem_threadgroup" : "mem_flags::mem_device") +
                              ") between them)";
  fail(w, std::string(verb(kind)) + " " + r.label + " at index " + std::to_string(index_of(r, a)) +
              ": data race, " + prev_who + " " + prev_verb + " it " + why);
}

void track(Worker& w, Region& r, uintptr_t a, size_t n, int kind) {
  if (!r.tracked) {
    if (kind & kWrite) fail(w, std::string(verb(kind)) + " " + r.label + ", which the kernel declares read-only");
    return;
  }
  const LaneState& l = *w.lane;
  const uint64_t me = pack(l.group, l.lane, r.threadgroup ? l.epoch_tg : l.epoch_dev, kind & 2);
  const size_t g0 = (a - r.lo) >> r.shift, g1 = (a + n - 1 - r.lo) >> r.shift;
  for (size_t gi = g0; gi <= g1; ++gi) {
    uint64_t* s = r.shadow + 2 * gi;
    const uint64_t last_write = __atomic_load_n(s, __ATOMIC_RELAXED);
    const uint64_t reads = __atomic_load_n(s + 1, __ATOMIC_RELAXED);
    const uintptr_t at = r.lo + (gi << r.shift);
    if (conflicts(last_write, me)) race(w, r, at, kind, last_write, true);
    if (kind & kWrite) {
      if (conflicts(reads, me)) race(w, r, at, kind, reads, false);
      if (last_write != me) __atomic_store_n(s, me, __ATOMIC_RELAXED);
      continue;
    }
    if (r.threadgroup && !(last_write & kValid)) {
      fail(w, std::string(verb(kind)) + " " + r.label + " at index " + std::to_string(index_of(r, at)) +
                  ", which no thread of this threadgroup has stored to yet (threadgroup memory starts undefined: "
                  "a missing threadgroup_barrier, or an element never written)");
    }
    uint64_t merged = me;
    if (reads & kValid) {  // several readers: remember "many" rather than one, so that a later write conflicts
      const bool same_group = group_of(reads) == l.group;
      const bool same_interval = same_group && epoch_of(reads) == epoch_of(me);
      const uint32_t lane = same_interval && lane_of(reads) != l.lane ? kManyLanes : l.lane;
      const bool atomic = (same_interval || !same_group) ? (reads & me & kAtomic) : (me & kAtomic);
      merged = pack(same_group ? l.group : kManyGroups, lane, epoch_of(me), atomic);
    }
    if (merged != reads) __atomic_store_n(s + 1, merged, __ATOMIC_RELAXED);
  }
}

[[noreturn]] void out_of_bounds(Worker& w, uintptr_t a, size_t n, int kind) {
  const Region* best = nullptr;
  uintptr_t best_dist = ~uintptr_t(0);
  auto consider = [&](const Region& r) {
    const uintptr_t dist = a < r.lo ? r.lo - a : (a + n > r.hi ? (a >= r.hi ? a - r.hi : 0) : 0);
    const uintptr_t limit = red_zone(r.hi - r.lo);
    if (dist <= limit && dist < best_dist) {
      best = &r;
      best_dist = dist;
    }
  };
  for (const Region& r : w.m->regions) consider(r);
  for (const Region& r : w.tg)
    if (r.shadow) consider(r);
  const std::string size = n == 1 ? "1 byte" : std::to_string(n) + " bytes";
  if (!best) {
    char addr[32];
    std::snprintf(addr, sizeof addr, "%#lx", static_cast<unsigned long>(a));
    fail(w, std::string(verb(kind)) + " " + size + " at address " + addr +
                ", outside every argument, threadgroup array and the thread's own stack");
  }
  const uint64_t count = (best->hi - best->lo) / best->elem;
  fail(w, std::string(verb(kind)) + " " + best->label + " at index " + std::to_string(index_of(*best, a)) +
              " (" + size + "): out of bounds, it has " + std::to_string(count) +
              (count == 1 ? " element" : " elements"));
}

[[noreturn]] void watchdog(const Worker& w) {
  char limit[32];
  std::snprintf(limit, sizeof limit, "%g", w.m->watchdog_s);
  fail(w, std::string("was still running when the dispatch's time budget of ") + limit +
              " s ran out (watchdog): a hang, e.g. a spin-wait on a value that another thread or threadgroup "
              "should change; Metal guarantees no forward progress to a lane or threadgroup waiting on another");
}

void tick(Worker& w) {
  if (w.m->aborted.load(std::memory_order_relaxed)) fail(w, "stopped: another threadgroup failed");
  if (now_ns() > w.m->deadline_ns) watchdog(w);
}

// Hands an access to the traffic model: argument index, or -1 - id for a threadgroup array.
void model_access(Worker& w, const Region& r, uintptr_t a, size_t n, int kind, uintptr_t site) {
  const std::vector<Region>& args = w.m->regions;
  const int buffer = &r >= args.data() && &r < args.data() + args.size() ? int(&r - args.data())
                                                                          : -1 - int(&r - w.tg.data());
  tsm_traffic::access(w.model, *w.lane, buffer, a - r.lo, uint32_t(n), kind, site);
}

void slow_access(Worker& w, uintptr_t a, size_t n, int kind, uintptr_t site) {
  if ((++w.ticks & 0xFFF) == 0) tick(w);
  Region* r = w.last && a >= w.last->lo && a + n <= w.last->hi ? w.last : nullptr;
  for (std::vector<Region>* list : {&w.m->regions, &w.tg}) {
    for (size_t i = 0; !r && i < list->size(); ++i) {
      if (a >= (*list)[i].lo && a + n <= (*list)[i].hi) r = w.last = &(*list)[i];
    }
  }
  if (r) {
    if (__builtin_expect(w.model != nullptr, 0)) model_access(w, *r, a, n, kind, site);
    return track(w, *r, a, n, kind);
  }
  if (!(kind & kWrite)) {
    for (const auto& seg : image().segments)
      if (a >= seg.first && a + n <= seg.second) return;
  }
  out_of_bounds(w, a, n, kind);
}

// `site`: the return address into kernel code, i.e. which instruction made the access (the traffic model).
inline void on_access(const volatile void* p, size_t n, int kind, void* site) {
  Worker* w = t_worker;
  if (__builtin_expect(w == nullptr, 0)) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  if (a - w->lane->stack_lo < w->lane->stack_bytes) {  // the lane's locals
    if ((++w->ticks & 0xFFFF) == 0) tick(*w);
    return;
  }
  slow_access(*w, a, n, kind, reinterpret_cast<uintptr_t>(site));
}

}  // namespace

Memory* begin_dispatch(const ArgSpec* args, int nargs, void** table, const unsigned* ngroups, double watchdog_s,
                       Traffic* traffic, std::string* error) {
  Memory* m = new Memory;
  for (int k = 0; k < 3; ++k) m->ngroups[k] = ngroups[k];
  m->watchdog_s = watchdog_s;
  m->deadline_ns = now_ns() + int64_t(watchdog_s * 1e9);
  // Arguments that overlap in host memory (views of one tensor) share one private copy, as they share memory.
  std::vector<int> order(static_cast<size_t>(nargs));
  for (int i = 0; i < nargs; ++i) order[size_t(i)] = i;
  std::sort(order.begin(), order.end(), [&](int x, int y) {
    return reinterpret_cast<uintptr_t>(args[x].data) < reinterpret_cast<uintptr_t>(args[y].data);
  });
  std::vector<int> block_of(static_cast<size_t>(nargs), -1);
  for (int i : order) {
    const ArgSpec& a = args[i];
    char* host = static_cast<char*>(a.data);
    if (a.bytes && !m->blocks.empty()) {
      Memory::Block& b = m->blocks.back();
      if (b.host && b.bytes && host < b.host + b.bytes) {
        b.bytes = std::max<size_t>(b.bytes, size_t(host - b.host) + a.bytes);
        b.flags |= a.flags;
        block_of[size_t(i)] = int(m->blocks.size()) - 1;
        continue;
      }
    }
    m->blocks.push_back({a.bytes ? host : nullptr, nullptr, 0, nullptr, size_t(a.bytes), a.flags});
    block_of[size_t(i)] = int(m->blocks.size()) - 1;
  }
  for (Memory::Block& b : m->blocks) {
    const size_t rz = red_zone(b.bytes), align = reinterpret_cast<uintptr_t>(b.host) & 63;
    b.map = pool().take(rz + align + b.bytes + rz, false, &b.map_bytes);
    if (!b.map) {
      *error = "out of memory for the private copies of the arguments";
      delete m;
      return nullptr;
    }
    b.copy = b.map + rz + align;
    if (b.bytes) std::memcpy(b.copy, b.host, b.bytes);
  }
  m->regions.resize(size_t(nargs));
  for (int i = 0; i < nargs; ++i) {
    const Memory::Block& b = m->blocks[size_t(block_of[size_t(i)])];
    char* p = args[i].bytes ? b.copy + (static_cast<char*>(args[i].data) - b.host) : b.copy;
    table[i] = p;
    // Aliases of written memory are tracked too: a read through a const view races with a write through another.
    if (!init_region(m->regions[size_t(i)], reinterpret_cast<uintptr_t>(p), size_t(args[i].bytes), args[i].elem,
                     false, (b.flags & kWritable) != 0, args[i].label)) {
      *error = "out of memory for the shadow of the arguments";
      delete m;
      return nullptr;
    }
  }
  if (traffic) {
    std::vector<tsm_traffic::Buffer> buffers;
    for (int i = 0; i < nargs; ++i)
      buffers.push_back({args[i].bytes, args[i].view_offset, (args[i].flags & kScalar) != 0});
    m->model = tsm_traffic::begin(traffic, buffers.data(), nargs);
  }
  return m;
}

void end_dispatch(Memory* m) {
  if (m->model) tsm_traffic::end(m->model);
  for (const Memory::Block& b : m->blocks)
    if ((b.flags & kCopyBack) && (b.flags & kWritable) && b.bytes) std::memcpy(b.host, b.copy, b.bytes);
  delete m;
}

void attach_worker(Memory* m, LaneState* lane) {
  Worker& w = *new Worker();
  w.m = m;
  w.lane = lane;
  w.ticks = 0;
  w.model = m->model;
  t_worker = &w;
}

void detach_worker() {
  Worker* w = t_worker;
  if (!w) return;
  if (w->model) tsm_traffic::detach(w->model);
  w->release_tg();
  t_worker = nullptr;
  delete w;
}

void begin_group() {
  Worker& w = *t_worker;
  for (Region& r : w.tg)
    if (r.shadow) std::memset(r.shadow, 0, ((r.hi - r.lo) >> r.shift) * 16 + 16);
  if (w.model) tsm_traffic::begin_group(w.model);
}

void end_group() {
  Worker& w = *t_worker;
  if (w.model) tsm_traffic::end_group(w.model, *w.lane);
}

void abort_dispatch(Memory* m) { m->aborted.store(true); }

}  // namespace tsm_check

using tsm_check::on_access;
#define TSM_SITE __builtin_return_address(0)

extern "C" {

// Threadgroup storage of declaration `id` for the running threadgroup, with red zones and its own shadow. The
// same memory serves every threadgroup that runs on this worker (each starts undefined).
void* tsm_threadgroup_storage(unsigned id, unsigned long bytes, unsigned long elem, const char* name) {
  tsm_check::Worker& w = *tsm_check::t_worker;
  if (id >= w.tg.size()) {
    w.last = nullptr;  // the resize moves the regions
    w.tg.resize(id + 1);
    w.tg_maps.resize(id + 1, nullptr);
    w.tg_map_bytes.resize(id + 1, 0);
  }
  tsm_check::Region& r = w.tg[id];
  if (!r.shadow) {
    const size_t rz = tsm_check::red_zone(bytes);
    size_t mapped = 0;
    char* map = tsm_check::pool().take(rz + bytes + rz, false, &mapped);
    if (!map || !tsm_check::init_region(r, reinterpret_cast<uintptr_t>(map + rz), bytes, unsigned(elem), true, true,
                                        std::string("threadgroup array '") + name + "'")) {
      tsm_fail("out of memory for threadgroup storage");
    }
    w.tg_maps[id] = map;
    w.tg_map_bytes[id] = mapped;
  }
  return reinterpret_cast<void*>(r.lo);
}

// ThreadSanitizer's instrumentation interface (what g++ -fsanitize=thread calls), implemented by the checker.
void __tsan_init(void) {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit(void) {}
void __tsan_vptr_update(void**, void*) {}
void __tsan_vptr_read(void**) {}
void __tsan_read_range(void* a, unsigned long n) {
  if (n) on_access(a, n, tsm_check::kRead, TSM_SITE);
}
void __tsan_write_range(void* a, unsigned long n) {
  if (n) on_access(a, n, tsm_check::kWrite, TSM_SITE);
}
#define TSM_PLAIN(N)                                                                             \
  void __tsan_read##N(void* a) { on_access(a, N, tsm_check::kRead, TSM_SITE); }                           \
  void __tsan_write##N(void* a) { on_access(a, N, tsm_check::kWrite, TSM_SITE); }                         \
  void __tsan_unaligned_read##N(void* a) { on_access(a, N, tsm_check::kRead, TSM_SITE); }                 \
  void __tsan_unaligned_write##N(void* a) { on_access(a, N, tsm_check::kWrite, TSM_SITE); }               \
  void __tsan_volatile_read##N(void* a) { on_access(a, N, tsm_check::kRead, TSM_SITE); }                  \
  void __tsan_volatile_write##N(void* a) { on_access(a, N, tsm_check::kWrite, TSM_SITE); }                \
  void __tsan_unaligned_volatile_read##N(void* a) { on_access(a, N, tsm_check::kRead, TSM_SITE); }        \
  void __tsan_unaligned_volatile_write##N(void* a) { on_access(a, N, tsm_check::kWrite, TSM_SITE); }
TSM_PLAIN(1)
TSM_PLAIN(2)
TSM_PLAIN(4)
TSM_PLAIN(8)
TSM_PLAIN(16)
#undef TSM_PLAIN

// Atomics: checked as atomic accesses, then done (sequentially consistent: stronger than any order asked).
#define TSM_RMW(T, N, OP)                                                                        \
  T __tsan_atomic##N##_##OP(volatile T* a, T v, int) {                                           \
    on_access(a, sizeof(T), tsm_check::kAtomicWrite, TSM_SITE);                                            \
    return __atomic_##OP(a, v, __ATOMIC_SEQ_CST);                                                \
  }
#define TSM_ATOMIC(T, N)                                                                         \
  T __tsan_atomic##N##_load(const volatile T* a, int) {                                          \
    on_access(a, sizeof(T), tsm_check::kAtomicRead, TSM_SITE);                                             \
    return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                 \
  }                                                                                              \
  void __tsan_atomic##N##_store(volatile T* a, T v, int) {                                       \
    on_access(a, sizeof(T), tsm_check::kAtomicWrite, TSM_SITE);                                            \
    __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                    \
  }                                                                                              \
  T __tsan_atomic##N##_exchange(volatile T* a, T v, int) {                                       \
    on_access(a, sizeof(T), tsm_check::kAtomicWrite, TSM_SITE);                                            \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                          \
  }                                                                                              \
  TSM_RMW(T, N, fetch_add) TSM_RMW(T, N, fetch_sub) TSM_RMW(T, N, fetch_and)                     \
  TSM_RMW(T, N, fetch_or) TSM_RMW(T, N, fetch_xor) TSM_RMW(T, N, fetch_nand)                     \
  int __tsan_atomic##N##_compare_exchange_strong(volatile T* a, T* c, T v, int, int) {           \
    on_access(a, sizeof(T), tsm_check::kAtomicWrite, TSM_SITE);                                            \
    return __atomic_compare_exchange_n(a, c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);      \
  }                                                                                              \
  int __tsan_atomic##N##_compare_exchange_weak(volatile T* a, T* c, T v, int, int) {             \
    on_access(a, sizeof(T), tsm_check::kAtomicWrite, TSM_SITE);                                            \
    return __atomic_compare_exchange_n(a, c, v, true, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);       \
  }                                                                                              \
  T __tsan_atomic##N##_compare_exchange_val(volatile T* a, T c, T v, int, int) {                 \
    on_access(a, sizeof(T), tsm_check::kAtomicWrite, TSM_SITE);                                            \
    __atomic_compare_exchange_n(a, &c, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);            \
    return c;                                                                                    \
  }
TSM_ATOMIC(char, 8)
TSM_ATOMIC(short, 16)
TSM_ATOMIC(int, 32)
TSM_ATOMIC(long, 64)
#undef TSM_ATOMIC
#undef TSM_RMW
// Called on every basic block of kernel code (-fsanitize-coverage=trace-pc): a loop that touches no memory
// still meets the watchdog.
void __sanitizer_cov_trace_pc(void) {
  tsm_check::Worker* w = tsm_check::t_worker;
  if (w && (++w->ticks & 0xFFFF) == 0) tsm_check::tick(*w);
}
// An atomic read-modify-write that the kernel code does without instrumented accesses (metal_compat.h's float
// add, a compare-and-swap loop that would otherwise look like a load and one or more CAS instructions).
void tsm_atomic_access(volatile void* a, unsigned long n) { on_access(a, n, tsm_check::kAtomicWrite, TSM_SITE); }
void __tsan_atomic_thread_fence(int) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
void __tsan_atomic_signal_fence(int) {}

}  // extern "C"
