// Op schemas for torch_sparse_metal: the only place they are defined. Kernels are registered per
// backend (csrc/cpu, csrc/cuda in C++; MPS from Python), the fake and autograd rules from Python.
#include <Python.h>
#include <torch/library.h>

#include "contract.h"
#include "cpu/csr_linear_kernels.h"
#include "csr_linear_checks.h"

namespace {

// The Python name (first column) of a listed dtype.
const char* python_name(at::ScalarType type) {
#define TSM_NAME_OF(name, scalar_type, ...) \
  if (type == at::ScalarType::scalar_type) return #name;
  TSM_FOR_EACH_DTYPE(TSM_NAME_OF)
#undef TSM_NAME_OF
  return "";
}

// _C.contract() -> {"dtypes": [(name, accumulate name, metal type, metal version, devices), ...],
// "strategies": [(name, deterministic, accumulates), ...], "index_arrays": [name, ...],
// "layouts": [(name, weight rank, (block, ...)), ...]}:
// the tables of contract.h as Python sees them (torch_sparse_metal/contract.py).
PyObject* contract(PyObject*, PyObject*) {
  PyObject* dtypes = PyList_New(0);
  PyObject* strategies = PyList_New(0);
  const auto append = [](PyObject* list, PyObject* item) {
    PyList_Append(list, item);
    Py_DECREF(item);
  };
#define TSM_ROW(name, scalar_type, storage, accumulate, metal, metal_version, devices)                     \
  append(dtypes, Py_BuildValue("(sssis)", #name, python_name(c10::CppTypeToScalarType<accumulate>::value), \
                               metal, metal_version, devices));
  TSM_FOR_EACH_DTYPE(TSM_ROW)
#undef TSM_ROW
#define TSM_STRATEGY(name, method, deterministic, accumulates)                                 \
  append(strategies, Py_BuildValue("(sOO)", #method, (deterministic) ? Py_True : Py_False, \
                                   (accumulates) ? Py_True : Py_False));
  TSM_FOR_EACH_STRATEGY(TSM_STRATEGY)
#undef TSM_STRATEGY
  PyObject* index_arrays = PyList_New(0);
#define TSM_INDEX_NAME(name) append(index_arrays, PyUnicode_FromString(#name));
  TSM_FOR_EACH_INDEX_ARRAY(TSM_INDEX_NAME)
#undef TSM_INDEX_NAME
  PyObject* layouts = PyList_New(0);
#define TSM_LAYOUT(name, method, rank, blocks)                                           \
  {                                                                                      \
    PyObject* sizes = PyList_New(0);                                                     \
    blocks(TSM_BLOCK);                                                                   \
    append(layouts, Py_BuildValue("(siN)", #method, rank, PyList_AsTuple(sizes)));       \
    Py_DECREF(sizes);                                                                    \
  }
#define TSM_BLOCK(v) append(sizes, PyLong_FromLong(v));
  TSM_FOR_EACH_LAYOUT(TSM_LAYOUT)
#undef TSM_BLOCK
#undef TSM_LAYOUT
  return Py_BuildValue("{s:N,s:N,s:N,s:N}", "dtypes", dtypes, "strategies", strategies, "index_arrays",
                       index_arrays, "layouts", layouts);
}

// _C.force_generic_cpu_kernels(bool): torch_sparse_metal.backends.cpu.use_kernels.
PyObject* force_generic_cpu_kernels(PyObject*, PyObject* flag) {
  const int generic = PyObject_IsTrue(flag);
  if (generic < 0) return nullptr;
  torch_sparse_metal::cpu::force_generic_kernels(generic != 0);
  Py_RETURN_NONE;
}

// _C.cpu_kernel_sets() -> (float32 set, float64 set): the names of the tables the CPU ops call now
// (torch_sparse_metal.backends.cpu.active_kernels).
PyObject* cpu_kernel_sets(PyObject*, PyObject*) {
  namespace cpu = torch_sparse_metal::cpu;
  return Py_BuildValue("(ss)", cpu::kernels<float>().name, cpu::kernels<double>().name);
}

// _C.set_poison(bool): torch_sparse_metal.backends.cpu, from TORCH_SPARSE_METAL_POISON.
PyObject* set_poison(PyObject*, PyObject* flag) {
  const int on = PyObject_IsTrue(flag);
  if (on < 0) return nullptr;
  torch_sparse_metal::set_poison(on != 0);
  Py_RETURN_NONE;
}

PyMethodDef methods[] = {
    {"contract", contract, METH_NOARGS, "The op contract's dtype and strategy tables (csrc/contract.h)."},
    {"force_generic_cpu_kernels", force_generic_cpu_kernels, METH_O, "Use the baseline CPU kernels (True) or not."},
    {"cpu_kernel_sets", cpu_kernel_sets, METH_NOARGS, "The CPU kernel sets the ops run now: (float32, float64)."},
    {"set_poison", set_poison, METH_O, "Fill the C++ kernels' outputs with NaN before they run (True) or not."},
    {nullptr, nullptr, 0, nullptr}};

}  // namespace

// `import torch_sparse_metal._C` must find a module init; the ops register at load time.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  return PyModule_Create(&module);
}

TORCH_LIBRARY(torch_sparse_metal, m) {
  // One op family, two layouts told apart by the weight's rank (the index arrays are CSR in both):
  //  - unstructured, weight [E]: y[n, o] = sum over by-destination positions k of o:
  //    weight[perm[k]] * x[n, src_by_dst[k]]; out_features = col_ptr.size(0) - 1;
  //  - vector, weight [vectors, V] (V of TSM_FOR_EACH_VECTOR_BLOCK): the arrays are a topology over vectors
  //    [in_features -> groups], a vector's dst its group g, feeding outputs g*V .. g*V+V-1;
  //    y[n, g*V + l] = sum over by-destination positions k of g: weight[perm[k], l] * x[n, src_by_dst[k]];
  //    out_features = (col_ptr.size(0) - 1) * V.
  // `backward` names the strategy the autograd rule uses: 'auto' or a strategy of contract.h. The forward kernels do
  // not read it but refuse any other value (check_backward_argument), with or without gradients.
  m.def(
      "csr_linear(Tensor x, Tensor weight, Tensor row_ptr, Tensor dst, Tensor src, Tensor col_ptr, "
      "Tensor src_by_dst, Tensor perm, str backward) -> Tensor");
  // Returns (grad_x [N, in_features], grad_weight of weight's shape); strategy is one of contract.h's strategies.
  // It takes the whole topology (both CSR orders), so a strategy that needs another view of it needs no new schema.
  m.def(
      "csr_linear_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor row_ptr, Tensor dst, "
      "Tensor src, Tensor col_ptr, Tensor src_by_dst, Tensor perm, str strategy) -> (Tensor, Tensor)");
  // Reads and clears the error words of like's device: one per index array (contract.h), nonzero where a kernel
  // met an out-of-range index there. Waits for the device. torch_sparse_metal.check_index_errors raises from it.
  m.def("take_index_errors(Tensor like) -> int[]");
}
