// MSL vector types, metal:: functions that need no target intrinsics, and the binding of thread-position
// built-ins, shared by the two targets that compile unchanged Metal source: metal_compat.h (g++, the CPU executor) and cuda_compat.h (nvcc, the CUDA
// translation). The including header defines TSM_FN (how a function here is declared: `inline` for the CPU,
// `__device__ inline` for CUDA) and the scalar names uint, ushort, half and bfloat first.
//
// Sizes and alignments follow MSL: a vector of 2 or 4 elements is aligned to its size, and a 3-element vector
// takes the room of 4 (float3 is 16 bytes). A `float4` load through a `device float4*` is therefore one
// 16-byte access on CUDA, as on an Apple GPU.
#pragma once

// A target may give vectors its own copy (metal_compat.h: one access per vector load, for the traffic model).
#ifndef TSM_VEC_COPY
#define TSM_VEC_COPY(V)
#endif
// How a function that touches only the calling lane's own values is declared (metal_compat.h: unchecked, since the
// checker would only see stack accesses).
#ifndef TSM_LOCAL_FN
#define TSM_LOCAL_FN TSM_FN
#endif

#define TSM_VEC_OPS(V, N)                                                                                     \
  TSM_FN V& operator+=(const V& o) { for (int i = 0; i < N; ++i) (*this)[i] += o[i]; return *this; }           \
  TSM_FN V& operator-=(const V& o) { for (int i = 0; i < N; ++i) (*this)[i] -= o[i]; return *this; }           \
  TSM_FN V& operator*=(const V& o) { for (int i = 0; i < N; ++i) (*this)[i] *= o[i]; return *this; }           \
  TSM_FN V& operator/=(const V& o) { for (int i = 0; i < N; ++i) (*this)[i] /= o[i]; return *this; }           \
  friend TSM_FN V operator+(V a, const V& b) { return a += b; }                                                \
  friend TSM_FN V operator-(V a, const V& b) { return a -= b; }                                                \
  friend TSM_FN V operator*(V a, const V& b) { return a *= b; }                                                \
  friend TSM_FN V operator/(V a, const V& b) { return a /= b; }                                                \
  friend TSM_FN V operator*(V a, T s) { return a *= V(s); }                                                    \
  friend TSM_FN V operator*(T s, V a) { return a *= V(s); }                                                    \
  friend TSM_FN V operator+(V a, T s) { return a += V(s); }                                                    \
  friend TSM_FN V operator-(V a, T s) { return a -= V(s); }                                                    \
  friend TSM_FN V operator/(V a, T s) { return a /= V(s); }                                                    \
  TSM_FN T& operator[](int i) { return (&x)[i]; }                                                              \
  TSM_FN const T& operator[](int i) const { return (&x)[i]; }

template <typename T>
struct alignas(2 * sizeof(T)) tsm_vec2 {
  T x, y;
  tsm_vec2() = default;
  TSM_FN constexpr tsm_vec2(T a, T b) : x(a), y(b) {}
  TSM_FN explicit constexpr tsm_vec2(T a) : x(a), y(a) {}
  typedef tsm_vec2 V;
  TSM_VEC_OPS(V, 2)
  TSM_VEC_COPY(tsm_vec2)
};
template <typename T>
struct alignas(4 * sizeof(T)) tsm_vec3 {
  T x, y, z;
  tsm_vec3() = default;
  TSM_FN constexpr tsm_vec3(T a, T b, T c) : x(a), y(b), z(c) {}
  TSM_FN explicit constexpr tsm_vec3(T a) : x(a), y(a), z(a) {}
  typedef tsm_vec3 V;
  TSM_VEC_OPS(V, 3)
  TSM_VEC_COPY(tsm_vec3)
};
template <typename T>
struct alignas(4 * sizeof(T)) tsm_vec4 {
  T x, y, z, w;
  tsm_vec4() = default;
  TSM_FN constexpr tsm_vec4(T a, T b, T c, T d) : x(a), y(b), z(c), w(d) {}
  TSM_FN explicit constexpr tsm_vec4(T a) : x(a), y(a), z(a), w(a) {}
  typedef tsm_vec4 V;
  TSM_VEC_OPS(V, 4)
  TSM_VEC_COPY(tsm_vec4)
};
#undef TSM_VEC_OPS

#ifdef TSM_STRICT_ADDRESS_SPACES
// The strict clang pass: clang's ext_vector_type, which is what Metal's vectors are (a struct could not be
// copied out of another address space: `*(device const float4*)p` needs a built-in vector).
#define TSM_VEC_TYPES(T, P)                              \
  typedef T P##2 __attribute__((ext_vector_type(2))); \
  typedef T P##3 __attribute__((ext_vector_type(3))); \
  typedef T P##4 __attribute__((ext_vector_type(4)));
#else
#define TSM_VEC_TYPES(T, P) \
  typedef tsm_vec2<T> P##2; \
  typedef tsm_vec3<T> P##3; \
  typedef tsm_vec4<T> P##4;
#endif
TSM_VEC_TYPES(uint, uint)
TSM_VEC_TYPES(int, int)
TSM_VEC_TYPES(ushort, ushort)
TSM_VEC_TYPES(short, short)
TSM_VEC_TYPES(float, float)
TSM_VEC_TYPES(half, half)
TSM_VEC_TYPES(bfloat, bfloat)
TSM_VEC_TYPES(ulong, ulong)
#undef TSM_VEC_TYPES

namespace metal {
template <typename T> TSM_FN T min(T a, T b) { return b < a ? b : a; }
template <typename T> TSM_FN T max(T a, T b) { return a < b ? b : a; }
template <typename T> TSM_FN T clamp(T v, T lo, T hi) { return min(max(v, lo), hi); }
template <typename T> TSM_FN T select(T a, T b, bool c) { return c ? b : a; }

// metal::vec<T, N>, the generic spelling of float4, half2, ...
#ifdef TSM_STRICT_ADDRESS_SPACES
template <typename T, int N>
using vec = T __attribute__((ext_vector_type(N)));
#else
template <typename T, int N>
struct tsm_vec_of;
template <typename T>
struct tsm_vec_of<T, 2> {
  typedef tsm_vec2<T> type;
};
template <typename T>
struct tsm_vec_of<T, 3> {
  typedef tsm_vec3<T> type;
};
template <typename T>
struct tsm_vec_of<T, 4> {
  typedef tsm_vec4<T> type;
};
template <typename T, int N>
using vec = typename tsm_vec_of<T, N>::type;
#endif

// simdgroup_matrix<T, Cols, Rows> (<metal_simdgroup_matrix>). Metal leaves the distribution of a matrix's elements
// over the lanes of a SIMD-group unspecified (a kernel sees it only through thread_elements(), which the shaders
// here never use), so every lane holding the whole matrix is a faithful implementation of the documented API. The
// including header defines the operations (simdgroup_load, simdgroup_store, simdgroup_multiply_accumulate, ...):
// on the CPU executor they are collective, checked points; on CUDA each thread computes the whole product.
template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "Metal's SIMD-group matrices are 8 x 8");
  T e[Rows][Cols];  // e[row][column], in every lane
  simdgroup_matrix() = default;
  // A diagonal matrix with the given value (Metal's simdgroup_matrix(T dval)).
  TSM_FN explicit simdgroup_matrix(T dval) {
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < Cols; ++c) e[r][c] = r == c ? dval : T(0);
  }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
template <typename T, int Cols, int Rows>
TSM_FN simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) m.e[r][c] = value;
  return m;
}
// d = a * b + c, summed in float in the order k = 0 .. K-1 after c, rounded once to d's type. The operands may be of
// another type than the accumulators (half or bfloat a and b into float c and d, as Metal compiles them); d may be
// c. Only the values are computed here: the including header wraps this in its collective.
template <typename Td, typename Ta, typename Tb, typename Tc, int Cols, int Rows, int K>
TSM_LOCAL_FN void tsm_matrix_mad(simdgroup_matrix<Td, Cols, Rows>& d, const simdgroup_matrix<Ta, K, Rows>& a,
                           const simdgroup_matrix<Tb, Cols, K>& b, const simdgroup_matrix<Tc, Cols, Rows>* c) {
  float out[Rows][Cols];
  for (int r = 0; r < Rows; ++r)
    for (int col = 0; col < Cols; ++col) {
      float acc = c ? float(c->e[r][col]) : 0.0f;
      for (int k = 0; k < K; ++k) acc += float(a.e[r][k]) * float(b.e[k][col]);
      out[r][col] = acc;
    }
  for (int r = 0; r < Rows; ++r)
    for (int col = 0; col < Cols; ++col) d.e[r][col] = Td(out[r][col]);
}
// Memory index of element (row r, column c) of a matrix loaded from or stored to memory with `elements_per_row`
// and `origin` (x: the column, y: the row of the matrix's first element in memory); a transposed matrix's element
// (r, c) is memory element (c, r).
TSM_FN unsigned long tsm_matrix_offset(unsigned r, unsigned c, unsigned long elements_per_row, ulong2 origin,
                                       bool transpose) {
  return transpose ? (origin.y + c) * elements_per_row + origin.x + r : (origin.y + r) * elements_per_row + origin.x + c;
}
}  // namespace metal

// Built-in values (tsm_abi.h's tsm_ids fields, 3 unsigned each) as the type a kernel declares.
namespace tsm_bind {
template <typename T>
struct builtin;
template <>
struct builtin<uint> {
  static TSM_FN uint get(const unsigned* v) { return v[0]; }
};
template <>
struct builtin<ushort> {
  static TSM_FN ushort get(const unsigned* v) { return ushort(v[0]); }
};
template <>
struct builtin<int> {
  static TSM_FN int get(const unsigned* v) { return int(v[0]); }
};
template <typename T>
struct builtin<tsm_vec2<T>> {
  static TSM_FN tsm_vec2<T> get(const unsigned* v) { return tsm_vec2<T>(T(v[0]), T(v[1])); }
};
template <typename T>
struct builtin<tsm_vec3<T>> {
  static TSM_FN tsm_vec3<T> get(const unsigned* v) { return tsm_vec3<T>(T(v[0]), T(v[1]), T(v[2])); }
};
}  // namespace tsm_bind
