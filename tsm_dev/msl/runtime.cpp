// Runtime of the MSL-on-CPU executor: runs a dispatchThreads-style grid of one kernel entry point.
//
// - Threadgroups are distributed over a few OS worker threads (so device memory sees real concurrency and
//   device atomics must be real atomics), in an order shuffled by the dispatch's seed; each threadgroup runs
//   entirely on one worker.
// - The lanes of a threadgroup are fibers on that worker (hand-written context switch on x86-64, ucontext
//   elsewhere). A lane runs until it reaches a collective point (threadgroup_barrier, a SIMD-group function)
//   or returns; the scheduler then runs the next runnable lane. Lanes run in an order freshly shuffled for
//   every threadgroup of every dispatch and again after every collective release, so intra-group races that a
//   fixed order would hide show up.
// - A barrier is released when every lane of the threadgroup waits at it, at the same call (the call stack of
//   threadgroup_barrier identifies it, so that a barrier in each arm of a divergent if/else is an error); a
//   lane that returns while others wait (or will wait) at a barrier is an error, as is a state where no
//   release is possible (deadlock).
//   A SIMD-group collective is released when every live lane of the SIMD-group (32 consecutive lanes)
//   waits at a collective of the same kind; lanes that returned no longer take part.
// - Memory accesses of kernel code are checked by checker.cpp (bounds, races, watchdog); the scheduler keeps
//   its LaneState current and counts barrier intervals.
// Errors are reported through the `error` buffer of tsm_dispatch; the Python driver raises them.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "checker.h"
#include "tsm_abi.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

namespace {

constexpr size_t kStackBytes = 256 * 1024;  // per lane; kernels are small, pages are committed lazily

// ------------------------------------------------------------------------------------------ contexts
#if defined(__x86_64__)
extern "C" void tsm_switch_context(void** save_sp, void* load_sp);
asm(R"(
.text
.p2align 4
.globl tsm_switch_context
.hidden tsm_switch_context
.type tsm_switch_context,@function
tsm_switch_context:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size tsm_switch_context, .-tsm_switch_context
.section .note.GNU-stack,"",@progbits
.text
)");

struct Context {
  void* sp = nullptr;
};
inline void switch_to(Context* from, Context* to) { tsm_switch_context(&from->sp, to->sp); }
void make_context(Context* c, char* stack, size_t size, void (*fn)()) {
  uintptr_t top = (reinterpret_cast<uintptr_t>(stack) + size) & ~uintptr_t(15);
  uint64_t* sp = reinterpret_cast<uint64_t*>(top);
  *--sp = 0;                                 // fake return address of fn (it never returns)
  *--sp = reinterpret_cast<uint64_t>(fn);    // popped by `ret`; then rsp % 16 == 8 as after a call
  for (int i = 0; i < 6; ++i) *--sp = 0;     // rbp rbx r12 r13 r14 r15
  uint32_t mxcsr;
  uint16_t fpucw;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpucw));
  *--sp = uint64_t(mxcsr) | (uint64_t(fpucw) << 32);
  c->sp = sp;
}
#else
struct Context {
  ucontext_t uc;
};
inline void switch_to(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }
void make_context(Context* c, char* stack, size_t size, void (*fn)()) {
  getcontext(&c->uc);
  c->uc.uc_stack.ss_sp = stack;
  c->uc.uc_stack.ss_size = size;
  c->uc.uc_link = nullptr;
  makecontext(&c->uc, fn, 0);
}
#endif

// --------------------------------------------------------------------------------------- stack pool
std::mutex g_stack_mutex;
std::vector<char*> g_free_stacks;
size_t g_page = 4096;

char* take_stack() {
  {
    std::lock_guard<std::mutex> lock(g_stack_mutex);
    if (!g_free_stacks.empty()) {
      char* s = g_free_stacks.back();
      g_free_stacks.pop_back();
      return s;
    }
  }
  void* p = mmap(nullptr, kStackBytes + g_page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (p == MAP_FAILED) return nullptr;
  mprotect(p, g_page, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting memory
  return static_cast<char*>(p) + g_page;
}
void give_stacks(std::vector<char*>& stacks) {
  std::lock_guard<std::mutex> lock(g_stack_mutex);
  for (char* s : stacks) g_free_stacks.push_back(s);
  stacks.clear();
}

// --------------------------------------------------------------------------------------- scheduling
enum class State { Runnable, AtBarrier, AtSimd, Done, Failed };

struct Lane {
  Context ctx;
  tsm_ids ids;
  State state = State::Runnable;
  uint64_t barrier_site = 0;  // the call stack of the barrier this lane waits at, hashed
  unsigned barrier_flags = 0;
  int simd_kind = 0;
  unsigned simd_count = 0;
};

struct Dispatch;

struct Group {
  Dispatch* dispatch = nullptr;
  std::vector<Lane> lanes;
  std::vector<char*> stacks;
  // [simdgroup][parity][lane] values, and the lanes released in each exchange.
  std::vector<unsigned long long> simd_slots;
  std::vector<unsigned> simd_masks;
  Context scheduler;
  unsigned current = 0;
  std::string error;
  std::mt19937_64 rng;
  tsm_check::LaneState check;
};

struct Dispatch {
  tsm_entry_fn entry;
  void* const* buffers;
  unsigned grid[3];
  unsigned group[3];
  unsigned ngroups[3];
  uint64_t seed;
  std::vector<uint32_t> order;  // group visiting order
  tsm_check::Memory* memory = nullptr;
  std::atomic<uint64_t> next_group{0};
  std::atomic<bool> failed{false};
  std::mutex error_mutex;
  std::string error;
};

thread_local Group* t_group = nullptr;

void lane_main() {
  Group* g = t_group;
  Lane& lane = g->lanes[g->current];
  g->dispatch->entry(g->dispatch->buffers, &lane.ids);
  lane.state = State::Done;
  switch_to(&lane.ctx, &g->scheduler);
  __builtin_trap();  // a finished lane is never resumed
}

void yield_to_scheduler() {
  Group* g = t_group;
  switch_to(&g->lanes[g->current].ctx, &g->scheduler);
}

std::string lane_list(const Group& g, State s) {
  std::string out;
  int shown = 0;
  for (size_t i = 0; i < g.lanes.size(); ++i) {
    if (g.lanes[i].state != s) continue;
    if (shown++ == 8) {
      out += ", ...";
      break;
    }
    if (!out.empty()) out += ", ";
    out += std::to_string(i);
  }
  return out.empty() ? "none" : out;
}

// Releases whatever can be released; returns false with g.error set when nothing can (a deadlock or a
// barrier some lanes skipped).
bool release(Group& g) {
  const unsigned n = unsigned(g.lanes.size());
  const unsigned nsg = (n + TSM_SIMD_WIDTH - 1) / TSM_SIMD_WIDTH;
  bool released = false;
  for (unsigned sg = 0; sg < nsg; ++sg) {
    unsigned lo = sg * TSM_SIMD_WIDTH, hi = std::min(n, lo + TSM_SIMD_WIDTH);
    bool all_at_simd = true, any_live = false;
    for (unsigned i = lo; i < hi; ++i) {
      if (g.lanes[i].state == State::Done) continue;
      any_live = true;
      if (g.lanes[i].state != State::AtSimd) all_at_simd = false;
    }
    if (!any_live || !all_at_simd) continue;
    unsigned mask = 0;
    int kind = -1;
    unsigned count = 0;
    for (unsigned i = lo; i < hi; ++i) {
      Lane& l = g.lanes[i];
      if (l.state != State::AtSimd) continue;
      if (kind == -1) {
        kind = l.simd_kind;
        count = l.simd_count;
      } else if (l.simd_kind != kind || l.simd_count != count) {
        g.error = "SIMD-group " + std::to_string(sg) + ": lanes wait at different SIMD-group functions "
                  "(divergent control flow around a collective): lane " + std::to_string(lo) + ".." +
                  std::to_string(hi - 1) + " disagree";
        return false;
      }
      mask |= 1u << (i - lo);
    }
    g.simd_masks[sg * 2 + ((count - 1) & 1u)] = mask;
    for (unsigned i = lo; i < hi; ++i)
      if (g.lanes[i].state == State::AtSimd) g.lanes[i].state = State::Runnable;
    released = true;
  }
  if (released) return true;
  bool any_barrier = false, all_barrier = true, any_done = false;
  for (const Lane& l : g.lanes) {
    if (l.state == State::Done) {
      any_done = true;
      continue;
    }
    if (l.state == State::AtBarrier) any_barrier = true;
    else all_barrier = false;
  }
  if (any_barrier && all_barrier) {
    if (any_done) {
      g.error = "threadgroup_barrier not reached by every lane: lanes " + lane_list(g, State::AtBarrier) +
                " wait at it but lanes " + lane_list(g, State::Done) + " returned without reaching it";
      return false;
    }
    const Lane& first = g.lanes[0];
    for (size_t i = 1; i < g.lanes.size(); ++i) {
      const Lane& l = g.lanes[i];
      if (l.barrier_site == first.barrier_site && l.barrier_flags == first.barrier_flags) continue;
      std::string same, other;
      int shown_same = 0, shown_other = 0;
      for (size_t j = 0; j < g.lanes.size(); ++j) {
        const bool at_first = g.lanes[j].barrier_site == first.barrier_site &&
                              g.lanes[j].barrier_flags == first.barrier_flags;
        std::string& list = at_first ? same : other;
        int& shown = at_first ? shown_same : shown_other;
        if (shown == 8) list += ", ...";
        if (shown++ >= 8) continue;
        list += (list.empty() ? "" : ", ") + std::to_string(j);
      }
      g.error = "threadgroup_barrier in divergent control flow: lanes " + same + " wait at one barrier and lanes " +
                other + " at another (every lane of a threadgroup must reach the same barrier call, with the "
                "same mem_flags)";
      return false;
    }
    ++g.check.barriers;
    if (first.barrier_flags & 1u) ++g.check.epoch_dev;
    if (first.barrier_flags & 2u) ++g.check.epoch_tg;
    for (Lane& l : g.lanes) l.state = State::Runnable;
    return true;
  }
  g.error = "deadlock: lanes " + lane_list(g, State::AtBarrier) + " wait at threadgroup_barrier, lanes " +
            lane_list(g, State::AtSimd) + " at a SIMD-group function, and no collective can complete "
            "(a barrier or SIMD-group function inside divergent control flow?)";
  return false;
}

bool run_group(Group& g, Dispatch& d, uint64_t linear_group) {
  unsigned gid[3] = {unsigned(linear_group % d.ngroups[0]), unsigned(linear_group / d.ngroups[0] % d.ngroups[1]),
                     unsigned(linear_group / (uint64_t(d.ngroups[0]) * d.ngroups[1]))};
  unsigned size[3];
  for (int k = 0; k < 3; ++k) size[k] = std::min(d.group[k], d.grid[k] - gid[k] * d.group[k]);
  const unsigned n = size[0] * size[1] * size[2];
  const unsigned nsg = (n + TSM_SIMD_WIDTH - 1) / TSM_SIMD_WIDTH;
  g.lanes.assign(n, Lane());
  g.simd_slots.assign(size_t(nsg) * 2 * TSM_SIMD_WIDTH, 0);
  g.simd_masks.assign(size_t(nsg) * 2, 0);
  g.error.clear();
  g.rng.seed(d.seed * 0x9E3779B97F4A7C15ull + linear_group);
  g.check.group = unsigned(linear_group);
  g.check.epoch_tg = g.check.epoch_dev = g.check.barriers = 0;
  g.check.threads = n;
  g.check.stack_bytes = kStackBytes;
  tsm_check::begin_group();
  while (g.stacks.size() < n) {
    char* s = take_stack();
    if (!s) {
      g.error = "out of memory for lane stacks";
      return false;
    }
    g.stacks.push_back(s);
  }
  for (unsigned i = 0; i < n; ++i) {
    tsm_ids& id = g.lanes[i].ids;
    unsigned t[3] = {i % size[0], i / size[0] % size[1], i / (size[0] * size[1])};
    for (int k = 0; k < 3; ++k) {
      id.thread_position_in_grid[k] = gid[k] * d.group[k] + t[k];
      id.thread_position_in_threadgroup[k] = t[k];
      id.threadgroup_position_in_grid[k] = gid[k];
      id.threads_per_threadgroup[k] = size[k];
      id.dispatch_threads_per_threadgroup[k] = d.group[k];
      id.threads_per_grid[k] = d.grid[k];
      id.threadgroups_per_grid[k] = d.ngroups[k];
    }
    id.thread_index_in_threadgroup = i;
    id.thread_index_in_simdgroup = i % TSM_SIMD_WIDTH;
    id.simdgroup_index_in_threadgroup = i / TSM_SIMD_WIDTH;
    id.simdgroups_per_threadgroup = nsg;
    id.threads_per_simdgroup = TSM_SIMD_WIDTH;
    make_context(&g.lanes[i].ctx, g.stacks[i], kStackBytes, lane_main);
  }
  std::vector<unsigned> order(n);
  for (unsigned i = 0; i < n; ++i) order[i] = i;
  unsigned done = 0;
  while (true) {
    std::shuffle(order.begin(), order.end(), g.rng);
    for (unsigned i : order) {
      if (g.lanes[i].state != State::Runnable) continue;
      g.current = i;
      g.check.lane = i;
      g.check.stack_lo = reinterpret_cast<uintptr_t>(g.stacks[i]);
      switch_to(&g.scheduler, &g.lanes[i].ctx);
      if (g.lanes[i].state == State::Failed) return false;
      if (g.lanes[i].state == State::Done) ++done;
    }
    if (done == n) {
      tsm_check::end_group();
      return true;
    }
    if (!release(g)) return false;
  }
}

void worker(Dispatch* d) {
  Group g;
  g.dispatch = d;
  t_group = &g;
  tsm_check::attach_worker(d->memory, &g.check);
  const uint64_t total = d->order.size();
  while (!d->failed.load()) {
    uint64_t k = d->next_group.fetch_add(1);
    if (k >= total) break;
    const uint64_t linear = d->order[k];
    if (!run_group(g, *d, linear)) {
      std::lock_guard<std::mutex> lock(d->error_mutex);
      if (!d->failed.exchange(true)) {
        const unsigned* n = d->ngroups;
        d->error = "threadgroup (" + std::to_string(linear % n[0]) + ", " + std::to_string(linear / n[0] % n[1]) +
                   ", " + std::to_string(linear / (uint64_t(n[0]) * n[1])) + "): " + g.error;
        tsm_check::abort_dispatch(d->memory);
      }
      break;
    }
  }
  tsm_check::detach_worker();
  t_group = nullptr;
  give_stacks(g.stacks);  // abandoned fibers of a failed group are simply dropped
}

}  // namespace

extern "C" {

void tsm_threadgroup_barrier(unsigned flags) {
  Group* g = t_group;
  Lane& l = g->lanes[g->current];
  // Hash of the return addresses on the lane's stack (frame pointers: the kernels and this file keep them).
  const uintptr_t lo = reinterpret_cast<uintptr_t>(g->stacks[g->current]), hi = lo + kStackBytes;
  uint64_t site = 1469598103934665603ull;
  uintptr_t fp = reinterpret_cast<uintptr_t>(__builtin_frame_address(0));
  for (int depth = 0; depth < 64 && fp >= lo && fp + 16 <= hi && !(fp & 7); ++depth) {
    const uintptr_t* frame = reinterpret_cast<const uintptr_t*>(fp);
    site = (site ^ frame[1]) * 1099511628211ull;
    if (frame[0] <= fp) break;
    fp = frame[0];
  }
  l.barrier_site = site;
  l.barrier_flags = flags;
  l.state = State::AtBarrier;
  yield_to_scheduler();
}

const unsigned long long* tsm_simd_exchange(const void* value, unsigned size, int kind, unsigned* lane_out,
                                            unsigned* mask_out) {
  Group* g = t_group;
  Lane& l = g->lanes[g->current];
  const unsigned i = l.ids.thread_index_in_threadgroup;
  const unsigned sg = i / TSM_SIMD_WIDTH, lane = i % TSM_SIMD_WIDTH;
  const unsigned parity = l.simd_count & 1u;
  unsigned long long* slots = &g->simd_slots[(size_t(sg) * 2 + parity) * TSM_SIMD_WIDTH];
  slots[lane] = 0;
  std::memcpy(&slots[lane], value, size);
  l.simd_kind = kind;
  l.simd_count += 1;
  l.state = State::AtSimd;
  yield_to_scheduler();
  *lane_out = lane;
  *mask_out = g->simd_masks[sg * 2 + parity];
  return slots;
}

void tsm_fail(const char* message) {
  Group* g = t_group;
  g->error = message;
  g->lanes[g->current].state = State::Failed;
  yield_to_scheduler();
  __builtin_trap();
}

// Runs `entry` over a grid of grid[0] x grid[1] x grid[2] threads in groups of group[...] threads (the last
// group along each axis may be partial, as with Metal's dispatchThreads), with `args` bound as private,
// checked copies. Returns 0, or -1 with a message.
// `traffic`, when not null, receives the traffic model's counters of the dispatch.
int tsm_dispatch(tsm_entry_fn entry, const tsm_check::ArgSpec* args, int nargs, const unsigned* grid,
                 const unsigned* group, unsigned long long seed, int workers, double watchdog_s,
                 tsm_check::Traffic* traffic, char* error, int error_len) {
  g_page = size_t(sysconf(_SC_PAGESIZE));
  Dispatch d;
  d.entry = entry;
  d.seed = seed;
  uint64_t total = 1;
  for (int k = 0; k < 3; ++k) {
    d.grid[k] = grid[k];
    d.group[k] = group[k];
    d.ngroups[k] = (grid[k] + group[k] - 1) / group[k];
    total *= d.ngroups[k];
  }
  if (total > 0xFFFFFFFFull) {
    std::snprintf(error, size_t(error_len), "%llu threadgroups: more than the executor supports",
                  static_cast<unsigned long long>(total));
    return -1;
  }
  d.order.resize(total);
  for (uint64_t k = 0; k < total; ++k) d.order[k] = uint32_t(k);
  std::mt19937_64 rng(seed ^ 0x5DEECE66Dull);
  std::shuffle(d.order.begin(), d.order.end(), rng);
  std::vector<void*> table(size_t(std::max(nargs, 1)), nullptr);
  std::string bind_error;
  d.memory = tsm_check::begin_dispatch(args, nargs, table.data(), d.ngroups, watchdog_s, traffic, &bind_error);
  if (!d.memory) {
    std::snprintf(error, size_t(error_len), "%s", bind_error.c_str());
    return -1;
  }
  d.buffers = table.data();
  int nw = int(std::max<uint64_t>(1, std::min<uint64_t>(uint64_t(std::max(workers, 1)), total)));
  if (nw == 1) {
    worker(&d);
  } else {
    std::vector<std::thread> threads;
    for (int i = 0; i < nw; ++i) threads.emplace_back(worker, &d);
    for (auto& t : threads) t.join();
  }
  tsm_check::end_dispatch(d.memory);
  if (d.failed.load()) {
    std::snprintf(error, size_t(error_len), "%s", d.error.c_str());
    return -1;
  }
  return 0;
}

}  // extern "C"
