// Compatibility header: lets g++ compile unchanged Metal Shading Language kernels as C++14 for the
// MSL-on-CPU executor. The Python driver (executor.py) has already
//   - expanded the preprocessor (so instantiation macros are visible),
//   - turned `threadgroup T name[...]` storage declarations into references to storage the runtime hands out
//     per running threadgroup (tsm_threadgroup_storage: shared by its lanes, bounds- and race-checked),
//   - stripped Metal attributes ([[buffer(i)]], [[thread_position_in_grid]], [[host_name(...)]], ...),
//   - appended one extern "C" entry point per [[host_name]] that binds buffers and built-ins.
// What remains for this header: address-space qualifiers, scalar/vector types, metal:: math, atomics,
// barriers and SIMD-group functions. Only what our shaders and tests use is provided; anything else is a
// compile error, on purpose.
#pragma once

#include "tsm_abi.h"

// ----------------------------------------------------------------------------------------- address spaces
// The executor treats every address space as ordinary memory. With TSM_STRICT_ADDRESS_SPACES (the clang
// pass, clang_check.py) they become clang address spaces, so that mixing them up, or writing through
// `constant`, is a compile error as it is for the Metal compiler.
#ifdef TSM_STRICT_ADDRESS_SPACES
#define device __attribute__((address_space(1)))
#define constant const __attribute__((address_space(2)))
#define threadgroup __attribute__((address_space(3)))
#define TSM_ATOMIC_SPACES(M) M(device) M(threadgroup)
#else
#define device
#define constant const
#define threadgroup
#define TSM_ATOMIC_SPACES(M) M()
#endif
#define thread
#define kernel

// --------------------------------------------------------------------------------------------- scalars
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef unsigned long size_t;
typedef long ptrdiff_t;
typedef _Float16 half;  // IEEE binary16; g++ rounds every half operation to nearest even, as Metal does
static_assert(sizeof(long) == 8, "MSL long is 64-bit");

#ifdef TSM_STRICT_ADDRESS_SPACES
// The strict pass only type-checks. clang's own bfloat type (__bf16) allows no arithmetic or conversions before
// clang 17, and a class could not be read out of another address space (its member functions take `this` in the
// generic one); __fp16 is a 16-bit floating type, distinct from half (_Float16 on clang_check.py's arm64 target),
// that converts to and from float.
typedef __fp16 bfloat;
#else
// bfloat (Metal 3.1): float's upper 16 bits. Conversion from float rounds to nearest even (a NaN stays a NaN,
// quieted); an operation on two bfloats is done in float and rounded once, which is the correctly rounded
// bfloat result (float has more than twice bfloat's precision). With a float or an integer operand, a bfloat
// converts to float, and the result is a float.
constexpr unsigned short tsm_bfloat_bits(float f) {
  const unsigned u = __builtin_bit_cast(unsigned, f);
  return (u & 0x7fffffffu) > 0x7f800000u ? (u >> 16) | 0x40u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
struct bfloat {
  unsigned short bits;
  bfloat() = default;
  constexpr bfloat(float f) : bits(tsm_bfloat_bits(f)) {}
  constexpr operator float() const { return __builtin_bit_cast(float, unsigned(bits) << 16); }
  constexpr bfloat operator+() const { return *this; }
  constexpr bfloat operator-() const { return bfloat(-float(*this)); }
#define TSM_BFLOAT_ASSIGN(OP) \
  template <typename U>       \
  bfloat& operator OP##=(U o) { return *this = bfloat(float(*this) OP o); }
  TSM_BFLOAT_ASSIGN(+) TSM_BFLOAT_ASSIGN(-) TSM_BFLOAT_ASSIGN(*) TSM_BFLOAT_ASSIGN(/)
#undef TSM_BFLOAT_ASSIGN
};
// bfloat OP bfloat is a bfloat. A template, so that it takes exactly two bfloats: with a bfloat and a float
// (or an int) the built-in float operator applies instead, with no ambiguity.
template <typename B>
struct tsm_if_bfloat {};
template <>
struct tsm_if_bfloat<bfloat> {
  typedef bfloat type;
};
#define TSM_BFLOAT_OP(OP)                                                    \
  template <typename B>                                                      \
  constexpr typename tsm_if_bfloat<B>::type operator OP(B a, B b) {          \
    return bfloat(float(a) OP float(b));                                     \
  }
TSM_BFLOAT_OP(+) TSM_BFLOAT_OP(-) TSM_BFLOAT_OP(*) TSM_BFLOAT_OP(/)
#undef TSM_BFLOAT_OP
static_assert(sizeof(bfloat) == 2 && alignof(bfloat) == 2, "bfloat is 2 bytes, as a torch.bfloat16 element");
#endif

// --------------------------------------------------------------------------------------------- vectors
#define TSM_FN inline
#ifndef TSM_STRICT_ADDRESS_SPACES
// A vector is loaded and stored whole, as one access (g++ would copy the struct member by member, and the traffic
// model would see a float4 load as four 4-byte instructions instead of one 16-byte one, as on a GPU).
template <unsigned long N>
inline void tsm_copy_whole(void* to, const void* from) {
  typedef char W __attribute__((vector_size(N), aligned(1), may_alias));
  *static_cast<W*>(to) = *static_cast<const W*>(from);
}
#define TSM_VEC_COPY(V)                                                     \
  TSM_FN V(const V& o) { tsm_copy_whole<sizeof(V)>(this, &o); }             \
  TSM_FN V& operator=(const V& o) {                                         \
    tsm_copy_whole<sizeof(V)>(this, &o);                                    \
    return *this;                                                           \
  }
#endif
#ifndef TSM_STRICT_ADDRESS_SPACES
#define TSM_LOCAL_FN __attribute__((no_sanitize_thread)) inline
#endif
#include "msl_common.h"
static_assert(sizeof(metal::vec<half, 4>) == 8 && sizeof(metal::vec<bfloat, 4>) == 8, "4 x 16 bits, as in Metal");

// -------------------------------------------------------------------------------------------- metal::
namespace metal {
inline int abs(int v) { return v < 0 ? -v : v; }
inline float abs(float v) { return __builtin_fabsf(v); }
inline float fabs(float v) { return __builtin_fabsf(v); }
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline float sqrt(float v) { return __builtin_sqrtf(v); }
inline float rsqrt(float v) { return 1.0f / __builtin_sqrtf(v); }
inline float exp(float v) { return __builtin_expf(v); }
inline float log(float v) { return __builtin_logf(v); }
inline float tanh(float v) { return __builtin_tanhf(v); }
inline float floor(float v) { return __builtin_floorf(v); }
inline float ceil(float v) { return __builtin_ceilf(v); }
inline bool isnan(float v) { return __builtin_isnan(v); }
inline bool isinf(float v) { return __builtin_isinf(v); }

// ----------------------------------------------------------------------------------------- barriers
enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}
// Always inlined: the runtime tells barrier calls apart by their call stack.
__attribute__((always_inline)) inline void threadgroup_barrier(mem_flags f) {
  tsm_threadgroup_barrier(static_cast<unsigned>(f));
}

// ------------------------------------------------------------------------------------------- atomics
enum memory_order { memory_order_relaxed = 0 };
template <typename T>
struct atomic {
  T value;
};
typedef atomic<float> atomic_float;
// The value argument does not take part in deduction: `atomic_fetch_add_explicit(p_uint, 1, ...)` converts the 1.
template <typename T>
struct tsm_identity {
  typedef T type;
};
template <typename T>
using tsm_nd = typename tsm_identity<T>::type;
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;

// The read-modify-writes that return the old value: BUILTIN(&a->value, v, order) of gcc's atomic built-ins, and the
// max and min, a compare-and-swap loop while REPLACES (of old and v) holds.
#define TSM_ATOMIC_RMW(AS, NAME, BUILTIN)                                                                              \
  template <typename T>                                                                                                \
  inline T NAME(AS atomic<T>* a, tsm_nd<T> v, memory_order) {                                                          \
    return BUILTIN(&a->value, v, __ATOMIC_RELAXED);                                                                    \
  }
#define TSM_ATOMIC_FETCH_EXTREME(AS, NAME, REPLACES)                                                                   \
  template <typename T>                                                                                                \
  inline T NAME(AS atomic<T>* a, tsm_nd<T> v, memory_order) {                                                          \
    T old = __atomic_load_n(&a->value, __ATOMIC_RELAXED);                                                              \
    while (REPLACES && !__atomic_compare_exchange_n(&a->value, &old, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {   \
    }                                                                                                                  \
    return old;                                                                                                        \
  }
// Float add: a compare-and-swap loop on the bits (there is no native float fetch_add before C++20).
#define TSM_ATOMICS(AS)                                                                                                \
  template <typename T>                                                                                                \
  inline T atomic_load_explicit(AS const atomic<T>* a, memory_order) {                                                 \
    return __atomic_load_n(&a->value, __ATOMIC_RELAXED);                                                               \
  }                                                                                                                    \
  template <typename T>                                                                                                \
  inline void atomic_store_explicit(AS atomic<T>* a, tsm_nd<T> v, memory_order) {                                      \
    __atomic_store_n(&a->value, v, __ATOMIC_RELAXED);                                                                  \
  }                                                                                                                    \
  TSM_ATOMIC_RMW(AS, atomic_exchange_explicit, __atomic_exchange_n)                                                    \
  TSM_ATOMIC_RMW(AS, atomic_fetch_add_explicit, __atomic_fetch_add)                                                    \
  TSM_ATOMIC_RMW(AS, atomic_fetch_sub_explicit, __atomic_fetch_sub)                                                    \
  TSM_ATOMIC_FETCH_EXTREME(AS, atomic_fetch_max_explicit, old < v)                                                     \
  TSM_ATOMIC_FETCH_EXTREME(AS, atomic_fetch_min_explicit, v < old)                                                     \
  template <typename T>                                                                                                \
  inline bool atomic_compare_exchange_weak_explicit(AS atomic<T>* a, T* expected, tsm_nd<T> desired, memory_order,     \
                                                    memory_order) {                                                    \
    return __atomic_compare_exchange_n(&a->value, expected, desired, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED);        \
  }                                                                                                                    \
  __attribute__((no_sanitize_thread)) inline float tsm_float_fetch_add(AS atomic<float>* a, float v) {               \
    AS unsigned* bits = reinterpret_cast<AS unsigned*>(&a->value);                                                     \
    unsigned old = __atomic_load_n(bits, __ATOMIC_RELAXED);                                                            \
    for (;;) {                                                                                                         \
      float f;                                                                                                         \
      __builtin_memcpy(&f, &old, 4);                                                                                   \
      float sum = f + v;                                                                                               \
      unsigned nb;                                                                                                     \
      __builtin_memcpy(&nb, &sum, 4);                                                                                  \
      if (__atomic_compare_exchange_n(bits, &old, nb, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return f;             \
    }                                                                                                                  \
  }                                                                                                                    \
  inline float atomic_fetch_add_explicit(AS atomic<float>* a, float v, memory_order) {                                 \
    TSM_CHECK_ATOMIC(&a->value, 4);                                                                                    \
    return tsm_float_fetch_add(a, v);                                                                                  \
  }                                                                                                                    \

// The float add is a compare-and-swap loop, not instrumented: one checked atomic access stands for it (checker.cpp),
// so that the traffic model counts one atomic instruction, as the GPU's single atomic add.
#ifdef TSM_STRICT_ADDRESS_SPACES
#define TSM_CHECK_ATOMIC(p, n) (void)(p)
#else
#define TSM_CHECK_ATOMIC(p, n) tsm_atomic_access(p, n)
#endif
TSM_ATOMIC_SPACES(TSM_ATOMICS)
#undef TSM_ATOMICS
#undef TSM_ATOMIC_RMW
#undef TSM_ATOMIC_FETCH_EXTREME
#undef TSM_CHECK_ATOMIC

// ---------------------------------------------------------------------------------- SIMD-group functions
// Each call is a collective point: the lane publishes its value and waits for every live lane of its
// SIMD-group (32 consecutive lanes of the threadgroup) to reach the same function (see runtime.cpp).
namespace tsm_detail {
enum Kind { SUM = 1, PRODUCT, MAX, MIN, PREFIX_EX, PREFIX_IN, SHUFFLE, SHUFFLE_DOWN, SHUFFLE_UP, SHUFFLE_XOR,
            BROADCAST_FIRST, ALL, ANY, BALLOT, SIMD_BARRIER, MATRIX };
template <typename T>
inline const unsigned long long* exchange(T v, int kind, unsigned* lane, unsigned* mask) {
  static_assert(sizeof(T) <= 8, "SIMD-group functions support values of at most 8 bytes");
  return tsm_simd_exchange(&v, sizeof(T), kind, lane, mask);
}
// Reads the runtime's exchange slots, which are no kernel memory: not checked.
template <typename T>
__attribute__((no_sanitize_thread)) inline T slot(const unsigned long long* s, unsigned i) {
  T r;
  __builtin_memcpy(&r, s + i, sizeof(T));
  return r;
}
// The reductions and prefix sums: `acc` folded with `op` over the values of the active lanes, all of them or (a
// prefix sum) those before the caller's lane, or up to it.
template <typename T, typename Op>
inline T fold(T v, Kind kind, T acc, Op op) {
  unsigned lane, mask;
  auto s = exchange(v, kind, &lane, &mask);
  const unsigned end = kind == PREFIX_EX ? lane : kind == PREFIX_IN ? lane + 1 : TSM_SIMD_WIDTH;
  for (unsigned i = 0; i < end; ++i)
    if (mask >> i & 1u) acc = op(acc, slot<T>(s, i));
  return acc;
}
}  // namespace tsm_detail

#define TSM_SIMD_FOLD(NAME, KIND, INIT, OP)                                               \
  template <typename T>                                                                   \
  inline T NAME(T v) {                                                                    \
    return tsm_detail::fold(v, tsm_detail::KIND, INIT, [](T a, T b) -> T { return OP; }); \
  }
TSM_SIMD_FOLD(simd_sum, SUM, T(0), a + b)
TSM_SIMD_FOLD(simd_product, PRODUCT, T(1), a * b)
TSM_SIMD_FOLD(simd_max, MAX, v, max(a, b))
TSM_SIMD_FOLD(simd_min, MIN, v, min(a, b))
TSM_SIMD_FOLD(simd_prefix_exclusive_sum, PREFIX_EX, T(0), a + b)
TSM_SIMD_FOLD(simd_prefix_inclusive_sum, PREFIX_IN, T(0), a + b)
#undef TSM_SIMD_FOLD
// On a vector, each component is reduced on its own (as Metal's simd_sum of a vector does).
#ifdef TSM_STRICT_ADDRESS_SPACES
// The strict pass only type-checks, with clang's built-in vectors: declarations suffice.
#define TSM_SIMD_SUM_VEC(V) V simd_sum(V v);
TSM_SIMD_SUM_VEC(float2) TSM_SIMD_SUM_VEC(float4) TSM_SIMD_SUM_VEC(half2) TSM_SIMD_SUM_VEC(half4)
TSM_SIMD_SUM_VEC(bfloat2) TSM_SIMD_SUM_VEC(bfloat4)
TSM_SIMD_SUM_VEC(int2) TSM_SIMD_SUM_VEC(int4) TSM_SIMD_SUM_VEC(uint2) TSM_SIMD_SUM_VEC(uint4)
#undef TSM_SIMD_SUM_VEC
#endif
template <typename T>
inline tsm_vec2<T> simd_sum(tsm_vec2<T> v) {
  return tsm_vec2<T>(simd_sum(v.x), simd_sum(v.y));
}
template <typename T>
inline tsm_vec4<T> simd_sum(tsm_vec4<T> v) {
  return tsm_vec4<T>(simd_sum(v.x), simd_sum(v.y), simd_sum(v.z), simd_sum(v.w));
}
// Reading an inactive (exited) or out-of-range lane is undefined in Metal; here it returns the caller's
// own value, as the shuffle_up/down family does for lanes without a source.
template <typename T>
inline T tsm_shuffle_from(T v, int kind, unsigned (*src_of)(unsigned lane, unsigned arg), unsigned arg) {
  unsigned lane, mask;
  auto s = tsm_detail::exchange(v, kind, &lane, &mask);
  unsigned src = src_of(lane, arg);
  return (src < TSM_SIMD_WIDTH && (mask >> src & 1u)) ? tsm_detail::slot<T>(s, src) : v;
}
namespace tsm_detail {
inline unsigned src_index(unsigned, unsigned i) { return i; }
inline unsigned src_down(unsigned l, unsigned d) { return l + d; }
inline unsigned src_up(unsigned l, unsigned d) { return d > l ? ~0u : l - d; }
inline unsigned src_xor(unsigned l, unsigned m) { return l ^ m; }
}  // namespace tsm_detail
#define TSM_SHUFFLE(NAME, KIND, SRC_OF)                                              \
  template <typename T, typename I>                                                  \
  inline T NAME(T v, I arg) {                                                        \
    return tsm_shuffle_from(v, tsm_detail::KIND, tsm_detail::SRC_OF, unsigned(arg)); \
  }
TSM_SHUFFLE(simd_shuffle, SHUFFLE, src_index)
TSM_SHUFFLE(simd_broadcast, SHUFFLE, src_index)
TSM_SHUFFLE(simd_shuffle_down, SHUFFLE_DOWN, src_down)
TSM_SHUFFLE(simd_shuffle_up, SHUFFLE_UP, src_up)
TSM_SHUFFLE(simd_shuffle_xor, SHUFFLE_XOR, src_xor)
#undef TSM_SHUFFLE
template <typename T>
inline T simd_broadcast_first(T v) {
  unsigned lane, mask;
  auto s = tsm_detail::exchange(v, tsm_detail::BROADCAST_FIRST, &lane, &mask);
  return tsm_detail::slot<T>(s, unsigned(__builtin_ctz(mask)));
}
inline bool simd_all(bool b) {
  unsigned lane, mask;
  auto s = tsm_detail::exchange(int(b), tsm_detail::ALL, &lane, &mask);
  for (unsigned i = 0; i < TSM_SIMD_WIDTH; ++i)
    if ((mask >> i & 1u) && !tsm_detail::slot<int>(s, i)) return false;
  return true;
}
inline bool simd_any(bool b) {
  unsigned lane, mask;
  auto s = tsm_detail::exchange(int(b), tsm_detail::ANY, &lane, &mask);
  for (unsigned i = 0; i < TSM_SIMD_WIDTH; ++i)
    if ((mask >> i & 1u) && tsm_detail::slot<int>(s, i)) return true;
  return false;
}
inline void simdgroup_barrier(mem_flags) {
  unsigned lane, mask;
  tsm_detail::exchange(0, tsm_detail::SIMD_BARRIER, &lane, &mask);
}

// ------------------------------------------------------------------------------------ SIMD-group matrices
// The type is msl_common.h's: every lane holds the whole matrix. Each operation is a collective point of its
// SIMD-group, as on a GPU: all 32 lanes take part (none returned, the SIMD-group full) with the same arguments and
// the same operand values, or the dispatch fails. A load's 64 elements are read by the lanes two each (lane i: the
// elements 2i and 2i + 1 of the matrix in row-major order), as checked accesses (bounds, races and reads of
// unwritten threadgroup memory are the checker's, and the traffic model sees 32 lanes x 2 elements), then exchanged,
// so that every lane holds the whole matrix; a store writes each element once, by the lane that would have read it.
#ifdef TSM_STRICT_ADDRESS_SPACES
// The strict pass only type-checks: Metal's declarations, one overload per address space (device, threadgroup).
#define TSM_MATRIX_MEMORY(AS)                                                                                    \
  template <typename T, int Cols, int Rows>                                                                      \
  void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const AS T* src, ulong elements_per_row = Cols,        \
                      ulong2 matrix_origin = ulong2(), bool transpose_matrix = false);                           \
  template <typename T, int Cols, int Rows>                                                                      \
  void simdgroup_store(simdgroup_matrix<T, Cols, Rows> a, AS T* dst, ulong elements_per_row = Cols,              \
                       ulong2 matrix_origin = ulong2(), bool transpose_matrix = false);
TSM_ATOMIC_SPACES(TSM_MATRIX_MEMORY)
#undef TSM_MATRIX_MEMORY
template <typename Td, typename Ta, typename Tb, typename Tc, int Cols, int Rows, int K>
void simdgroup_multiply_accumulate(simdgroup_matrix<Td, Cols, Rows>& d, simdgroup_matrix<Ta, K, Rows>& a,
                                   simdgroup_matrix<Tb, Cols, K>& b, simdgroup_matrix<Tc, Cols, Rows>& c);
template <typename Td, typename Ta, typename Tb, int Cols, int Rows, int K>
void simdgroup_multiply(simdgroup_matrix<Td, Cols, Rows>& d, simdgroup_matrix<Ta, K, Rows>& a,
                        simdgroup_matrix<Tb, Cols, K>& b);
#else
namespace tsm_detail {
enum MatrixOp { LOAD = 1, STORE, MULTIPLY };
// FNV-1a over 8-byte words: the key a matrix operation's lanes must agree on.
__attribute__((no_sanitize_thread)) inline unsigned long long mix(unsigned long long h, const void* p,
                                                                 unsigned long bytes) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  for (unsigned long i = 0; i < bytes; i += 8) {
    unsigned long long w = 0;
    __builtin_memcpy(&w, c + i, bytes - i < 8 ? bytes - i : 8);
    h = (h ^ w) * 1099511628211ull;
  }
  return h;
}
inline unsigned long long memory_key(MatrixOp op, const void* p, unsigned long elements_per_row, ulong2 origin,
                                     bool transpose) {
  const unsigned long long words[6] = {(unsigned long long)op, (unsigned long long)p, elements_per_row, origin.x,
                                       origin.y, transpose ? 1ull : 0ull};
  return mix(1469598103934665603ull, words, sizeof(words));
}
// The collective of a matrix operation; returns the calling lane. Fails the dispatch unless every lane of a full
// SIMD-group arrived with the same key.
inline unsigned matrix_point(unsigned long long key, MatrixOp op) {
  unsigned lane, mask;
  const unsigned long long* s = exchange(key, MATRIX, &lane, &mask);
  if (mask != 0xffffffffu) {
    static const char* const partial[] = {"", "simdgroup_load without every lane of a full SIMD-group (a lane returned, "
                                          "or the threadgroup is not a multiple of 32 threads)",
                                          "simdgroup_store without every lane of a full SIMD-group (a lane returned, "
                                          "or the threadgroup is not a multiple of 32 threads)",
                                          "simdgroup_multiply(_accumulate) without every lane of a full SIMD-group (a "
                                          "lane returned, or the threadgroup is not a multiple of 32 threads)"};
    tsm_fail(partial[op]);
  }
  for (unsigned i = 0; i < TSM_SIMD_WIDTH; ++i) {
    if (slot<unsigned long long>(s, i) != key) {
      static const char* const differ[] = {"", "simdgroup_load: the lanes of a SIMD-group pass different arguments",
                                           "simdgroup_store: the lanes of a SIMD-group pass different arguments or "
                                           "hold different matrices",
                                           "simdgroup_multiply(_accumulate): the lanes of a SIMD-group hold different "
                                           "operands (a matrix filled with a per-lane value?)"};
      tsm_fail(differ[op]);
    }
  }
  return lane;
}
template <typename T>
struct pair {
  T first, second;
};
}  // namespace tsm_detail

template <typename T, int Cols, int Rows>
inline void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const T* src, ulong elements_per_row = Cols,
                           ulong2 matrix_origin = ulong2(), bool transpose_matrix = false) {
  static_assert(Rows * Cols == 2 * TSM_SIMD_WIDTH && sizeof(T) <= 4, "two elements per lane fit an exchange slot");
  const unsigned lane = tsm_detail::matrix_point(
      tsm_detail::memory_key(tsm_detail::LOAD, src, elements_per_row, matrix_origin, transpose_matrix),
      tsm_detail::LOAD);
  T mine[2];
  for (unsigned q = 0; q < 2; ++q) {
    const unsigned i = 2 * lane + q;
    mine[q] = src[tsm_matrix_offset(i / Cols, i % Cols, elements_per_row, matrix_origin, transpose_matrix)];
  }
  unsigned self, mask;
  const unsigned long long* s =
      tsm_detail::exchange(tsm_detail::pair<T>{mine[0], mine[1]}, tsm_detail::MATRIX, &self, &mask);
  for (unsigned l = 0; l < TSM_SIMD_WIDTH; ++l) {
    const tsm_detail::pair<T> two = tsm_detail::slot<tsm_detail::pair<T>>(s, l);
    d.e[(2 * l) / Cols][(2 * l) % Cols] = two.first;
    d.e[(2 * l + 1) / Cols][(2 * l + 1) % Cols] = two.second;
  }
}
template <typename T, int Cols, int Rows>
inline void simdgroup_store(simdgroup_matrix<T, Cols, Rows> a, T* dst, ulong elements_per_row = Cols,
                            ulong2 matrix_origin = ulong2(), bool transpose_matrix = false) {
  const unsigned long long key = tsm_detail::mix(
      tsm_detail::memory_key(tsm_detail::STORE, dst, elements_per_row, matrix_origin, transpose_matrix), a.e,
      sizeof(a.e));
  const unsigned lane = tsm_detail::matrix_point(key, tsm_detail::STORE);
  for (unsigned q = 0; q < 2; ++q) {
    const unsigned i = 2 * lane + q;
    dst[tsm_matrix_offset(i / Cols, i % Cols, elements_per_row, matrix_origin, transpose_matrix)] =
        a.e[i / Cols][i % Cols];
  }
}
template <typename Td, typename Ta, typename Tb, typename Tc, int Cols, int Rows, int K>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<Td, Cols, Rows>& d, simdgroup_matrix<Ta, K, Rows>& a,
                                          simdgroup_matrix<Tb, Cols, K>& b, simdgroup_matrix<Tc, Cols, Rows>& c) {
  unsigned long long key = tsm_detail::mix(tsm_detail::MULTIPLY, a.e, sizeof(a.e));
  key = tsm_detail::mix(tsm_detail::mix(key, b.e, sizeof(b.e)), c.e, sizeof(c.e));
  tsm_detail::matrix_point(key, tsm_detail::MULTIPLY);
  tsm_matrix_mad(d, a, b, &c);
}
template <typename Td, typename Ta, typename Tb, int Cols, int Rows, int K>
inline void simdgroup_multiply(simdgroup_matrix<Td, Cols, Rows>& d, simdgroup_matrix<Ta, K, Rows>& a,
                               simdgroup_matrix<Tb, Cols, K>& b) {
  const unsigned long long key = tsm_detail::mix(tsm_detail::mix(tsm_detail::MULTIPLY, a.e, sizeof(a.e)), b.e,
                                                 sizeof(b.e));
  tsm_detail::matrix_point(key, tsm_detail::MULTIPLY);
  tsm_matrix_mad(d, a, b, static_cast<const simdgroup_matrix<Td, Cols, Rows>*>(nullptr));
}
#endif
}  // namespace metal

// --------------------------------------------------------------------- binding helpers for entry points
namespace tsm_bind {
// Size of the scalar elements of a threadgroup declaration's type (float[32][33] -> 4): the unit of its checks.
template <typename T>
struct element {
  static constexpr unsigned long size = sizeof(T);
};
template <typename T, unsigned long N>
struct element<T[N]> {
  static constexpr unsigned long size = element<T>::size;
};
template <typename P>
struct arg;
template <typename T>
struct arg<T*> {
  static T* get(void* const p) { return static_cast<T*>(p); }
};
template <typename T>
struct arg<T&> {
  static T& get(void* const p) { return *static_cast<T*>(p); }
};
}  // namespace tsm_bind

// MSL has no double, and no standard library: make their use a compile error in the shader that follows.
#pragma GCC poison double
