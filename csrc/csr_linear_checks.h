// Argument checks shared by every C++/CUDA backend. check_forward/check_backward look at sizes, dtypes and
// devices only, so they cost no host sync; check_topology_cpu reads index values, for CPU tensors.
// Defined once, in csr_linear_checks.cpp, rather than inline in every backend's translation unit.
#pragma once
#include <ATen/ATen.h>

#include "contract.h"

#include <cstdlib>
#include <limits>

namespace torch_sparse_metal {

// The arguments of any layout of contract.h: weight [E] (unstructured) or [vectors, V] (vector, V from
// TSM_FOR_EACH_VECTOR_BLOCK; the index arrays are then a topology over vectors, [in_features -> groups]).
void check_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& row_ptr, const at::Tensor& dst,
                   const at::Tensor& src, const at::Tensor& col_ptr, const at::Tensor& src_by_dst,
                   const at::Tensor& perm);

void check_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                    const at::Tensor& row_ptr, const at::Tensor& dst, const at::Tensor& src,
                    const at::Tensor& col_ptr, const at::Tensor& src_by_dst, const at::Tensor& perm);

// The output width of a call: a row of col_ptr per group of layout_block(weight) outputs (1 for unstructured).
int64_t out_features(const at::Tensor& weight, const at::Tensor& col_ptr);

// The index values of a topology given to a CPU op (reading them there costs no device sync), before any kernel
// runs, in one place for both layouts (unstructured: edges; vector: the arrays over vectors, with edges = vectors
// and out_features = groups), every array by every op whichever ones its kernels read:
//  - bounds: a pointer array starts at 0, never decreases and ends at E; every index lies inside the dimension it
//    indexes, so no kernel reaches memory outside its tensors;
//  - the two orders agree: the forward walks outputs (col_ptr, src_by_dst, perm), the backward sources (row_ptr,
//    dst), so position k of output o must hold an edge perm[k] into o (dst[perm[k]] == o) from the input
//    src_by_dst[k] (the row of row_ptr holding perm[k]), each output listing its sources in increasing order. Then
//    perm is a permutation (each edge exactly once) and both compute one layer; without it a hand-built topology
//    could give gradients that are silently not those of the forward.
// O(E + in_features + out_features): branch-free passes beside the O(E * batch) kernel work, the agreement (one
// gather per edge) in parallel. A failure raises naming the array, the position and the values. CSRTopology's
// builders establish all of it; the CPU kernels never read src, which is not checked here.
void check_topology_cpu(int64_t edges, int64_t in_features, int64_t out_features, const at::Tensor& row_ptr,
                        const at::Tensor& dst, const at::Tensor& src, const at::Tensor& col_ptr,
                        const at::Tensor& src_by_dst, const at::Tensor& perm);

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
