// The op contract's tables: the one place where the value dtypes and the backward strategies (with their
// properties) are listed.
// C++ and CUDA dispatch from these X-macros; Python reads them through torch_sparse_metal._C.contract()
// (torch_sparse_metal/contract.py), and the Metal host builds its kernel names from that view.
#pragma once

// X(python name, at::ScalarType, storage type, accumulate type, Metal type or "" (none), Metal language it needs
// (__METAL_VERSION__; 0: every one torch compiles at), devices with kernels)
// Kernels read and write the storage type and accumulate in the accumulate type; grad_w is summed in the
// accumulate type too (in a scratch buffer where it differs from storage) and rounded once at the end.
#define TSM_FOR_EACH_DTYPE(X)                                               \
  X(float32, Float, float, float, "float", 0, "cpu cuda mps")               \
  X(float64, Double, double, double, "", 0, "cpu cuda")                     \
  X(float16, Half, c10::Half, float, "half", 0, "cpu cuda mps")             \
  X(bfloat16, BFloat16, c10::BFloat16, float, "bfloat", 310, "cpu cuda mps")

// X(enumerator, name, deterministic, accumulates): the backward strategies. `name` is the string the op schema
// passes and the member function that implements the strategy in every backend's layout (run_strategy below), so a
// strategy added here that a layout lacks fails the build. `deterministic`: every gradient element has one owner,
// which sums in a fixed order, on every device. `accumulates`: partial sums of grad_w meet in atomic adds, so grad_w
// must start zero-filled (and the result depends on the order of the adds unless at most two meet onto zero).
#define TSM_FOR_EACH_STRATEGY(X)             \
  X(FusedAtomic, fused_atomic, false, true)  \
  X(AtomicFree, atomic_free, true, false)

// X(name): the topology's index arrays, in the order of the device error words (one int32 word each, set by a
// CUDA or Metal kernel that read a value outside the array's range; docs/architecture.md, "Index safety").
#define TSM_FOR_EACH_INDEX_ARRAY(X) X(row_ptr) X(dst) X(col_ptr) X(src_by_dst) X(perm)

// X(V): the vector lengths of csr_linear's vector layout: V consecutive outputs share each connection, and the weight
// is [vectors, V] (a 2-D weight; the unstructured layout's is 1-D [nnz], which is V = 1).
#define TSM_FOR_EACH_VECTOR_BLOCK(X) X(8) X(16) X(32)
// The unstructured layout's one block: a connection is one edge.
#define TSM_UNIT_BLOCK(X) X(1)

// X(enumerator, name, weight rank, blocks): the layouts of csr_linear's weight, an axis of the one op family. The
// ops pick a layout by the weight's rank (layout_of, run_layout below); a connection of the topology feeds `block`
// consecutive outputs (the weight's last dimension, 1 for a 1-D weight), one of the X-macro `blocks` lists. Each
// backend supplies a layout's work from this table: the CPU the layout_forward_cpu / layout_backward_cpu declared
// for every row (cpu/cpu_common.h), CUDA the layout_forward_cuda / layout_backward_cuda declared for every row
// (cuda/cuda_common.cuh), Metal the host HOST of backends/mps_<name>_csr_linear.py; a layout added here that a
// backend lacks fails its load or import.
// Python reads the rows through _C.contract() (contract.LAYOUTS).
#define TSM_FOR_EACH_LAYOUT(X)                           \
  X(Unstructured, unstructured, 1, TSM_UNIT_BLOCK)       \
  X(Vector, vector, 2, TSM_FOR_EACH_VECTOR_BLOCK)

#include <ATen/ATen.h>

#include <string>
#include <type_traits>

namespace torch_sparse_metal {

enum class Strategy {
#define TSM_ENUMERATOR(name, ...) name,
  TSM_FOR_EACH_STRATEGY(TSM_ENUMERATOR)
#undef TSM_ENUMERATOR
};

// The concrete strategies' names, quoted and comma-separated in the table's order, for messages.
inline std::string strategy_names() {
  std::string names;
#define TSM_NAME(name, method, ...) names += (names.empty() ? "'" : ", '") + std::string(#method) + "'";
  TSM_FOR_EACH_STRATEGY(TSM_NAME)
#undef TSM_NAME
  return names;
}

inline Strategy parse_strategy(c10::string_view s) {
#define TSM_PARSE(name, method, ...) \
  if (s == #method) return Strategy::name;
  TSM_FOR_EACH_STRATEGY(TSM_PARSE)
#undef TSM_PARSE
  TORCH_CHECK(false, "torch_sparse_metal: unknown backward strategy '", std::string(s), "'; expected one of ",
              strategy_names(), ", lower case ('auto' is resolved by the autograd rule before a kernel is called)");
}

// The forward op's `backward` argument: 'auto' or a strategy of the table. The forward kernels do not read it (the
// autograd rule does, when a gradient is needed), so every forward kernel checks it first: a value no backward
// could take is refused with or without gradients.
inline void check_backward_argument(c10::string_view s) {
  bool known = s == "auto";
#define TSM_KNOWN(name, method, ...) known = known || s == #method;
  TSM_FOR_EACH_STRATEGY(TSM_KNOWN)
#undef TSM_KNOWN
  TORCH_CHECK(known, "torch_sparse_metal: unknown backward strategy '", std::string(s), "'; expected 'auto' or one of ",
              strategy_names(), ", lower case");
}

// Whether `s` adds partial sums into grad_w (the `accumulates` column): grad_w then starts zero-filled.
inline bool accumulates_grad_w(Strategy s) {
  switch (s) {
#define TSM_ACCUMULATES(name, method, deterministic, accumulates) \
  case Strategy::name:                                             \
    return accumulates;
    TSM_FOR_EACH_STRATEGY(TSM_ACCUMULATES)
#undef TSM_ACCUMULATES
  }
  return true;  // not reached: every enumerator has its case
}

// Calls run.<name>() for strategy `s`: the one switch on the strategy, shared by every backend and layout. `run`
// holds a layout's backward on one backend, a member function per strategy.
template <typename Run>
void run_strategy(Strategy s, Run& run) {
  switch (s) {
#define TSM_RUN(name, method, ...) \
  case Strategy::name:             \
    return run.method();
    TSM_FOR_EACH_STRATEGY(TSM_RUN)
#undef TSM_RUN
  }
}

enum class Layout {
#define TSM_ENUMERATOR(name, ...) name,
  TSM_FOR_EACH_LAYOUT(TSM_ENUMERATOR)
#undef TSM_ENUMERATOR
};

// Outputs per connection: the weight's last dimension for a layout over vectors, 1 for a 1-D weight.
inline int64_t layout_block(const at::Tensor& weight) { return weight.dim() > 1 ? weight.size(-1) : 1; }

// The layout of a weight of this rank and block; refuses any other shape, naming every layout.
inline Layout layout_of(const at::Tensor& weight) {
  const int64_t block = layout_block(weight);
  bool listed = false;
#define TSM_IS_BLOCK(v) listed = listed || block == (v);
#define TSM_MATCH(name, method, rank, blocks) \
  listed = false;                             \
  blocks(TSM_IS_BLOCK);                       \
  if (weight.dim() == (rank) && listed) return Layout::name;
  TSM_FOR_EACH_LAYOUT(TSM_MATCH)
#undef TSM_MATCH
#undef TSM_IS_BLOCK
#define TSM_BLOCK_NAME(v) " " #v
#define TSM_DESCRIBE(name, method, rank, blocks) " " #method " (" #rank "-D, V one of {" blocks(TSM_BLOCK_NAME) " });"
  TORCH_CHECK(false, "torch_sparse_metal: weight must be [connections] or [connections, V] (V outputs per "
              "connection) in a layout of csr_linear:" TSM_FOR_EACH_LAYOUT(TSM_DESCRIBE) " got shape ", weight.sizes());
#undef TSM_DESCRIBE
#undef TSM_BLOCK_NAME
}

// Calls run(std::integral_constant<Layout, L>{}) for the layout L of `weight`: the one switch on the layout.
template <typename Run>
decltype(auto) run_layout(const at::Tensor& weight, Run&& run) {
  switch (layout_of(weight)) {
#define TSM_RUN(name, ...) \
  case Layout::name:       \
    return run(std::integral_constant<Layout, Layout::name>{});
    TSM_FOR_EACH_LAYOUT(TSM_RUN)
#undef TSM_RUN
  }
  TORCH_CHECK(false, "torch_sparse_metal: unknown layout");  // not reached: every enumerator has its case
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
#define TSM_CASE(py_name, scalar_type, storage, accumulate, ...) \
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
