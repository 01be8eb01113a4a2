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

// The rows a CSR walk takes: row r's edges are ptr[r] .. ptr[r+1]-1, and edge k has value val[k] and gathers
// row col[k] of the operand b. The forward walks outputs (col_ptr, src_by_dst, and the weights in by-destination
// order, so that every kernel streams them instead of gathering them); the backward walks sources (row_ptr, dst,
// weight).
template <typename T>
struct Csr {
  const int32_t* ptr;
  const int32_t* col;
  const T* val;
};

// Everything a task reads or writes: `b` is the gathered operand (forward: x; backward: grad_out), `a` the
// SDDMM's row operand (backward: x, row s for source s) and `out` the tiled SpMM result (forward: y; backward:
// grad_x).
template <typename T>
struct Problem {
  Csr<T> rows;
  Tiled<T> b, a, out;
};

// The stages, named as in the CUDA and Metal kernels (docs/architecture.md, "Where the contract lives").
template <typename T>
struct KernelTable {
  // The set's name ("generic", "avx2", "neon"): what backends.cpu.active_kernels() reports, read from the table
  // kernels() returns, so the report cannot disagree with the kernels that run.
  const char* name;
  // Batch tile t of a row-major [batch, features] matrix `m` (row stride ld), features [f0, f1), into the tiled
  // layout; rows past `batch` become zeros.
  void (*pack)(const T* m, int64_t ld, int64_t batch, const Tiled<T>& out, int64_t t, int64_t f0, int64_t f1);
  // The inverse, for the rows of tile t below `batch`.
  void (*unpack)(const Tiled<T>& in, int64_t t, int64_t f0, int64_t f1, T* m, int64_t ld, int64_t batch);
  // out[r] = sum over row r's edges k of val[k] * b[col[k]], rows [r0, r1) of batch tile t: the forward (rows =
  // outputs) and atomic_free pass 2, grad_x (rows = sources).
  void (*spmm)(const Problem<T>&, int64_t t, int64_t r0, int64_t r1);
  // fused_atomic: the SpMM of sources [s0, s1) over tiles [t0, t1), and each of their edges' weight-gradient
  // share over those tiles (the SDDMM <a[s], b[dst[e]]>) summed into partial[e - row_ptr[s0]], which the caller
  // adds into grad_w atomically.
  void (*spmm_sddmm_atomic)(const Problem<T>&, int64_t t0, int64_t t1, int64_t s0, int64_t s1, T* partial);
  // atomic_free pass 1: grad_w[e] = sum over all tiles of <a[s], b[dst[e]]> for the edges of sources [s0, s1),
  // each written once by its owner.
  void (*sddmm)(const Problem<T>&, int64_t tiles, int64_t s0, int64_t s1, T* grad_w);
};

// Makes kernels() return the baseline set (true) or the widest this CPU runs (false).
void force_generic_kernels(bool generic);

// The widest kernels this CPU runs (AVX2 + FMA on x86-64 when available, NEON on AArch64), unless the baseline
// set is forced.
template <typename T>
const KernelTable<T>& kernels();

template <typename T>
const KernelTable<T>& generic_kernels();

// Defines <set>_kernels<T>() for float and double in a kernel set's file: its table (the table<T> of
// csr_linear_kernels_impl.inc, or the set's own specialisation), in namespace `set`.
#define TSM_KERNEL_SET_ENTRY(set)                            \
  template <typename T>                                      \
  const KernelTable<T>& set##_kernels() {                    \
    return set::table<T>();                                  \
  }                                                          \
  template const KernelTable<float>& set##_kernels<float>(); \
  template const KernelTable<double>& set##_kernels<double>();

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TORCH_SPARSE_METAL_HAVE_AVX2_KERNELS 1
template <typename T>
const KernelTable<T>& avx2_kernels();
#endif

// Advanced SIMD is part of the Armv8-A base architecture: every AArch64 compiler targets it by default (Linux
// and macOS alike), so the NEON file needs no flags of its own and every AArch64 CPU runs it.
#if defined(__aarch64__) && defined(__ARM_NEON)
#define TORCH_SPARSE_METAL_HAVE_NEON_KERNELS 1
template <typename T>
const KernelTable<T>& neon_kernels();
#endif

}  // namespace cpu
}  // namespace torch_sparse_metal
