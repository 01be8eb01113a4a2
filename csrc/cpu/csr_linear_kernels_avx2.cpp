// The same kernels compiled for AVX2 + FMA (x86-64 with GCC); kernels() picks them when the CPU has both.
// Nothing above the pragma is compiled for AVX2, and the kernels use no std templates, so no inline
// function compiled here can be picked by the linker for the generic path.
#include "csr_linear_kernels.h"

#ifdef TORCH_SPARSE_METAL_HAVE_AVX2_KERNELS
#pragma GCC target("avx2,fma")

namespace torch_sparse_metal {
namespace cpu {
namespace avx2 {
#include "csr_linear_kernels_impl.inc"
}  // namespace avx2

template <typename T>
const KernelTable<T>& avx2_kernels() {
  return avx2::table<T>();
}
template const KernelTable<float>& avx2_kernels<float>();
template const KernelTable<double>& avx2_kernels<double>();

}  // namespace cpu
}  // namespace torch_sparse_metal
#endif
