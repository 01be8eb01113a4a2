// CPU backend of the vector_csr_linear ops: ATen glue and the task decomposition over threads. The per-task
// kernels are in vector_csr_linear_kernels_impl.inc, compiled per instruction set.
//
// Layout: none of csr_linear's batch tiles. A vector's V values are contiguous in weight, and the V outputs it
// feeds are contiguous in every row of y and grad_out, so the kernels read x, weight and grad_out as the ops
// receive them and vectorise over the V lanes; x is gathered one scalar per (position, batch row), the same
// address for the R rows of a register block apart from the row stride.
//
// Precision: the kernels compute in the accumulate type of contract.h (float32 for float16 and bfloat16);
// 16-bit operands are widened once at the boundary and results rounded once to the storage type.
//
// Strategies: atomic_free runs the weight gradient per vector over the whole batch (pass 1, a task owns a block of
// groups and so their vectors) and grad_x per (source block, batch tile) (pass 2). fused_atomic makes one pass
// over (source block, batch chunk): grad_x is written by its owner, the weight gradient is the one the atomics go
// to, a chunk's share summed in a task-private buffer and added into a zeroed accumulate-type grad_w. There is at
// most one batch chunk per thread, so with <= 2 threads every element of grad_w receives at most two adds onto
// zero, which give the same bits in either order (torch_sparse_metal.strategy.deterministic).
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../csr_linear_checks.h"
#include "cpu_common.h"
#include "vector_csr_linear_kernels.h"

namespace torch_sparse_metal {
namespace {

// Batch rows per task of the forward and of atomic_free's grad_x pass: a multiple of every register block, and
// few enough rows of x (forward) or grad_out (grad_x) that a task's rows stay in L2 while it walks its groups.
constexpr int64_t kBatchTile = 64;
// The unit of fused_atomic's batch chunks.
constexpr int64_t kChunkUnit = 16;

using cpu::atomic_add;
using cpu::ceil_div;

// Blocks of rows (groups or sources) so that there are about 4 tasks per thread per batch tile or chunk.
inline int64_t rows_per_block(int64_t rows, int64_t chunks) {
  const int64_t blocks = std::max<int64_t>(1, ceil_div(4 * at::get_num_threads(), chunks));
  return std::max<int64_t>(1, ceil_div(rows, blocks));
}

// Runs body(r0, r1, n0, n1) over every (block of `rows`, batch tile of kBatchTile rows) in parallel.
template <typename Body>
void for_each_block_and_tile(int64_t rows, int64_t batch, const Body& body) {
  const int64_t tiles = ceil_div(batch, kBatchTile);
  const int64_t block = rows_per_block(rows, std::max<int64_t>(tiles, 1));
  const int64_t blocks = ceil_div(rows, block);
  at::parallel_for(0, tiles * blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t r0 = (task % blocks) * block, n0 = (task / blocks) * kBatchTile;
      body(r0, std::min(rows, r0 + block), n0, std::min(batch, n0 + kBatchTile));
    }
  });
}

at::Tensor vector_csr_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& row_ptr,
                                 const at::Tensor& dst, const at::Tensor& src, const at::Tensor& col_ptr,
                                 const at::Tensor& src_by_dst, const at::Tensor& perm,
                                 c10::string_view /*backward*/) {
  check_vector_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  check_int32_sizes(x, "CPU");
  const int64_t batch = x.size(0), in_features = x.size(1), groups = col_ptr.numel() - 1;
  const int64_t vectors = weight.size(0), block = weight.size(1), out_features = groups * block;
  check_topology_cpu(vectors, in_features, groups, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  at::Tensor y;
  dispatch_value_type(x.scalar_type(), "vector_csr_linear_cpu", [&](auto types) {
    using T = typename decltype(types)::Acc;  // the kernels' type
    const at::ScalarType acc = c10::CppTypeToScalarType<T>::value;
    const at::Tensor xa = x.to(acc).contiguous(), wa = weight.to(acc).contiguous();
    at::Tensor ya = empty_output({batch, out_features}, x.options().dtype(acc));
    // The forward walks groups: no by-source arrays, no grad_out.
    const cpu::VectorProblem<T> p{nullptr,
                                  nullptr,
                                  col_ptr.data_ptr<int32_t>(),
                                  src_by_dst.data_ptr<int32_t>(),
                                  perm.data_ptr<int32_t>(),
                                  wa.data_ptr<T>(),
                                  xa.data_ptr<T>(),
                                  nullptr,
                                  ya.data_ptr<T>(),
                                  batch,
                                  in_features,
                                  out_features};
    const auto& k = cpu::vector_kernels<T>(static_cast<int>(block));
    // A task owns (group block, batch tile) of y, so no two tasks write one element.
    for_each_block_and_tile(groups, batch, [&](int64_t g0, int64_t g1, int64_t n0, int64_t n1) {
      k.forward(p, g0, g1, n0, n1);
    });
    y = ya.to(x.scalar_type());
  });
  return y;
}

template <typename T>
void backward_fused_atomic(const cpu::VectorProblem<T>& p, const cpu::VectorKernelTable<T>& k, T* gw,
                           int64_t in_features, int64_t batch) {
  const int64_t units = ceil_div(batch, kChunkUnit);
  if (units == 0) return;  // empty batch: grad_w stays zero, grad_x has no rows
  const int64_t chunks = std::min<int64_t>(units, at::get_num_threads());
  const int64_t chunk = ceil_div(units, chunks) * kChunkUnit;
  const int64_t block = rows_per_block(in_features, chunks);
  const int64_t blocks = ceil_div(in_features, block);
  const int64_t width = k.block;
  at::parallel_for(0, chunks * blocks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<T> partial;
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t c = task / blocks, s0 = (task % blocks) * block, s1 = std::min(in_features, s0 + block);
      const int64_t n0 = c * chunk, n1 = std::min(batch, n0 + chunk);
      if (n0 >= n1) continue;  // the last chunks of a batch that does not fill them all
      const int64_t v0 = p.row_ptr[s0];
      partial.assign((p.row_ptr[s1] - v0) * width, T(0));
      k.spmm_sddmm(p, s0, s1, n0, n1, partial.data());
      T* out = gw + v0 * width;
      for (size_t i = 0; i < partial.size(); ++i) atomic_add(out + i, partial[i]);
    }
  });
}

template <typename T>
void backward_atomic_free(const cpu::VectorProblem<T>& p, const cpu::VectorKernelTable<T>& k, T* gw,
                          int64_t in_features, int64_t groups, int64_t batch) {
  // Pass 1: a task owns a block of groups, hence their vectors, and writes each vector's gradient once (zeros
  // for an empty batch). By group, so that a group's columns of grad_out stay in cache for all its vectors.
  const int64_t block = rows_per_block(groups, 1);
  const int64_t blocks = ceil_div(groups, block);
  at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) k.sddmm(p, b * block, std::min(groups, (b + 1) * block), gw);
  });
  // Pass 2: a task owns (source block, batch tile) of grad_x.
  for_each_block_and_tile(in_features, batch, [&](int64_t s0, int64_t s1, int64_t n0, int64_t n1) {
    k.spmm_sources(p, s0, s1, n0, n1);
  });
}

std::tuple<at::Tensor, at::Tensor> vector_csr_linear_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& row_ptr,
    const at::Tensor& dst, const at::Tensor& src, const at::Tensor& col_ptr, const at::Tensor& src_by_dst,
    const at::Tensor& perm, c10::string_view strategy) {
  check_vector_backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  check_int32_sizes(x, "CPU");
  const Strategy which = parse_strategy(strategy);
  const int64_t batch = x.size(0), in_features = x.size(1), groups = col_ptr.numel() - 1;
  const int64_t vectors = weight.size(0), block = weight.size(1);
  // grad_x walks sources (row_ptr, dst), atomic_free's weight gradient groups (col_ptr, src_by_dst, perm).
  check_topology_cpu(vectors, in_features, groups, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  at::Tensor grad_x, gw;
  dispatch_value_type(x.scalar_type(), "vector_csr_linear_backward_cpu", [&](auto types) {
    using T = typename decltype(types)::Acc;  // the kernels' type
    const at::ScalarType acc = c10::CppTypeToScalarType<T>::value;
    // fused_atomic adds into grad_w, so it starts at zero; atomic_free writes every vector once.
    gw = which == Strategy::FusedAtomic ? at::zeros(weight.sizes(), weight.options().dtype(acc))
                                        : empty_output(weight.sizes(), weight.options().dtype(acc));
    const at::Tensor xa = x.to(acc).contiguous(), wa = weight.to(acc).contiguous();
    const at::Tensor ga = grad_out.to(acc).contiguous();
    at::Tensor gxa = empty_output({batch, in_features}, x.options().dtype(acc));
    const cpu::VectorProblem<T> p{row_ptr.data_ptr<int32_t>(),
                                  dst.data_ptr<int32_t>(),
                                  col_ptr.data_ptr<int32_t>(),
                                  src_by_dst.data_ptr<int32_t>(),
                                  perm.data_ptr<int32_t>(),
                                  wa.data_ptr<T>(),
                                  xa.data_ptr<T>(),
                                  ga.data_ptr<T>(),
                                  gxa.data_ptr<T>(),
                                  batch,
                                  in_features,
                                  groups * block};
    const auto& k = cpu::vector_kernels<T>(static_cast<int>(block));
    switch (which) {
      case Strategy::FusedAtomic:
        backward_fused_atomic<T>(p, k, gw.data_ptr<T>(), in_features, batch);
        break;
      case Strategy::AtomicFree:
        backward_atomic_free<T>(p, k, gw.data_ptr<T>(), in_features, groups, batch);
        break;
    }
    grad_x = gxa.to(x.scalar_type());
  });
  return {grad_x, gw.to(weight.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_sparse_metal, CPU, m) {
  m.impl("vector_csr_linear", &vector_csr_linear_cpu);
  m.impl("vector_csr_linear_backward", &vector_csr_linear_backward_cpu);
}

}  // namespace torch_sparse_metal
