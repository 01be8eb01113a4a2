// Argument checks shared by every C++/CUDA backend. They look at sizes, dtypes and devices only, never
// at index values (those are validated once, when a topology is built), so they cost no host sync.
// Defined once, in csr_linear_checks.cpp, rather than inline in every backend's translation unit.
#pragma once
#include <ATen/ATen.h>

#include <cstdlib>
#include <limits>

namespace torch_sparse_metal {

void check_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& row_ptr, const at::Tensor& dst,
                   const at::Tensor& src, const at::Tensor& col_ptr, const at::Tensor& src_by_dst,
                   const at::Tensor& perm);

void check_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                    const at::Tensor& row_ptr, const at::Tensor& dst, const at::Tensor& src);

// For kernels that index with int: batch and in_features must fit.
void check_int32_sizes(const at::Tensor& x, const char* backend);

// With TORCH_SPARSE_METAL_POISON=1 in the environment (the test suite sets it), every buffer a kernel is
// meant to overwrite starts as NaN, so an element a kernel forgets to write shows up in the results.
inline at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  static const bool poison = [] {
    const char* v = std::getenv("TORCH_SPARSE_METAL_POISON");
    return v != nullptr && v[0] == '1';
  }();
  at::Tensor t = at::empty(sizes, options);
  if (poison) t.fill_(std::numeric_limits<double>::quiet_NaN());
  return t;
}

enum class Strategy { FusedAtomic, AtomicFree };

Strategy parse_strategy(c10::string_view s);

}  // namespace torch_sparse_metal
