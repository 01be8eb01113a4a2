// The vector layout (weight [vectors, V]) of the CPU backend of the csr_linear ops: its task decomposition over
// threads and its layout_forward_cpu / layout_backward_cpu, called by the ops in csr_linear_cpu.cpp. No repacking:
// a vector's V values are contiguous in weight, and the V outputs it feeds are contiguous in every row of y and
// grad_out, so the kernels read x, weight and grad_out as the ops receive them and vectorise over the V lanes; x is
// gathered one scalar per (position, batch row). The per-task kernels are in vector_csr_linear_kernels_impl.inc,
// compiled per instruction set.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "../csr_linear_checks.h"
#include "cpu_common.h"
#include "vector_csr_linear_kernels.h"

namespace torch_sparse_metal::cpu {
namespace {

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

}  // namespace

TSM_DEFINE_CPU_LAYOUT(Vector, vector_forward, VectorBackward)

}  // namespace torch_sparse_metal::cpu
