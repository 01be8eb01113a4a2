// The kernels compiled for the baseline instruction set of the build (any CPU).
#include "csr_linear_kernels.h"

#include <cstdlib>
#include <cstring>

namespace torch_sparse_metal {
namespace cpu {
namespace generic {
#include "csr_linear_kernels_impl.inc"
}  // namespace generic

template <typename T>
const KernelTable<T>& generic_kernels() {
  return generic::table<T>();
}
template const KernelTable<float>& generic_kernels<float>();
template const KernelTable<double>& generic_kernels<double>();

// TORCH_SPARSE_METAL_CPU_KERNELS=generic forces the baseline kernels, so that the tests run both sets on one
// machine (read on every call: a test may change it).
template <typename T>
const KernelTable<T>& kernels() {
#ifdef TORCH_SPARSE_METAL_HAVE_AVX2_KERNELS
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const char* forced = std::getenv("TORCH_SPARSE_METAL_CPU_KERNELS");
  if (avx2 && (forced == nullptr || std::strcmp(forced, "generic") != 0)) return avx2_kernels<T>();
#endif
  return generic_kernels<T>();
}
template const KernelTable<float>& kernels<float>();
template const KernelTable<double>& kernels<double>();

}  // namespace cpu
}  // namespace torch_sparse_metal
