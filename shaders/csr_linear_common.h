// Helpers shared by the kernels in shaders/*.metal. torch.mps.compile_shader inlines only torch's own
// <c10/metal/...> headers, so the loader (torch_sparse_metal/backends/mps.py) concatenates this file in
// front of each .metal source; the .metal files therefore never #include it (hence no include guard either).
//
// Conventions of every kernel here:
// - activations are [N, features] row-major (batch-major), the layout of the op contract;
// - index tensors are int32; sizes arrive as Python ints, i.e. 64-bit (`constant long&`), and are narrowed
//   once to uint at the top of a kernel (the host guarantees every size and index fits int32);
// - outputs come first in the argument list, then inputs, then sizes.
#include <metal_stdlib>
using namespace metal;

namespace tsm {

// Atomic float add on device memory (Metal 3 / macOS 13+ has atomic_float). Relaxed order suffices:
// the value is only read by a later dispatch, which Metal orders after this one.
inline void atomic_add(device atomic_float* p, float v) {
  atomic_fetch_add_explicit(p, v, memory_order_relaxed);
}

}  // namespace tsm
