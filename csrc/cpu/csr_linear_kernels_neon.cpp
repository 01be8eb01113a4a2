// The kernels for AArch64's Advanced SIMD (NEON), on Linux and macOS; kernels() picks them on every AArch64 CPU.
// A batch tile is one 64-byte line in both kernel types (16 floats, 8 doubles), so it is four 128-bit vectors
// either way, and one set of kernels written over the vector type (Lanes<T>) serves float and double.
//
// What the hand-written kernels give over the templates of csr_linear_kernels_impl.inc (which the generic set
// runs here, and whose weight-gradient dot products clang for arm64 compiles to one chain of scalar FMAs, 16 deep
// for float): the accumulators stay in registers and alternate between two sets, so consecutive edges do not
// wait on one FMA chain; each edge's dot product is two independent vector FMA chains over its tile, and the dot
// products of two edges are reduced together by pairwise adds; and the layout conversions of float move 4x4
// blocks through transposes instead of one element at a time. double's layout conversions are the templates'.
#include "csr_linear_kernels.h"

#ifdef TORCH_SPARSE_METAL_HAVE_NEON_KERNELS
#include <arm_neon.h>

namespace torch_sparse_metal {
namespace cpu {
namespace neon {
constexpr char kKernelSet[] = "neon";
#include "csr_linear_kernels_impl.inc"

namespace simd {

// The 128-bit vector of T and the operations the kernels use on it.
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  using V = float32x4_t;
  static constexpr int kWidth = 4;
  static V load(const float* p) { return vld1q_f32(p); }
  static void store(float* p, V v) { vst1q_f32(p, v); }
  static V zero() { return vdupq_n_f32(0.0f); }
  static V dup(float w) { return vdupq_n_f32(w); }
  static V fma(V acc, V a, V b) { return vfmaq_f32(acc, a, b); }  // acc + a * b, one rounding
  static V mul(V a, V b) { return vmulq_f32(a, b); }
  static V add(V a, V b) { return vaddq_f32(a, b); }
  static float sum(V v) { return vaddvq_f32(v); }
  // out[0..2) += {sum(a), sum(b)}: two levels of pairwise adds.
  static void add_sums2(float* out, V a, V b) {
    const float32x4_t ab = vpaddq_f32(a, b);
    vst1_f32(out, vadd_f32(vld1_f32(out), vpadd_f32(vget_low_f32(ab), vget_high_f32(ab))));
  }
};

template <>
struct Lanes<double> {
  using V = float64x2_t;
  static constexpr int kWidth = 2;
  static V load(const double* p) { return vld1q_f64(p); }
  static void store(double* p, V v) { vst1q_f64(p, v); }
  static V zero() { return vdupq_n_f64(0.0); }
  static V dup(double w) { return vdupq_n_f64(w); }
  static V fma(V acc, V a, V b) { return vfmaq_f64(acc, a, b); }
  static V mul(V a, V b) { return vmulq_f64(a, b); }
  static V add(V a, V b) { return vaddq_f64(a, b); }
  static double sum(V v) { return vaddvq_f64(v); }
  static void add_sums2(double* out, V a, V b) { vst1q_f64(out, vaddq_f64(vld1q_f64(out), vpaddq_f64(a, b))); }
};

// One batch tile of one row in registers. Four named vectors rather than an array: GCC keeps an array member
// that member functions update on the stack, a load and a store per FMA.
template <typename T>
struct Tile {
  using L = Lanes<T>;
  using V = typename L::V;
  static_assert(kTile<T> == 4 * L::kWidth, "a tile is one 64-byte line: four 128-bit vectors");
  V v0, v1, v2, v3;

  static Tile load(const T* row) {
    return {L::load(row), L::load(row + L::kWidth), L::load(row + 2 * L::kWidth), L::load(row + 3 * L::kWidth)};
  }
  static Tile zero() { return {L::zero(), L::zero(), L::zero(), L::zero()}; }
  // *this += w * b
  void fma(T w, const Tile& b) {
    const V wv = L::dup(w);
    v0 = L::fma(v0, wv, b.v0);
    v1 = L::fma(v1, wv, b.v1);
    v2 = L::fma(v2, wv, b.v2);
    v3 = L::fma(v3, wv, b.v3);
  }
  // Lane-wise products with b folded to one vector, as two independent FMA chains joined by one add.
  V dot_lanes(const Tile& b) const {
    return L::add(L::fma(L::mul(v0, b.v0), v1, b.v1), L::fma(L::mul(v2, b.v2), v3, b.v3));
  }
  // out = a + b: the two accumulator sets of a row, joined once at its end.
  static void store_sum(T* out, const Tile& a, const Tile& b) {
    L::store(out, L::add(a.v0, b.v0));
    L::store(out + L::kWidth, L::add(a.v1, b.v1));
    L::store(out + 2 * L::kWidth, L::add(a.v2, b.v2));
    L::store(out + 3 * L::kWidth, L::add(a.v3, b.v3));
  }
};

template <typename T>
void spmm(const Problem<T>& p, int64_t t, int64_t r0, int64_t r1) {
  const Csr<T>& c = p.rows;
  for (int64_t r = r0; r < r1; ++r) {
    Tile<T> acc0 = Tile<T>::zero(), acc1 = Tile<T>::zero();
    const int32_t k1 = c.ptr[r + 1];
    int32_t k = c.ptr[r];
    for (; k + 2 <= k1; k += 2) {
      acc0.fma(c.val[k], Tile<T>::load(p.b.row(t, c.col[k])));
      acc1.fma(c.val[k + 1], Tile<T>::load(p.b.row(t, c.col[k + 1])));
    }
    if (k < k1) acc0.fma(c.val[k], Tile<T>::load(p.b.row(t, c.col[k])));
    Tile<T>::store_sum(p.out.row(t, r), acc0, acc1);  // an empty row stores zeros
  }
}

// dw[e - row_ptr[s]] += <b row of dst[e], a row of s> over tile t for every edge e of source s; kWithSpmm also
// writes the SpMM of s (grad_x: the fused backward reads each gradient line once for both).
template <bool kWithSpmm, typename T>
inline void edges_of_source(const Problem<T>& p, int64_t t, int64_t s, T* dw) {
  const Csr<T>& c = p.rows;
  const Tile<T> arow = Tile<T>::load(p.a.row(t, s));
  Tile<T> acc0 = Tile<T>::zero(), acc1 = Tile<T>::zero();
  const int32_t e0 = c.ptr[s], e1 = c.ptr[s + 1];
  int32_t e = e0;
  // Two edges at a time: with the two accumulator sets and the source row, two tiles in flight fill 20 of the 32
  // vector registers; four (GCC hoists every load of an iteration) spill an accumulator set through the stack.
  for (; e + 2 <= e1; e += 2) {
    const Tile<T> g0 = Tile<T>::load(p.b.row(t, c.col[e])), g1 = Tile<T>::load(p.b.row(t, c.col[e + 1]));
    if (kWithSpmm) {
      acc0.fma(c.val[e], g0);
      acc1.fma(c.val[e + 1], g1);
    }
    Lanes<T>::add_sums2(dw + (e - e0), g0.dot_lanes(arow), g1.dot_lanes(arow));
  }
  if (e < e1) {
    const Tile<T> g = Tile<T>::load(p.b.row(t, c.col[e]));
    if (kWithSpmm) acc0.fma(c.val[e], g);
    dw[e - e0] += Lanes<T>::sum(g.dot_lanes(arow));
  }
  if (kWithSpmm) Tile<T>::store_sum(p.out.row(t, s), acc0, acc1);
}

template <typename T>
void spmm_sddmm_atomic(const Problem<T>& p, int64_t t0, int64_t t1, int64_t s0, int64_t s1, T* partial) {
  const int32_t base = p.rows.ptr[s0];
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t s = s0; s < s1; ++s) edges_of_source<true>(p, t, s, partial + (p.rows.ptr[s] - base));
}

template <typename T>
void sddmm(const Problem<T>& p, int64_t tiles, int64_t s0, int64_t s1, T* gw) {
  for (int32_t e = p.rows.ptr[s0]; e < p.rows.ptr[s1]; ++e) gw[e] = T(0);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t s = s0; s < s1; ++s) edges_of_source<false>(p, t, s, gw + p.rows.ptr[s]);
}

// Transposes the 4x4 block r[0..4) in place (row i becomes column i).
inline void transpose4(float32x4_t* r) {
  const float32x4_t t0 = vtrn1q_f32(r[0], r[1]), t1 = vtrn2q_f32(r[0], r[1]);
  const float32x4_t t2 = vtrn1q_f32(r[2], r[3]), t3 = vtrn2q_f32(r[2], r[3]);
  const auto lo = [](float32x4_t a, float32x4_t b) {
    return vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(a), vreinterpretq_f64_f32(b)));
  };
  const auto hi = [](float32x4_t a, float32x4_t b) {
    return vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(a), vreinterpretq_f64_f32(b)));
  };
  r[0] = lo(t0, t2);
  r[1] = lo(t1, t3);
  r[2] = hi(t0, t2);
  r[3] = hi(t1, t3);
}

// Four features at a time, as four 4x4 transposes (batch rows 0-3, 4-7, 8-11, 12-15 of the tile); rows past
// `batch` are zeros, and the features past the last multiple of 4 take the scalar template.
void pack_f32(const float* m, int64_t ld, int64_t batch, const Tiled<float>& out, int64_t t, int64_t f0,
              int64_t f1) {
  const int64_t b0 = t * kTile<float>;
  int64_t f = f0;
  for (; f + 4 <= f1; f += 4) {
    for (int q = 0; q < kTile<float>; q += 4) {
      float32x4_t r[4];
      for (int i = 0; i < 4; ++i) {
        const int64_t b = b0 + q + i;
        r[i] = b < batch ? vld1q_f32(m + b * ld + f) : vdupq_n_f32(0.0f);
      }
      transpose4(r);
      for (int j = 0; j < 4; ++j) vst1q_f32(out.row(t, f + j) + q, r[j]);
    }
  }
  neon::pack<float>(m, ld, batch, out, t, f, f1);
}

void unpack_f32(const Tiled<float>& in, int64_t t, int64_t f0, int64_t f1, float* m, int64_t ld, int64_t batch) {
  const int64_t b0 = t * kTile<float>;
  int64_t f = f0;
  for (; f + 4 <= f1; f += 4) {
    for (int q = 0; q < kTile<float> && b0 + q < batch; q += 4) {
      float32x4_t r[4];
      for (int j = 0; j < 4; ++j) r[j] = vld1q_f32(in.row(t, f + j) + q);
      transpose4(r);
      for (int i = 0; i < 4 && b0 + q + i < batch; ++i) vst1q_f32(m + (b0 + q + i) * ld + f, r[i]);
    }
  }
  neon::unpack<float>(in, t, f, f1, m, ld, batch);
}

}  // namespace simd

template <>
const KernelTable<float>& table<float>() {
  static const KernelTable<float> t{kKernelSet, &simd::pack_f32, &simd::unpack_f32, &simd::spmm<float>,
                                    &simd::spmm_sddmm_atomic<float>, &simd::sddmm<float>};
  return t;
}

template <>
const KernelTable<double>& table<double>() {
  // double's layout conversions are the templates'
  static const KernelTable<double> t{kKernelSet, &pack<double>, &unpack<double>, &simd::spmm<double>,
                                     &simd::spmm_sddmm_atomic<double>, &simd::sddmm<double>};
  return t;
}
}  // namespace neon

TSM_KERNEL_SET_ENTRY(neon)

}  // namespace cpu
}  // namespace torch_sparse_metal
#endif
