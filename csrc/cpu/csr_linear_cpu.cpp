// CPU backend of the csr_linear ops: the ops' glue. Each op checks its arguments (check_topology_cpu: every index
// value the kernels read), then sends the call to the layout of its weight through contract.h's run_layout:
// layout_forward_cpu / layout_backward_cpu, declared for every row of the layout table in cpu_common.h and defined
// in the layout's own file (unstructured_csr_linear_cpu.cpp, vector_csr_linear_cpu.cpp).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

#include "../csr_linear_checks.h"
#include "cpu_common.h"

namespace torch_sparse_metal::cpu {
namespace {

at::Tensor csr_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& row_ptr,
                          const at::Tensor& dst, const at::Tensor& src, const at::Tensor& col_ptr,
                          const at::Tensor& src_by_dst, const at::Tensor& perm, c10::string_view backward) {
  check_backward_argument(backward);
  check_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  check_int32_sizes(x, "CPU");
  check_topology_cpu(weight.size(0), x.size(1), col_ptr.numel() - 1, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  return run_layout(weight, [&](auto layout) {
    return layout_forward_cpu<decltype(layout)::value>(x, weight, col_ptr, src_by_dst, perm).to(x.scalar_type());
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
  const at::Tensor grad_x =
      run_layout(weight, [&](auto layout) { return layout_backward_cpu<decltype(layout)::value>(args, which, gw); });
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
