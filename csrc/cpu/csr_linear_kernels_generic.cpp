// The kernels compiled for the baseline instruction set of the build (any CPU).
#include "csr_linear_kernels.h"

#include <atomic>

namespace torch_sparse_metal {
namespace cpu {
namespace generic {
constexpr char kKernelSet[] = "generic";
#include "csr_linear_kernels_impl.inc"
}  // namespace generic

TSM_KERNEL_SET_ENTRY(generic)

namespace {
// Set by torch_sparse_metal.backends.cpu (use_kernels, and TORCH_SPARSE_METAL_CPU_KERNELS at import), so that
// the tests run both sets on one machine.
std::atomic<bool> force_generic{false};
}  // namespace

void force_generic_kernels(bool generic) { force_generic.store(generic, std::memory_order_relaxed); }

template <typename T>
const KernelTable<T>& kernels() {
  if (force_generic.load(std::memory_order_relaxed)) return generic_kernels<T>();
#ifdef TORCH_SPARSE_METAL_HAVE_AVX2_KERNELS
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) return avx2_kernels<T>();
#endif
#ifdef TORCH_SPARSE_METAL_HAVE_NEON_KERNELS
  return neon_kernels<T>();  // every AArch64 CPU has Advanced SIMD: nothing to ask at run time
#else
  return generic_kernels<T>();
#endif
}
template const KernelTable<float>& kernels<float>();
template const KernelTable<double>& kernels<double>();

}  // namespace cpu
}  // namespace torch_sparse_metal
