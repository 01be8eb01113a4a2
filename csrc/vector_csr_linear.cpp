// Op schemas of the vector_csr_linear family: a sparse linear layer whose connections are vectors of V
// consecutive outputs (V from TSM_FOR_EACH_VECTOR_BLOCK in contract.h). The index arrays are those of
// csr_linear for a layer [in_features -> groups], one entry per vector (dst: the vector's group g, which feeds
// outputs g*V .. g*V+V-1); weight is [vectors, V], row j the values of vector j (by-source order). Kernels are
// registered per backend (csrc/cpu, csrc/cuda; MPS from Python), the fake and autograd rules from Python
// (torch_sparse_metal/ops/_vector_csr_linear.py). Checks: check_vector_forward/_backward (csr_linear_checks.h).
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(torch_sparse_metal, m) {
  // y[n, g*V + l] = sum over by-destination positions k of group g: weight[perm[k], l] * x[n, src_by_dst[k]].
  // out_features = (col_ptr.size(0) - 1) * V. `backward` names the strategy the autograd rule uses.
  m.def(
      "vector_csr_linear(Tensor x, Tensor weight, Tensor row_ptr, Tensor dst, Tensor src, Tensor col_ptr, "
      "Tensor src_by_dst, Tensor perm, str backward) -> Tensor");
  // Returns (grad_x [N, in_features], grad_weight [vectors, V]):
  //   grad_x[n, s]    = sum over vectors j of source s, lanes l: weight[j, l] * grad_out[n, dst[j]*V + l]
  //   grad_w[j, l]    = sum_n grad_out[n, dst[j]*V + l] * x[n, src[j]]
  // strategy "fused_atomic": one pass whose partial sums meet in atomic adds (not deterministic);
  //          "atomic_free":  every output element written once by its owner (deterministic), in two passes.
  m.def(
      "vector_csr_linear_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor row_ptr, Tensor dst, "
      "Tensor src, Tensor col_ptr, Tensor src_by_dst, Tensor perm, str strategy) -> (Tensor, Tensor)");
}
