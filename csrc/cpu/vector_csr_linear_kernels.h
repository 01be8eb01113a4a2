// Per-task CPU kernels of csr_linear's vector layout (weight [vectors, V]), free of ATen and of std containers so
// that the same source (vector_csr_linear_kernels_impl.inc) is compiled once per instruction set in
// vector_csr_linear_kernels.cpp.
//
// Layout: the kernels read and write the ops' own row-major tensors, with no repacking: a vector's V values are
// contiguous in weight [vectors, V], and so are the V outputs it feeds in every batch row of y and grad_out
// [batch, groups * V]. The inner loops run over those V lanes as whole SIMD registers.
#pragma once
#include <cstdint>

namespace torch_sparse_metal {
namespace cpu {

// Everything a task reads or writes. By source: row_ptr and dst (vector j of source s is position j, its group
// dst[j]); by group: col_ptr, src_by_dst and perm (position k of group g is vector perm[k], of source
// src_by_dst[k]). The forward and the weight gradient walk groups, grad_x walks sources.
template <typename T>
struct VectorProblem {
  const int32_t *row_ptr, *dst;
  const int32_t *col_ptr, *src_by_dst, *perm;
  const T* weight;    // [vectors, V]
  const T* x;         // [batch, in_features]
  const T* grad_out;  // [batch, out_features] (backward)
  T* out;             // forward: y [batch, out_features]; backward: grad_x [batch, in_features]
  int64_t batch, in_features, out_features;  // out_features = groups * V
};

// The kernels of one vector length V (table.block), named after the stages of docs/architecture.md.
template <typename T>
struct VectorKernelTable {
  const char* name;  // the instruction set: "generic" or "avx2"
  int block;         // V
  // spmm (forward): y[n, g*V .. g*V+V) for groups [g0, g1) and batch rows [n0, n1).
  void (*forward)(const VectorProblem<T>&, int64_t g0, int64_t g1, int64_t n0, int64_t n1);
  // sddmm (atomic_free pass 1): grad_w[j, 0..V) = sum over the batch of x[n, s] * grad_out[n, g*V ..) for the
  // vectors j (of sources s) of groups [g0, g1), each written once.
  void (*sddmm)(const VectorProblem<T>&, int64_t g0, int64_t g1, T* grad_w);
  // spmm over sources (atomic_free pass 2): grad_x[n, s] = sum over s's vectors j of <weight[j], grad_out[n,
  // dst[j]*V ..)>, sources [s0, s1), batch rows [n0, n1).
  void (*spmm_sources)(const VectorProblem<T>&, int64_t s0, int64_t s1, int64_t n0, int64_t n1);
  // spmm_sddmm_atomic (fused_atomic): spmm_sources over [s0, s1) x [n0, n1), and the vectors' weight gradients
  // over those rows added into partial[(j - row_ptr[s0]) * V + l] (zeroed by the caller, which adds it into grad_w
  // atomically).
  void (*spmm_sddmm)(const VectorProblem<T>&, int64_t s0, int64_t s1, int64_t n0, int64_t n1, T* partial);
};

// The kernels of block V for the instruction set the csr_linear kernels run (cpu::kernels<T>().name: AVX2 + FMA
// where csr_linear runs it, the baseline set otherwise, and under backends.cpu.use_kernels("generic")).
// T is float or double; `block` one of TSM_FOR_EACH_VECTOR_BLOCK.
template <typename T>
const VectorKernelTable<T>& vector_kernels(int block);

}  // namespace cpu
}  // namespace torch_sparse_metal
