// Per-task CPU kernels of the csr_linear ops, free of ATen and of std containers so that the same source can
// be compiled once per instruction set (csr_linear_kernels_*.cpp) and picked at run time.
#pragma once
#include <cstdint>

namespace torch_sparse_metal {
namespace cpu {

// One cache line of a batch row per tile (16 floats or 8 doubles): every edge then costs one line from L2,
// and measured on Zen 3 a 64-byte tile ran several times faster than a 128-byte one.
template <typename T>
constexpr int kTile = 64 / sizeof(T);

// Batch-tiled, feature-major activations: tile t of feature f is kTile contiguous values at
// data + (t * features + f) * kTile. Each tile's slab is contiguous, so its rows do not alias in cache the
// way rows of a plain [features, batch] transpose with a power-of-two batch do; the tail tile is
// zero-padded, so every kernel loop has a compile-time width.
template <typename T>
struct Tiled {
  T* data;
  int64_t features;
  T* row(int64_t t, int64_t f) const { return data + (t * features + f) * kTile<T>; }
};

// Everything a task reads or writes. `x` is the input, `g` the output gradient (backward only) and `out`
// the tiled result (forward: y; backward: grad_x). `weight` is in by-source (edge) order for the backward
// and in by-destination order for the forward, so every kernel streams it instead of gathering it.
template <typename T>
struct Problem {
  const T* weight;
  const int32_t* row_ptr;
  const int32_t* dst;
  const int32_t* col_ptr;
  const int32_t* src_by_dst;
  Tiled<T> x, g, out;
};

template <typename T>
struct KernelTable {
  // Batch tile t of a row-major [batch, features] matrix `m` (row stride ld), features [f0, f1), into the tiled
  // layout; rows past `batch` become zeros.
  void (*pack)(const T* m, int64_t ld, int64_t batch, const Tiled<T>& out, int64_t t, int64_t f0, int64_t f1);
  // The inverse, for the rows of tile t below `batch`.
  void (*unpack)(const Tiled<T>& in, int64_t t, int64_t f0, int64_t f1, T* m, int64_t ld, int64_t batch);
  // Forward gather: outputs [o0, o1) of batch tile t.
  void (*forward)(const Problem<T>&, int64_t t, int64_t o0, int64_t o1);
  // fused_atomic: grad_x of sources [s0, s1) over tiles [t0, t1), and each of their edges' weight-gradient
  // share over those tiles summed into partial[e - row_ptr[s0]].
  void (*fused)(const Problem<T>&, int64_t t0, int64_t t1, int64_t s0, int64_t s1, T* partial);
  // atomic_free pass 1: grad_w[e] for the edges of sources [s0, s1), over all tiles.
  void (*grad_w)(const Problem<T>&, int64_t tiles, int64_t s0, int64_t s1, T* grad_w);
  // atomic_free pass 2: grad_x of sources [s0, s1) in batch tile t.
  void (*grad_x)(const Problem<T>&, int64_t t, int64_t s0, int64_t s1);
};

// Makes kernels() return the baseline set (true) or the widest this CPU runs (false).
void force_generic_kernels(bool generic);

// The widest kernels this CPU runs (AVX2 + FMA on x86-64 when available), unless the baseline set is forced.
template <typename T>
const KernelTable<T>& kernels();

template <typename T>
const KernelTable<T>& generic_kernels();

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TORCH_SPARSE_METAL_HAVE_AVX2_KERNELS 1
template <typename T>
const KernelTable<T>& avx2_kernels();
#endif

}  // namespace cpu
}  // namespace torch_sparse_metal
