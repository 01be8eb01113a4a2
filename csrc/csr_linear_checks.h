// Argument checks shared by every C++/CUDA backend. check_forward/check_backward look at sizes, dtypes and
// devices only, so they cost no host sync; check_topology_values_cpu reads index values, for CPU tensors.
// Defined once, in csr_linear_checks.cpp, rather than inline in every backend's translation unit.
#pragma once
#include <ATen/ATen.h>

#include "contract.h"

#include <cstdlib>
#include <limits>

namespace torch_sparse_metal {

void check_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& row_ptr, const at::Tensor& dst,
                   const at::Tensor& src, const at::Tensor& col_ptr, const at::Tensor& src_by_dst,
                   const at::Tensor& perm);

void check_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                    const at::Tensor& row_ptr, const at::Tensor& dst, const at::Tensor& src,
                    const at::Tensor& col_ptr, const at::Tensor& src_by_dst, const at::Tensor& perm);

// The vector_csr_linear ops' arguments: weight is [vectors, V] (V from TSM_FOR_EACH_VECTOR_BLOCK), the index
// arrays are a topology of [in_features, groups] over vectors (dst: a vector's group, out_features = groups * V).
void check_vector_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& row_ptr,
                          const at::Tensor& dst, const at::Tensor& src, const at::Tensor& col_ptr,
                          const at::Tensor& src_by_dst, const at::Tensor& perm);

void check_vector_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                           const at::Tensor& row_ptr, const at::Tensor& dst, const at::Tensor& src,
                           const at::Tensor& col_ptr, const at::Tensor& src_by_dst, const at::Tensor& perm);

// The index values the CPU kernels read (reading them there costs no device sync): a pointer array starts at 0,
// never decreases and ends at E; every index lies inside the dimension it indexes. Only the arrays a kernel
// reads are checked (undefined tensors are skipped): the forward reads col_ptr, src_by_dst and perm, the backward
// row_ptr and dst. Vectorised O(E) passes beside the O(E * batch) kernel work, so that a malformed topology
// given straight to the ops raises instead of reaching memory outside its tensors. (That perm is a
// permutation and src matches row_ptr, CSRTopology's builders establish; neither can send a kernel out of bounds.)
void check_topology_values_cpu(int64_t edges, int64_t in_features, int64_t out_features, const at::Tensor& row_ptr,
                               const at::Tensor& dst, const at::Tensor& col_ptr, const at::Tensor& src_by_dst,
                               const at::Tensor& perm);

// For kernels that index with int: batch and in_features must fit.
void check_int32_sizes(const at::Tensor& x, const char* backend);

// Under TORCH_SPARSE_METAL_POISON (read by torch_sparse_metal.settings, which sets this switch through
// _C.set_poison; the test suite turns it on) every buffer a kernel is meant to overwrite starts as NaN, so an
// element a kernel forgets to write shows up in the results.
void set_poison(bool on);
bool poison();

inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  at::Tensor t = at::empty(sizes, options);
  if (poison()) t.fill_(std::numeric_limits<double>::quiet_NaN());
  return t;
}

}  // namespace torch_sparse_metal
