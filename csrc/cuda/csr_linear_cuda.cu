// CUDA backend of the csr_linear ops: the ops' glue. Each op checks its arguments, handles the empty cases, then
// sends the call to the layout of its weight through contract.h's run_layout: layout_forward_cuda /
// layout_backward_cuda, declared for every row of the layout table in cuda_common.cuh and defined in the layout's
// own file (unstructured_csr_linear_cuda.cu, vector_csr_linear_cuda.cu). take_index_errors reads and clears the
// device error words that the layouts' kernels set (docs/architecture.md, "Index safety").
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "../csr_linear_checks.h"
#include "cuda_common.cuh"

namespace torch_sparse_metal {
namespace {

std::vector<int64_t> take_index_errors_cuda(const at::Tensor& like) {
  const c10::cuda::CUDAGuard guard(like.device());
  at::Tensor words = error_words(like.device());
  const at::Tensor seen = words.to(at::kCPU, at::kLong);  // waits for the kernels queued before
  words.zero_();
  const int64_t* v = seen.const_data_ptr<int64_t>();
  return std::vector<int64_t>(v, v + seen.numel());
}

// The ops: the checks, the empty cases, then the layout of the weight (csrc/csr_linear.cpp).
at::Tensor csr_linear_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& row_ptr,
                           const at::Tensor& dst, const at::Tensor& src, const at::Tensor& col_ptr,
                           const at::Tensor& src_by_dst, const at::Tensor& perm, c10::string_view backward) {
  check_backward_argument(backward);
  check_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  check_int32_sizes(x, "CUDA");
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y = empty_output({x.size(0), out_features(weight, col_ptr)}, x.options());
  if (y.numel() == 0) return y;
  if (weight.size(0) == 0) return y.zero_();
  run_layout(weight, [&](auto layout) {
    layout_forward_cuda<decltype(layout)::value>(x, weight, col_ptr, src_by_dst, perm, y);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> csr_linear_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                                            const at::Tensor& weight, const at::Tensor& row_ptr,
                                                            const at::Tensor& dst, const at::Tensor& src,
                                                            const at::Tensor& col_ptr, const at::Tensor& src_by_dst,
                                                            const at::Tensor& perm, c10::string_view strategy) {
  check_backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  check_int32_sizes(x, "CUDA");
  const Strategy which = parse_strategy(strategy);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t batch = x.size(0), in_features = x.size(1);
  BackwardCall call{grad_out.contiguous(), x.contiguous(), weight.contiguous(), row_ptr, dst, col_ptr, src_by_dst,
                    perm, empty_output(x.sizes(), x.options()), at::Tensor()};
  // grad_w is summed in the accumulate type: zero-filled where the strategy adds into it, or where no kernel runs
  // (an empty batch); else every element is written once.
  const at::TensorOptions acc = weight.options().dtype(accumulate_type(weight.scalar_type()));
  call.grad_w = accumulates_grad_w(which) || batch == 0 ? at::zeros(weight.sizes(), acc)
                                                        : empty_output(weight.sizes(), acc);
  if (batch == 0 || in_features == 0) return {call.grad_x, call.grad_w.to(weight.scalar_type())};
  if (weight.size(0) == 0) return {call.grad_x.zero_(), call.grad_w.to(weight.scalar_type())};
  run_layout(weight, [&](auto layout) { layout_backward_cuda<decltype(layout)::value>(call, which); });
  return {call.grad_x, call.grad_w.to(weight.scalar_type())};
}


}  // namespace

TORCH_LIBRARY_IMPL(torch_sparse_metal, CUDA, m) {
  m.impl("csr_linear", &csr_linear_cuda);
  m.impl("csr_linear_backward", &csr_linear_backward_cuda);
  m.impl("take_index_errors", &take_index_errors_cuda);
}

}  // namespace torch_sparse_metal
