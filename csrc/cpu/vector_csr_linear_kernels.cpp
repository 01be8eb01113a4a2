// The vector layout's kernel tables: the templates of vector_csr_linear_kernels_impl.inc compiled for the
// baseline instruction set, and again for AVX2 + FMA where csr_linear has an AVX2 set (x86-64, GCC). Everything
// above the target pragma (the headers, the baseline set) is compiled for the baseline; the AVX2 copy lives in
// its own namespace and uses no std templates, so the linker cannot pick one of its inline functions for the
// baseline path.
#include "vector_csr_linear_kernels.h"

#include <cstring>

#include "../contract.h"  // TSM_FOR_EACH_VECTOR_BLOCK
#include "csr_linear_kernels.h"

namespace torch_sparse_metal {
namespace cpu {

namespace vector_generic {
constexpr char kKernelSet[] = "generic";
#include "vector_csr_linear_kernels_impl.inc"
}  // namespace vector_generic

#ifdef TORCH_SPARSE_METAL_HAVE_AVX2_KERNELS
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace vector_avx2 {
constexpr char kKernelSet[] = "avx2";
#include "vector_csr_linear_kernels_impl.inc"
}  // namespace vector_avx2
#pragma GCC pop_options
#endif

template <typename T>
const VectorKernelTable<T>& vector_kernels(int block) {
  // The same instruction set as the csr_linear kernels, so that use_kernels("generic") covers both layouts.
  const bool avx2 = std::strcmp(kernels<T>().name, "avx2") == 0;
  (void)avx2;  // unused where there is no AVX2 set
  switch (block) {
#ifdef TORCH_SPARSE_METAL_HAVE_AVX2_KERNELS
#define TSM_BLOCK_CASE(v) \
  case v:                 \
    return avx2 ? vector_avx2::table<T, v>() : vector_generic::table<T, v>();
#else
#define TSM_BLOCK_CASE(v) \
  case v:                 \
    return vector_generic::table<T, v>();
#endif
    TSM_FOR_EACH_VECTOR_BLOCK(TSM_BLOCK_CASE)
#undef TSM_BLOCK_CASE
  }
  // The boundary checks refuse any other block before a kernel is looked up.
  TORCH_CHECK(false, "torch_sparse_metal: no CPU vector kernels for block ", block);
}
template const VectorKernelTable<float>& vector_kernels<float>(int);
template const VectorKernelTable<double>& vector_kernels<double>(int);

}  // namespace cpu
}  // namespace torch_sparse_metal
