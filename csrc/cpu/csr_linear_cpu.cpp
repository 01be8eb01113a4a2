// CPU backend of the csr_linear ops: the ATen glue of both ops (checks, then the layout of the weight through
// contract.h's run_layout) and each layout's task decomposition over threads (LayoutTasks: a specialisation per
// row of the layout table, so a layout without one fails the build). The per-task kernels are in
// csr_linear_kernels_impl.inc (unstructured) and vector_csr_linear_kernels_impl.inc (vector), compiled per
// instruction set.
//
// Layouts:
// - unstructured, weight [E]: activations are repacked once per call from [batch, features] into batch tiles,
//   feature-major inside a tile (see Tiled in csr_linear_kernels.h; the packing is inside every timing we report);
// - vector, weight [vectors, V]: no repacking. A vector's V values are contiguous in weight, and the V outputs it
//   feeds are contiguous in every row of y and grad_out, so the kernels read x, weight and grad_out as the ops
//   receive them and vectorise over the V lanes; x is gathered one scalar per (position, batch row).
//
// Precision: the kernels compute in the accumulate type of contract.h (float32 for float16 and bfloat16).
// 16-bit operands are widened once at the boundary (ATen's vectorised conversions, F16C / AVX-512 where the
// CPU has them), and results are rounded once to the storage type.
//
// Strategies: a layout's backward is a class with a member function per strategy of contract.h, called through
// run_strategy. fused_atomic's tasks own (source block, batch chunk): grad_x is written by its owner, and each
// task sums its chunk's share of the weight gradient in a private buffer, then adds it into the zero-filled
// grad_w atomically. There is at most one batch chunk per thread, so with <= 2 threads every element of grad_w
// receives at most two adds onto zero, which give the same bits in either order
// (torch_sparse_metal.strategy.deterministic).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../csr_linear_checks.h"
#include "csr_linear_kernels.h"
#include "vector_csr_linear_kernels.h"

namespace torch_sparse_metal::cpu {

// The backward's arguments, checked.
struct BackwardArgs {
  const at::Tensor &grad_out, &x, &weight, &row_ptr, &dst, &col_ptr, &src_by_dst, &perm;
};


namespace {

// Calls body(T{}) with T the kernels' type of x's dtype (its accumulate type: the kernels compute in it).
template <typename Body>
decltype(auto) dispatch_kernel_type(const at::Tensor& x, const char* op, Body&& body) {
  return dispatch_value_type(x.scalar_type(), op,
                             [&](auto types) { return body(typename decltype(types)::Acc{}); });
}


inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Relaxed atomic floating-point add by compare-and-swap on the bit pattern (C++17 has no atomic float add).
template <typename T>
inline void atomic_add(T* address, T value) {
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  static_assert(sizeof(T) == sizeof(Bits), "atomic_add supports float and double");
  auto* bits = reinterpret_cast<Bits*>(address);
  Bits expected = __atomic_load_n(bits, __ATOMIC_RELAXED);
  Bits desired;
  do {
    T current;
    std::memcpy(&current, &expected, sizeof(T));
    current += value;
    std::memcpy(&desired, &current, sizeof(T));
  } while (!__atomic_compare_exchange_n(bits, &expected, desired, /*weak=*/true, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED));
}

// Blocks of rows so that there are about 4 tasks per thread per batch chunk.
inline int64_t rows_per_block(int64_t rows, int64_t chunks) {
  const int64_t blocks = std::max<int64_t>(1, ceil_div(4 * at::get_num_threads(), chunks));
  return std::max<int64_t>(1, ceil_div(rows, blocks));
}

// Runs body(t, r0, r1) over every (batch tile t < tiles, block [r0, r1) of `rows` CSR rows) in parallel: the SpMMs,
// whose task owns its block's outputs in its tile.
template <typename Body>
void for_each_tile_and_block(int64_t tiles, int64_t rows, const Body& body) {
  const int64_t block = rows_per_block(rows, std::max<int64_t>(tiles, 1));
  const int64_t blocks = ceil_div(rows, block);
  at::parallel_for(0, tiles * blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t r0 = (task % blocks) * block;
      body(task / blocks, r0, std::min(rows, r0 + block));
    }
  });
}

using cpu::kTile;
using cpu::Tiled;

// -------------------------------------------------------------------------- the unstructured layout: weight [E]
// Tiled storage a kernel writes (poisoned under TORCH_SPARSE_METAL_POISON=1, see empty_output).
template <typename T>
at::Tensor tiled_output(int64_t tiles, int64_t features, const at::TensorOptions& options) {
  return empty_output({tiles, features, kTile<T>}, options.dtype(c10::CppTypeToScalarType<T>::value));
}

// Runs body(t, f0, f1) over every (batch tile, block of 256 features) in parallel: the layout conversions.
template <typename Body>
void for_each_tile_block(int64_t tiles, int64_t features, const Body& body) {
  constexpr int64_t kFeatures = 256;  // a multiple of the AVX2 kernels' 8-feature transposes
  const int64_t blocks = ceil_div(features, kFeatures);
  at::parallel_for(0, tiles * blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t f0 = (task % blocks) * kFeatures;
      body(task / blocks, f0, std::min(features, f0 + kFeatures));
    }
  });
}

// [batch, features] row-major -> Tiled, the tail tile zero-padded.
template <typename T>
Tiled<T> pack(const at::Tensor& m, int64_t tiles, at::Tensor& storage) {
  const at::Tensor rows = m.contiguous();
  const int64_t batch = rows.size(0), features = rows.size(1);
  storage = tiled_output<T>(tiles, features, rows.options());
  const Tiled<T> out{storage.data_ptr<T>(), features};
  const T* src = rows.data_ptr<T>();
  const auto& k = cpu::kernels<T>();
  for_each_tile_block(tiles, features, [&](int64_t t, int64_t f0, int64_t f1) {
    k.pack(src, features, batch, out, t, f0, f1);
  });
  return out;
}

// Tiled -> [batch, features] row-major.
template <typename T>
at::Tensor unpack(const at::Tensor& storage, int64_t batch) {
  const int64_t tiles = storage.size(0), features = storage.size(1);
  at::Tensor m = empty_output({batch, features}, storage.options());
  const Tiled<T> in{storage.data_ptr<T>(), features};
  T* dst = m.data_ptr<T>();
  const auto& k = cpu::kernels<T>();
  for_each_tile_block(tiles, features, [&](int64_t t, int64_t f0, int64_t f1) {
    k.unpack(in, t, f0, f1, dst, features, batch);
  });
  return m;
}

// y in the accumulate type T: the SpMM over outputs, a task owning (output block, batch tile).
template <typename T>
at::Tensor tiled_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& col_ptr,
                         const at::Tensor& src_by_dst, const at::Tensor& perm) {
  const at::ScalarType acc = c10::CppTypeToScalarType<T>::value;
  const int64_t batch = x.size(0), out_features = col_ptr.numel() - 1;
  const int64_t tiles = ceil_div(batch, kTile<T>);
  at::Tensor xs_storage, ys_storage = tiled_output<T>(tiles, out_features, x.options());
  const Tiled<T> xs = pack<T>(x.to(acc), tiles, xs_storage), ys{ys_storage.data_ptr<T>(), out_features};
  // One gather of the weights into by-destination order, instead of a random read per edge and tile.
  const at::Tensor w_by_dst = weight.index_select(0, perm).to(acc);
  const cpu::Problem<T> p{{col_ptr.data_ptr<int32_t>(), src_by_dst.data_ptr<int32_t>(), w_by_dst.data_ptr<T>()},
                          xs, {}, ys};
  const auto& k = cpu::kernels<T>();
  for_each_tile_and_block(tiles, out_features, [&](int64_t t, int64_t o0, int64_t o1) { k.spmm(p, t, o0, o1); });
  return unpack<T>(ys_storage, batch);
}

// The backward over batch tiles: x and grad_out packed once, grad_x written tiled by its owners.
template <typename T>
class TiledBackward {
 public:
  TiledBackward(const BackwardArgs& a, T* gw)
      : gw_(gw), batch_(a.x.size(0)), in_features_(a.x.size(1)), tiles_(ceil_div(batch_, kTile<T>)) {
    const at::ScalarType acc = c10::CppTypeToScalarType<T>::value;
    w_ = a.weight.to(acc).contiguous();  // the kernels read raw memory: a view is copied
    gx_storage_ = tiled_output<T>(tiles_, in_features_, a.x.options());
    const Tiled<T> xs = pack<T>(a.x.to(acc), tiles_, xs_storage_);
    const Tiled<T> g = pack<T>(a.grad_out.to(acc), tiles_, g_storage_);
    p_ = {{a.row_ptr.data_ptr<int32_t>(), a.dst.data_ptr<int32_t>(), w_.data_ptr<T>()}, g, xs,
          {gx_storage_.data_ptr<T>(), in_features_}};
  }

  // One pass. A task owns (source block, batch chunk): it writes its slice of grad_x alone, sums each edge's weight
  // gradient over its chunk in a private buffer, then adds that into grad_w atomically, because the tasks of the
  // other batch chunks add into the same edges at the same time.
  void fused_atomic() {
    if (tiles_ == 0) return;  // empty batch: grad_w stays zero
    const auto& k = cpu::kernels<T>();
    const int64_t chunks = std::min<int64_t>(tiles_, at::get_num_threads());
    const int64_t chunk = ceil_div(tiles_, chunks);
    const int64_t block = rows_per_block(in_features_, chunks);
    const int64_t blocks = ceil_div(in_features_, block);
    at::parallel_for(0, chunks * blocks, 1, [&](int64_t lo, int64_t hi) {
      std::vector<T> partial;
      for (int64_t task = lo; task < hi; ++task) {
        const int64_t c = task / blocks, s0 = (task % blocks) * block, s1 = std::min(in_features_, s0 + block);
        const int64_t e0 = p_.rows.ptr[s0];
        partial.assign(p_.rows.ptr[s1] - e0, T(0));
        k.spmm_sddmm_atomic(p_, c * chunk, std::min(tiles_, (c + 1) * chunk), s0, s1, partial.data());
        for (size_t i = 0; i < partial.size(); ++i) atomic_add(gw_ + e0 + i, partial[i]);
      }
    });
  }

  // Two passes with exclusive ownership and no atomics. Pass 1 (the SDDMM): a task owns a source block, hence its
  // edges, and writes their weight gradients once. Pass 2 (the SpMM over sources): a task owns (source block, batch
  // tile) of grad_x.
  void atomic_free() {
    const auto& k = cpu::kernels<T>();
    const int64_t block = rows_per_block(in_features_, 1);
    const int64_t blocks = ceil_div(in_features_, block);
    at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) k.sddmm(p_, tiles_, b * block, std::min(in_features_, (b + 1) * block), gw_);
    });
    for_each_tile_and_block(tiles_, in_features_, [&](int64_t t, int64_t s0, int64_t s1) { k.spmm(p_, t, s0, s1); });
  }

  at::Tensor grad_x() const { return unpack<T>(gx_storage_, batch_); }

 private:
  T* gw_;
  int64_t batch_, in_features_, tiles_;
  at::Tensor w_, xs_storage_, g_storage_, gx_storage_;
  cpu::Problem<T> p_;
};

// ---------------------------------------------------------------------- the vector layout: weight [vectors, V]
// Batch rows per task of the forward and of atomic_free's grad_x pass: a multiple of every register block, and
// few enough rows of x (forward) or grad_out (grad_x) that a task's rows stay in L2 while it walks its groups.
constexpr int64_t kBatchTile = 64;
// The unit of fused_atomic's batch chunks.
constexpr int64_t kChunkUnit = 16;

// Runs body(r0, r1, n0, n1) over every (block of `rows`, batch tile of kBatchTile rows) in parallel.
template <typename Body>
void for_each_block_and_tile(int64_t rows, int64_t batch, const Body& body) {
  for_each_tile_and_block(ceil_div(batch, kBatchTile), rows, [&](int64_t t, int64_t r0, int64_t r1) {
    body(r0, r1, t * kBatchTile, std::min(batch, (t + 1) * kBatchTile));
  });
}

// y in the accumulate type T: a task owns (group block, batch tile), walking groups (no by-source arrays).
template <typename T>
at::Tensor vector_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& col_ptr,
                          const at::Tensor& src_by_dst, const at::Tensor& perm) {
  const at::ScalarType acc = c10::CppTypeToScalarType<T>::value;
  const int64_t batch = x.size(0), groups = col_ptr.numel() - 1, block = weight.size(1);
  const at::Tensor xa = x.to(acc).contiguous(), wa = weight.to(acc).contiguous();
  at::Tensor ya = empty_output({batch, groups * block}, x.options().dtype(acc));
  const cpu::VectorProblem<T> p{nullptr,          nullptr,          col_ptr.data_ptr<int32_t>(),
                                src_by_dst.data_ptr<int32_t>(), perm.data_ptr<int32_t>(),
                                wa.data_ptr<T>(), xa.data_ptr<T>(), nullptr,
                                ya.data_ptr<T>(), batch,          x.size(1),
                                groups * block};
  const auto& k = cpu::vector_kernels<T>(static_cast<int>(block));
  for_each_block_and_tile(groups, batch, [&](int64_t g0, int64_t g1, int64_t n0, int64_t n1) {
    k.forward(p, g0, g1, n0, n1);
  });
  return ya;
}

// The backward on the ops' own row-major tensors: grad_x walks sources (row_ptr, dst), atomic_free's weight
// gradient groups (col_ptr, src_by_dst, perm).
template <typename T>
class VectorBackward {
 public:
  VectorBackward(const BackwardArgs& a, T* gw)
      : gw_(gw), batch_(a.x.size(0)), in_features_(a.x.size(1)), groups_(a.col_ptr.numel() - 1),
        k_(cpu::vector_kernels<T>(static_cast<int>(a.weight.size(1)))) {
    const at::ScalarType acc = c10::CppTypeToScalarType<T>::value;
    xa_ = a.x.to(acc).contiguous();
    wa_ = a.weight.to(acc).contiguous();
    ga_ = a.grad_out.to(acc).contiguous();
    gxa_ = empty_output({batch_, in_features_}, a.x.options().dtype(acc));
    p_ = {a.row_ptr.data_ptr<int32_t>(), a.dst.data_ptr<int32_t>(), a.col_ptr.data_ptr<int32_t>(),
          a.src_by_dst.data_ptr<int32_t>(), a.perm.data_ptr<int32_t>(), wa_.data_ptr<T>(), xa_.data_ptr<T>(),
          ga_.data_ptr<T>(), gxa_.data_ptr<T>(), batch_, in_features_, groups_ * k_.block};
  }

  // One pass over (source block, batch chunk), a chunk's share of the weight gradient added atomically.
  void fused_atomic() {
    const int64_t units = ceil_div(batch_, kChunkUnit);
    if (units == 0) return;  // empty batch: grad_w stays zero, grad_x has no rows
    const int64_t chunks = std::min<int64_t>(units, at::get_num_threads());
    const int64_t chunk = ceil_div(units, chunks) * kChunkUnit;
    const int64_t block = rows_per_block(in_features_, chunks);
    const int64_t blocks = ceil_div(in_features_, block);
    const int64_t width = k_.block;
    at::parallel_for(0, chunks * blocks, 1, [&](int64_t lo, int64_t hi) {
      std::vector<T> partial;
      for (int64_t task = lo; task < hi; ++task) {
        const int64_t c = task / blocks, s0 = (task % blocks) * block, s1 = std::min(in_features_, s0 + block);
        const int64_t n0 = c * chunk, n1 = std::min(batch_, n0 + chunk);
        if (n0 >= n1) continue;  // the last chunks of a batch that does not fill them all
        const int64_t v0 = p_.row_ptr[s0];
        partial.assign((p_.row_ptr[s1] - v0) * width, T(0));
        k_.spmm_sddmm(p_, s0, s1, n0, n1, partial.data());
        T* out = gw_ + v0 * width;
        for (size_t i = 0; i < partial.size(); ++i) atomic_add(out + i, partial[i]);
      }
    });
  }

  // Pass 1: a task owns a block of groups, hence their vectors, and writes each vector's gradient once (zeros for
  // an empty batch); by group, so that a group's columns of grad_out stay in cache for all its vectors. Pass 2: a
  // task owns (source block, batch tile) of grad_x.
  void atomic_free() {
    const int64_t block = rows_per_block(groups_, 1);
    const int64_t blocks = ceil_div(groups_, block);
    at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) k_.sddmm(p_, b * block, std::min(groups_, (b + 1) * block), gw_);
    });
    for_each_block_and_tile(in_features_, batch_, [&](int64_t s0, int64_t s1, int64_t n0, int64_t n1) {
      k_.spmm_sources(p_, s0, s1, n0, n1);
    });
  }

  at::Tensor grad_x() const { return gxa_; }

 private:
  T* gw_;
  int64_t batch_, in_features_, groups_;
  const cpu::VectorKernelTable<T>& k_;
  at::Tensor xa_, wa_, ga_, gxa_;
  cpu::VectorProblem<T> p_;
};

// Each layout's tasks, by contract.h's layout table: its forward (y in the kernels' type T) and its backward class
// (a member function per strategy). A layout of the table without its specialisation here fails the build.
template <Layout L>
struct LayoutTasks;

#define TSM_LAYOUT_TASKS(layout, forward_fn, BackwardClass) \
  template <>                                                \
  struct LayoutTasks<Layout::layout> {                       \
    template <typename T>                                    \
    static constexpr auto forward = forward_fn<T>;           \
    template <typename T>                                    \
    using Backward = BackwardClass<T>;                       \
  };
TSM_LAYOUT_TASKS(Unstructured, tiled_forward, TiledBackward)
TSM_LAYOUT_TASKS(Vector, vector_forward, VectorBackward)
#undef TSM_LAYOUT_TASKS

// -------------------------------------------------------------------------------------------------- the ops

at::Tensor csr_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& row_ptr,
                          const at::Tensor& dst, const at::Tensor& src, const at::Tensor& col_ptr,
                          const at::Tensor& src_by_dst, const at::Tensor& perm, c10::string_view backward) {
  check_backward_argument(backward);
  check_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  check_int32_sizes(x, "CPU");
  check_topology_cpu(weight.size(0), x.size(1), col_ptr.numel() - 1, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  return run_layout(weight, [&](auto layout) {
    return dispatch_kernel_type(x, "csr_linear_cpu", [&](auto kernel_type) {
      using Tasks = LayoutTasks<decltype(layout)::value>;
      return Tasks::template forward<decltype(kernel_type)>(x, weight, col_ptr, src_by_dst, perm).to(x.scalar_type());
    });
  });
}

std::tuple<at::Tensor, at::Tensor> csr_linear_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                                           const at::Tensor& weight, const at::Tensor& row_ptr,
                                                           const at::Tensor& dst, const at::Tensor& src,
                                                           const at::Tensor& col_ptr, const at::Tensor& src_by_dst,
                                                           const at::Tensor& perm, c10::string_view strategy) {
  check_backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  check_int32_sizes(x, "CPU");
  // out_features: col_ptr's rows (check_backward made grad_out's width agree with them)
  check_topology_cpu(weight.size(0), x.size(1), col_ptr.numel() - 1, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  const Strategy which = parse_strategy(strategy);
  const BackwardArgs args{grad_out, x, weight, row_ptr, dst, col_ptr, src_by_dst, perm};
  const at::TensorOptions acc = weight.options().dtype(accumulate_type(weight.scalar_type()));
  // A strategy that adds into grad_w needs it zeroed; the others write every element once.
  at::Tensor gw = accumulates_grad_w(which) ? at::zeros(weight.sizes(), acc) : empty_output(weight.sizes(), acc);
  const at::Tensor grad_x = run_layout(weight, [&](auto layout) {
    return dispatch_kernel_type(x, "csr_linear_backward_cpu", [&](auto kernel_type) {
      using T = decltype(kernel_type);
      typename LayoutTasks<decltype(layout)::value>::template Backward<T> run(args, gw.data_ptr<T>());
      run_strategy(which, run);
      return run.grad_x();
    });
  });
  return {grad_x.to(x.scalar_type()), gw.to(weight.scalar_type())};
}

// No error words on the CPU: check_topology_cpu raises before a kernel could meet a bad index.
std::vector<int64_t> take_index_errors_cpu(const at::Tensor& /*like*/) {
  return std::vector<int64_t>(static_cast<size_t>(IndexArray::count), 0);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_sparse_metal, CPU, m) {
  m.impl("csr_linear", &csr_linear_cpu);
  m.impl("csr_linear_backward", &csr_linear_backward_cpu);
  m.impl("take_index_errors", &take_index_errors_cpu);
}

}  // namespace torch_sparse_metal::cpu
