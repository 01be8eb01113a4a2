// The kernels for AVX2 + FMA (x86-64 with GCC); kernels() picks them when the CPU has both. float uses the
// hand-vectorised kernels below, double the templates of csr_linear_kernels_impl.inc compiled for AVX2.
// Nothing above the pragma is compiled for AVX2, and the kernels use no std templates, so no inline
// function compiled here can be picked by the linker for the generic path.
#include "csr_linear_kernels.h"

#ifdef TORCH_SPARSE_METAL_HAVE_AVX2_KERNELS
#pragma GCC target("avx2,fma")
#include <immintrin.h>

namespace torch_sparse_metal {
namespace cpu {
namespace avx2 {
constexpr char kKernelSet[] = "avx2";
#include "csr_linear_kernels_impl.inc"

// Hand-vectorised float kernels. A float tile is two __m256 (lo, hi). The compiler-vectorised templates keep
// their accumulator arrays on the stack (a store-to-load chain per edge) and reduce each edge's dot product
// lane by lane; here the accumulators stay in registers, alternate between two sets so that consecutive edges
// do not wait on one FMA chain, and the dot products of four edges are reduced together.
namespace f32 {

struct Tile {
  __m256 lo, hi;
};

inline Tile load(const float* r) { return {_mm256_loadu_ps(r), _mm256_loadu_ps(r + 8)}; }
inline Tile zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline void fmadd(Tile& acc, __m256 w, const Tile& v) {
  acc.lo = _mm256_fmadd_ps(w, v.lo, acc.lo);
  acc.hi = _mm256_fmadd_ps(w, v.hi, acc.hi);
}
inline void store_sum(float* out, const Tile& a, const Tile& b) {
  _mm256_storeu_ps(out, _mm256_add_ps(a.lo, b.lo));
  _mm256_storeu_ps(out + 8, _mm256_add_ps(a.hi, b.hi));
}
// Lane-wise products of two tiles, folded to eight lanes.
inline __m256 dot8(const Tile& a, const Tile& b) { return _mm256_fmadd_ps(a.hi, b.hi, _mm256_mul_ps(a.lo, b.lo)); }
// {sum(a), sum(b), sum(c), sum(d)} of four eight-lane vectors.
inline __m128 sum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}
inline float sum1(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
// out[0..4) += sums.
inline void add4(float* out, __m128 sums) { _mm_storeu_ps(out, _mm_add_ps(_mm_loadu_ps(out), sums)); }

// Transposes the 8x8 block r[0..8) in place (row i becomes column i).
inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
  r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
  r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
  r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
  r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
  r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
  r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
  r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

// Eight features at a time through two 8x8 transposes (batch rows 0-7 and 8-15 of the tile); the features
// past the last multiple of 8 take the scalar template.
void pack(const float* m, int64_t ld, int64_t batch, const Tiled<float>& out, int64_t t, int64_t f0, int64_t f1) {
  const int64_t b0 = t * 16;
  int64_t f = f0;
  for (; f + 8 <= f1; f += 8) {
    __m256 half[2][8];
    for (int i = 0; i < 16; ++i) {
      half[i / 8][i % 8] = b0 + i < batch ? _mm256_loadu_ps(m + (b0 + i) * ld + f) : _mm256_setzero_ps();
    }
    transpose8(half[0]);
    transpose8(half[1]);
    for (int j = 0; j < 8; ++j) {
      float* o = out.row(t, f + j);
      _mm256_storeu_ps(o, half[0][j]);
      _mm256_storeu_ps(o + 8, half[1][j]);
    }
  }
  avx2::pack<float>(m, ld, batch, out, t, f, f1);
}

void unpack(const Tiled<float>& in, int64_t t, int64_t f0, int64_t f1, float* m, int64_t ld, int64_t batch) {
  const int64_t b0 = t * 16;
  int64_t f = f0;
  for (; f + 8 <= f1; f += 8) {
    __m256 half[2][8];
    for (int j = 0; j < 8; ++j) {
      const float* r = in.row(t, f + j);
      half[0][j] = _mm256_loadu_ps(r);
      half[1][j] = _mm256_loadu_ps(r + 8);
    }
    transpose8(half[0]);
    transpose8(half[1]);
    for (int i = 0; i < 16 && b0 + i < batch; ++i) _mm256_storeu_ps(m + (b0 + i) * ld + f, half[i / 8][i % 8]);
  }
  avx2::unpack<float>(in, t, f, f1, m, ld, batch);
}

void spmm(const Problem<float>& p, int64_t t, int64_t r0, int64_t r1) {
  const Csr<float>& c = p.rows;
  for (int64_t r = r0; r < r1; ++r) {
    Tile acc0 = zero(), acc1 = zero();
    const int32_t k1 = c.ptr[r + 1];
    int32_t k = c.ptr[r];
    for (; k + 2 <= k1; k += 2) {
      fmadd(acc0, _mm256_set1_ps(c.val[k]), load(p.b.row(t, c.col[k])));
      fmadd(acc1, _mm256_set1_ps(c.val[k + 1]), load(p.b.row(t, c.col[k + 1])));
    }
    if (k < k1) fmadd(acc0, _mm256_set1_ps(c.val[k]), load(p.b.row(t, c.col[k])));
    store_sum(p.out.row(t, r), acc0, acc1);
  }
}

// dw[e - row_ptr[s]] += <b row of dst[e], a row of s> over tile t for every edge e of source s; kWithSpmm also
// writes the SpMM of s (grad_x: the fused backward reads each gradient line once for both).
template <bool kWithSpmm>
inline void edges_of_source(const Problem<float>& p, int64_t t, int64_t s, float* dw) {
  const Csr<float>& c = p.rows;
  const Tile arow = load(p.a.row(t, s));
  Tile acc0 = zero(), acc1 = zero();
  const int32_t e0 = c.ptr[s], e1 = c.ptr[s + 1];
  int32_t e = e0;
  for (; e + 4 <= e1; e += 4) {
    const Tile g0 = load(p.b.row(t, c.col[e])), g1 = load(p.b.row(t, c.col[e + 1]));
    const Tile g2 = load(p.b.row(t, c.col[e + 2])), g3 = load(p.b.row(t, c.col[e + 3]));
    if (kWithSpmm) {
      fmadd(acc0, _mm256_set1_ps(c.val[e]), g0);
      fmadd(acc1, _mm256_set1_ps(c.val[e + 1]), g1);
      fmadd(acc0, _mm256_set1_ps(c.val[e + 2]), g2);
      fmadd(acc1, _mm256_set1_ps(c.val[e + 3]), g3);
    }
    add4(dw + (e - e0), sum4(dot8(g0, arow), dot8(g1, arow), dot8(g2, arow), dot8(g3, arow)));
  }
  for (; e < e1; ++e) {
    const Tile g = load(p.b.row(t, c.col[e]));
    if (kWithSpmm) fmadd(acc0, _mm256_set1_ps(c.val[e]), g);
    dw[e - e0] += sum1(dot8(g, arow));
  }
  if (kWithSpmm) store_sum(p.out.row(t, s), acc0, acc1);
}

void spmm_sddmm_atomic(const Problem<float>& p, int64_t t0, int64_t t1, int64_t s0, int64_t s1, float* partial) {
  const int32_t base = p.rows.ptr[s0];
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t s = s0; s < s1; ++s) edges_of_source<true>(p, t, s, partial + (p.rows.ptr[s] - base));
}

void sddmm(const Problem<float>& p, int64_t tiles, int64_t s0, int64_t s1, float* gw) {
  for (int32_t e = p.rows.ptr[s0]; e < p.rows.ptr[s1]; ++e) gw[e] = 0.0f;
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t s = s0; s < s1; ++s) edges_of_source<false>(p, t, s, gw + p.rows.ptr[s]);
}

}  // namespace f32

// The float table uses the kernels above; double keeps the compiler-vectorised templates.
template <>
const KernelTable<float>& table<float>() {
  static const KernelTable<float> t{kKernelSet, &f32::pack, &f32::unpack, &f32::spmm, &f32::spmm_sddmm_atomic,
                                    &f32::sddmm};
  return t;
}
}  // namespace avx2

TSM_KERNEL_SET_ENTRY(avx2)

}  // namespace cpu
}  // namespace torch_sparse_metal
#endif
