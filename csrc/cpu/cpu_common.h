// What the CPU files of the csr_linear ops share (csr_linear_cpu.cpp: the ops; unstructured_csr_linear_cpu.cpp and
// vector_csr_linear_cpu.cpp: the layouts' task decomposition over threads): the backward's arguments, every layout's
// entry points, the kernel-type dispatch and the task helpers.
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
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../contract.h"

namespace torch_sparse_metal::cpu {

// The backward's arguments, checked.
struct BackwardArgs {
  const at::Tensor &grad_out, &x, &weight, &row_ptr, &dst, &col_ptr, &src_by_dst, &perm;
};

// Layout L's forward and backward (contract.h's layout table), called by the ops with their checks passed. The
// forward returns y [batch, out_features] in the accumulate type of x's dtype; the backward runs strategy `which`,
// writes grad_w (weight's shape, the accumulate type; zero-filled where the strategy adds into it) and returns
// grad_x [batch, in_features] in the accumulate type. Declared for every layout from the table; a layout without
// its definitions fails at load (an undefined symbol).
template <Layout L>
at::Tensor layout_forward_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& col_ptr,
                              const at::Tensor& src_by_dst, const at::Tensor& perm);
template <Layout L>
at::Tensor layout_backward_cpu(const BackwardArgs& args, Strategy which, at::Tensor& grad_w);

#define TSM_DECLARE_LAYOUT(name, ...)                                                                           \
  template <>                                                                                                   \
  at::Tensor layout_forward_cpu<Layout::name>(const at::Tensor&, const at::Tensor&, const at::Tensor&,          \
                                              const at::Tensor&, const at::Tensor&);                            \
  template <>                                                                                                   \
  at::Tensor layout_backward_cpu<Layout::name>(const BackwardArgs&, Strategy, at::Tensor&);
TSM_FOR_EACH_LAYOUT(TSM_DECLARE_LAYOUT)
#undef TSM_DECLARE_LAYOUT

// Calls body(T{}) with T the kernels' type of x's dtype (its accumulate type: the kernels compute in it).
template <typename Body>
decltype(auto) dispatch_kernel_type(const at::Tensor& x, const char* op, Body&& body) {
  return dispatch_value_type(x.scalar_type(), op,
                             [&](auto types) { return body(typename decltype(types)::Acc{}); });
}

// A layout's backward: the Backward<T> of x's kernel type T runs strategy `which` (run_strategy) into grad_w;
// returns grad_x.
template <template <typename> class Backward>
at::Tensor run_backward(const BackwardArgs& args, Strategy which, at::Tensor& grad_w) {
  return dispatch_kernel_type(args.x, "csr_linear_backward_cpu", [&](auto kernel_type) {
    using T = decltype(kernel_type);
    Backward<T> run(args, grad_w.data_ptr<T>());
    run_strategy(which, run);
    return run.grad_x();
  });
}

// Defines layout `name`'s entry points in its file: forward_fn<T> (y in the kernels' type T) and BackwardClass<T> (a
// member function per strategy, and grad_x()), T the kernel type of x's dtype.
#define TSM_DEFINE_CPU_LAYOUT(name, forward_fn, BackwardClass)                                                         \
  template <>                                                                                                          \
  at::Tensor layout_forward_cpu<Layout::name>(const at::Tensor& x, const at::Tensor& weight,                           \
                                              const at::Tensor& col_ptr, const at::Tensor& src_by_dst,                 \
                                              const at::Tensor& perm) {                                                \
    return dispatch_kernel_type(x, "csr_linear_cpu", [&](auto kernel_type) {                                           \
      return forward_fn<decltype(kernel_type)>(x, weight, col_ptr, src_by_dst, perm);                                  \
    });                                                                                                                \
  }                                                                                                                    \
  template <>                                                                                                          \
  at::Tensor layout_backward_cpu<Layout::name>(const BackwardArgs& args, Strategy which, at::Tensor& grad_w) {         \
    return run_backward<BackwardClass>(args, which, grad_w);                                                           \
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

}  // namespace torch_sparse_metal::cpu
