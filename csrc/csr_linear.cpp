// Op schemas for torch_sparse_metal: the only place they are defined. Kernels are registered per
// backend (csrc/cpu, csrc/cuda in C++; MPS from Python), the fake and autograd rules from Python.
#include <Python.h>
#include <torch/library.h>

// `import torch_sparse_metal._C` must find a module init; the ops register at load time.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(torch_sparse_metal, m) {
  // y[n, o] = sum over by-destination positions k of o: weight[perm[k]] * x[n, src_by_dst[k]].
  // `backward` names the strategy the autograd rule uses; the forward kernels ignore it.
  m.def(
      "csr_linear(Tensor x, Tensor weight, Tensor row_ptr, Tensor dst, Tensor src, Tensor col_ptr, "
      "Tensor src_by_dst, Tensor perm, str backward) -> Tensor");
  // Returns (grad_x [N, in_features], grad_weight [E]); strategy is "fused_atomic" or "atomic_free".
  m.def(
      "csr_linear_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor row_ptr, Tensor dst, "
      "Tensor src, str strategy) -> (Tensor, Tensor)");
}
