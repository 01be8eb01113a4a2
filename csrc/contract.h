// The op contract's tables: the one place where the value dtypes and the backward strategies are listed.
// C++ and CUDA dispatch from these X-macros; Python reads them through torch_sparse_metal._C.contract()
// (torch_sparse_metal/contract.py), and the Metal host builds its kernel names from that view.
#pragma once

// X(python name, at::ScalarType, storage type, accumulate type, Metal type or "" (none), devices with kernels)
// Kernels read and write the storage type and accumulate in the accumulate type; grad_w is summed in the
// accumulate type too (in a scratch buffer where it differs from storage) and rounded once at the end.
#define TSM_FOR_EACH_DTYPE(X)                                            \
  X(float32, Float, float, float, "float", "cpu cuda mps")               \
  X(float64, Double, double, double, "", "cpu cuda")                     \
  X(float16, Half, c10::Half, float, "half", "cpu cuda mps")             \
  X(bfloat16, BFloat16, c10::BFloat16, float, "bfloat", "cpu cuda mps")

// X(enumerator, schema name). The op schema passes the name; each backend switches on the enumerator.
#define TSM_FOR_EACH_STRATEGY(X) \
  X(FusedAtomic, "fused_atomic") \
  X(AtomicFree, "atomic_free")

// X(name): the topology's index arrays, in the order of the device error words (one int32 word each, set by a
// CUDA or Metal kernel that read a value outside the array's range; docs/architecture.md, "Index safety").
#define TSM_FOR_EACH_INDEX_ARRAY(X) X(row_ptr) X(dst) X(col_ptr) X(src_by_dst) X(perm)

// X(V): the vector lengths of the vector_csr_linear ops (csrc/vector_csr_linear.cpp): V consecutive outputs share
// each connection, the layer's weight is [vectors, V]. V = 1 is the unstructured layout of csr_linear.
#define TSM_FOR_EACH_VECTOR_BLOCK(X) X(8) X(16) X(32)

#include <ATen/ATen.h>

#include <string>
#include <type_traits>

namespace torch_sparse_metal {

enum class Strategy {
#define TSM_ENUMERATOR(name, schema_name) name,
  TSM_FOR_EACH_STRATEGY(TSM_ENUMERATOR)
#undef TSM_ENUMERATOR
};

inline Strategy parse_strategy(c10::string_view s) {
#define TSM_PARSE(name, schema_name) \
  if (s == schema_name) return Strategy::name;
  TSM_FOR_EACH_STRATEGY(TSM_PARSE)
#undef TSM_PARSE
  TORCH_CHECK(false, "torch_sparse_metal: unknown backward strategy '", std::string(s),
              "' ('auto' is resolved by the autograd rule before a kernel is called)");
}

// Slots of the device error words.
enum class IndexArray {
#define TSM_SLOT(name) name,
  TSM_FOR_EACH_INDEX_ARRAY(TSM_SLOT)
#undef TSM_SLOT
  count
};

// The storage and accumulate types of one row of TSM_FOR_EACH_DTYPE, passed to a dispatched body.
template <typename Storage, typename Accumulate>
struct ValueTypes {
  using T = Storage;
  using Acc = Accumulate;
};

// Calls body(ValueTypes<T, Acc>{}) for the row of `type`; every listed dtype, whatever the device (a backend
// without kernels for a dtype never receives it: the Python layer refuses it first, from the same table).
template <typename Body>
decltype(auto) dispatch_value_type(at::ScalarType type, const char* op, Body&& body) {
  switch (type) {
#define TSM_CASE(py_name, scalar_type, storage, accumulate, metal, devices) \
  case at::ScalarType::scalar_type:                                         \
    return body(ValueTypes<storage, accumulate>{});
    TSM_FOR_EACH_DTYPE(TSM_CASE)
#undef TSM_CASE
    default:
      TORCH_CHECK(false, "torch_sparse_metal::", op, ": unsupported dtype ", type);
  }
}

// The accumulate dtype of a value dtype (float32 for the 16-bit types).
inline at::ScalarType accumulate_type(at::ScalarType type) {
  return dispatch_value_type(type, "accumulate_type", [](auto v) {
    return c10::CppTypeToScalarType<typename decltype(v)::Acc>::value;
  });
}

}  // namespace torch_sparse_metal
