// Compatibility header: lets nvcc compile unchanged Metal Shading Language kernels as CUDA C++, so that the
// Metal designs run (and are timed) on a real SIMT GPU. The Python driver (cuda.py) has already
//   - expanded the preprocessor (so instantiation macros are visible),
//   - turned `threadgroup T name[...]` storage declarations into `__shared__` ones,
//   - stripped Metal attributes and dropped the [[host_name]] instantiations,
//   - appended one `__global__` entry point per [[host_name]] that binds buffers and built-ins,
//   - erased the address-space keywords (`constant` becomes `const`): CUDA pointers are generic, and macros
//     for them would also erase the `device` inside CUDA's own `__device__`,
//   - made each `kernel` function a `__device__` function that its entry point calls.
// What remains for this header: scalar and vector types, metal::
// math, atomics, barriers and SIMD-group functions, mapped onto their CUDA counterparts. Apple's SIMD-group and
// NVIDIA's warp are both 32 threads formed from consecutive linear thread indices of a group, so a SIMD-group
// function is a warp-level primitive here. Anything not provided is a compile error, on purpose.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "tsm_abi.h"

// --------------------------------------------------------------------------------------------- scalars
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
// float(x) and T(float) convert with round-to-nearest-even (__float2half, __float2bfloat16), as Metal does.
typedef __half half;
typedef __nv_bfloat16 bfloat;
static_assert(sizeof(long) == 8, "MSL long is 64-bit");

// MSL's vector names collide with CUDA's built-in vector structs (float4, uint2, ...) and cuda_fp16.h's half2:
// the shader gets ours (every one renamed alike, bfloat's too).
#define float2 tsm_float2
#define float3 tsm_float3
#define float4 tsm_float4
#define half2 tsm_half2
#define half3 tsm_half3
#define half4 tsm_half4
#define bfloat2 tsm_bfloat2
#define bfloat3 tsm_bfloat3
#define bfloat4 tsm_bfloat4
#define int2 tsm_int2
#define int3 tsm_int3
#define int4 tsm_int4
#define uint2 tsm_uint2
#define uint3 tsm_uint3
#define uint4 tsm_uint4
#define short2 tsm_short2
#define short3 tsm_short3
#define short4 tsm_short4
#define ushort2 tsm_ushort2
#define ushort3 tsm_ushort3
#define ushort4 tsm_ushort4
#define ulong2 tsm_ulong2
#define ulong3 tsm_ulong3
#define ulong4 tsm_ulong4

#define TSM_FN __device__ inline
#include "msl_common.h"
static_assert(sizeof(metal::vec<half, 4>) == 8 && sizeof(metal::vec<bfloat, 4>) == 8, "4 x 16 bits, as in Metal");

namespace metal {
// -------------------------------------------------------------------------------------------- math
// CUDA's own overloads (float, int, ...), named here rather than defined anew: under `using namespace metal`, a
// shader's unqualified `sqrt(x)` then finds one function, where CUDA's global one and a metal:: one would clash.
using ::abs;
using ::ceil;
using ::exp;
using ::fabs;
using ::floor;
using ::fma;
using ::isinf;
using ::isnan;
using ::log;
using ::rsqrt;
using ::sqrt;
using ::tanh;

// ----------------------------------------------------------------------------------------- barriers
enum class mem_flags : unsigned { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
TSM_FN constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return static_cast<mem_flags>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}
// __syncthreads orders shared and global memory among the threads of a block: both of Metal's flags.
TSM_FN void threadgroup_barrier(mem_flags) { __syncthreads(); }
TSM_FN void simdgroup_barrier(mem_flags) { __syncwarp(__activemask()); }

// ------------------------------------------------------------------------------------------- atomics
enum memory_order { memory_order_relaxed = 0 };
template <typename T>
struct atomic {
  T value;
};
typedef atomic<float> atomic_float;
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
template <typename T>
struct tsm_identity {
  typedef T type;
};
template <typename T>
using tsm_nd = typename tsm_identity<T>::type;  // the value argument takes no part in deduction, as in MSL

template <typename T>
TSM_FN T atomic_load_explicit(const atomic<T>* a, memory_order) {
  return *reinterpret_cast<const volatile T*>(&a->value);
}
template <typename T>
TSM_FN void atomic_store_explicit(atomic<T>* a, tsm_nd<T> v, memory_order) {
  atomicExch(&a->value, v);
}
// The read-modify-writes that return the old value: CUDA_FN(&a->value, v), one of CUDA's atomic functions.
#define TSM_ATOMIC_RMW(NAME, CUDA_FN)                      \
  template <typename T>                                    \
  TSM_FN T NAME(atomic<T>* a, tsm_nd<T> v, memory_order) { \
    return CUDA_FN(&a->value, v);                          \
  }
TSM_ATOMIC_RMW(atomic_exchange_explicit, atomicExch)
TSM_ATOMIC_RMW(atomic_fetch_add_explicit, atomicAdd)
TSM_ATOMIC_RMW(atomic_fetch_sub_explicit, atomicSub)
TSM_ATOMIC_RMW(atomic_fetch_max_explicit, atomicMax)
TSM_ATOMIC_RMW(atomic_fetch_min_explicit, atomicMin)
#undef TSM_ATOMIC_RMW
template <typename T>
TSM_FN bool atomic_compare_exchange_weak_explicit(atomic<T>* a, T* expected, tsm_nd<T> desired, memory_order,
                                                  memory_order) {
  const T old = atomicCAS(&a->value, *expected, desired);
  const bool swapped = old == *expected;
  *expected = old;
  return swapped;
}

// ---------------------------------------------------------------------------------- SIMD-group functions
// Each acts on the lanes that are active, as in Metal: a full warp takes the shuffle tree; a partial one (a
// partial threadgroup's last SIMD-group, or lanes that returned) reads every active lane in turn.
TSM_FN unsigned tsm_lane() {
  unsigned l;
  asm("mov.u32 %0, %%laneid;" : "=r"(l));
  return l;
}
template <typename T, typename Op>
TSM_FN T tsm_simd_reduce(T v, Op op) {
  const unsigned m = __activemask();
  if (m == 0xffffffffu) {
    for (int off = 16; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(m, v, off));
    return v;
  }
  const int first = __ffs(m) - 1;
  T acc = __shfl_sync(m, v, first);
  for (int i = first + 1; i < 32; ++i)
    if (m >> i & 1u) acc = op(acc, __shfl_sync(m, v, i));
  return acc;
}
struct tsm_add {
  template <typename T>
  TSM_FN T operator()(T a, T b) const { return a + b; }
};
struct tsm_max {
  template <typename T>
  TSM_FN T operator()(T a, T b) const { return a < b ? b : a; }
};
struct tsm_min {
  template <typename T>
  TSM_FN T operator()(T a, T b) const { return b < a ? b : a; }
};
template <typename T> TSM_FN T simd_sum(T v) { return tsm_simd_reduce(v, tsm_add()); }
// On a vector, each component is reduced on its own; in a full warp the components' shuffle trees interleave.
template <typename V, int N>
TSM_FN V tsm_simd_sum_vec(V v) {
  const unsigned m = __activemask();
  if (m == 0xffffffffu) {
    for (int off = 16; off > 0; off >>= 1)
      for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(m, v[i], off);
    return v;
  }
  for (int i = 0; i < N; ++i) v[i] = tsm_simd_reduce(v[i], tsm_add());
  return v;
}
template <typename T> TSM_FN tsm_vec2<T> simd_sum(tsm_vec2<T> v) { return tsm_simd_sum_vec<tsm_vec2<T>, 2>(v); }
template <typename T> TSM_FN tsm_vec4<T> simd_sum(tsm_vec4<T> v) { return tsm_simd_sum_vec<tsm_vec4<T>, 4>(v); }
template <typename T> TSM_FN T simd_max(T v) { return tsm_simd_reduce(v, tsm_max()); }
template <typename T> TSM_FN T simd_min(T v) { return tsm_simd_reduce(v, tsm_min()); }
template <typename T>
TSM_FN T simd_prefix_inclusive_sum(T v) {
  const unsigned m = __activemask(), lane = tsm_lane();
  for (unsigned d = 1; d < 32; d <<= 1) {
    const T up = __shfl_up_sync(m, v, d);
    if (lane >= d && (m >> (lane - d) & 1u)) v += up;
  }
  return v;
}
template <typename T>
TSM_FN T simd_prefix_exclusive_sum(T v) {
  return simd_prefix_inclusive_sum(v) - v;
}
// Reading an inactive or out-of-range lane is undefined in Metal; here it returns the caller's own value.
template <typename T, typename I>
TSM_FN T simd_shuffle(T v, I lane) {
  const unsigned m = __activemask(), src = unsigned(lane);
  const T got = __shfl_sync(m, v, int(src & 31u));
  return src < 32u && (m >> src & 1u) ? got : v;
}
template <typename T, typename I>
TSM_FN T simd_broadcast(T v, I lane) {
  return simd_shuffle(v, lane);
}
template <typename T, typename I>
TSM_FN T simd_shuffle_xor(T v, I mask) {
  return simd_shuffle(v, tsm_lane() ^ unsigned(mask));
}
template <typename T, typename I>
TSM_FN T simd_shuffle_down(T v, I delta) {
  return simd_shuffle(v, tsm_lane() + unsigned(delta));
}
template <typename T, typename I>
TSM_FN T simd_shuffle_up(T v, I delta) {
  const unsigned lane = tsm_lane(), d = unsigned(delta);
  return simd_shuffle(v, d > lane ? 32u : lane - d);
}
template <typename T>
TSM_FN T simd_broadcast_first(T v) {
  return __shfl_sync(__activemask(), v, __ffs(__activemask()) - 1);
}
TSM_FN bool simd_all(bool b) { return __all_sync(__activemask(), b); }
TSM_FN bool simd_any(bool b) { return __any_sync(__activemask(), b); }

// ------------------------------------------------------------------------------------ SIMD-group matrices
// msl_common.h's type: every thread holds the whole matrix and computes whole products (no tensor cores: a
// translated kernel's time says nothing of Apple's matrix units, nor of an NVIDIA GPU's). A load reads the whole
// matrix in every lane; a store writes each element once (lane i: elements 2i and 2i + 1 in row-major order). The
// warp synchronises around both, so that a SIMD-group may read back what it stored, as with Metal's collective ops.
template <typename T, int Cols, int Rows>
TSM_FN void simdgroup_load(simdgroup_matrix<T, Cols, Rows>& d, const T* src, ulong elements_per_row = Cols,
                           ulong2 matrix_origin = ulong2(), bool transpose_matrix = false) {
  __syncwarp();
  for (unsigned r = 0; r < Rows; ++r)
    for (unsigned c = 0; c < Cols; ++c)
      d.e[r][c] = src[tsm_matrix_offset(r, c, elements_per_row, matrix_origin, transpose_matrix)];
}
template <typename T, int Cols, int Rows>
TSM_FN void simdgroup_store(simdgroup_matrix<T, Cols, Rows> a, T* dst, ulong elements_per_row = Cols,
                            ulong2 matrix_origin = ulong2(), bool transpose_matrix = false) {
  const unsigned lane = tsm_lane();
  for (unsigned q = 0; q < 2; ++q) {
    const unsigned i = 2 * lane + q;
    dst[tsm_matrix_offset(i / Cols, i % Cols, elements_per_row, matrix_origin, transpose_matrix)] =
        a.e[i / Cols][i % Cols];
  }
  __syncwarp();
}
template <typename Td, typename Ta, typename Tb, typename Tc, int Cols, int Rows, int K>
TSM_FN void simdgroup_multiply_accumulate(simdgroup_matrix<Td, Cols, Rows>& d, simdgroup_matrix<Ta, K, Rows>& a,
                                          simdgroup_matrix<Tb, Cols, K>& b, simdgroup_matrix<Tc, Cols, Rows>& c) {
  tsm_matrix_mad(d, a, b, &c);
}
template <typename Td, typename Ta, typename Tb, int Cols, int Rows, int K>
TSM_FN void simdgroup_multiply(simdgroup_matrix<Td, Cols, Rows>& d, simdgroup_matrix<Ta, K, Rows>& a,
                               simdgroup_matrix<Tb, Cols, K>& b) {
  tsm_matrix_mad(d, a, b, static_cast<const simdgroup_matrix<Td, Cols, Rows>*>(nullptr));
}
}  // namespace metal

// --------------------------------------------------------------------- binding helpers for entry points
// One kernel launch takes one tsm_cuda_args by value: per [[buffer(i)]], 16 bytes holding either a device
// pointer (a tensor, or a scalar the driver staged in device memory) or, where bit i of inline_mask is set, the
// scalar's own bytes (a Python int or float bound to a `constant T&`). A dispatch of a Metal grid is one launch
// of whole blocks when its group is 1-D (threads past the grid's end return at once), else launches of
// equal-sized groups (the partial groups at the grid's edges get launches of their own, so that their threads
// are numbered, and form SIMD-groups, exactly as Metal numbers them); `origin` is the position of a launch's
// first group in the grid of groups.
#define TSM_CUDA_MAX_BUFFERS 31
struct tsm_cuda_args {
  unsigned long long slot[TSM_CUDA_MAX_BUFFERS][2];
  unsigned inline_mask;
  unsigned grid[3];    // threads per grid
  unsigned group[3];   // requested threads per threadgroup
  unsigned origin[3];  // threadgroup position of this launch's first block
};

namespace tsm_bind {
template <typename P>
struct arg;
template <typename T>
struct arg<T*> {
  static __device__ inline T* get(unsigned long long w0, unsigned long long, bool) {
    return reinterpret_cast<T*>(w0);
  }
};
template <typename T>
struct arg<const T&> {  // `constant T&`: inline bytes or a pointer, read once
  static __device__ inline T get(unsigned long long w0, unsigned long long w1, bool inl) {
    if (!inl) return *reinterpret_cast<const T*>(w0);
    static_assert(sizeof(T) <= 16, "inline scalars hold at most 16 bytes");
    unsigned long long w[2] = {w0, w1};
    T v;
    memcpy(&v, w, sizeof(T));
    return v;
  }
};
template <typename T>
struct arg<T&> {  // `device T&`: always a pointer
  static __device__ inline T& get(unsigned long long w0, unsigned long long, bool) {
    return *reinterpret_cast<T*>(w0);
  }
};
}  // namespace tsm_bind

// The built-ins of this thread, in Metal's numbering; *inside is false for a thread past the grid's end (in a
// whole block launched for a partial 1-D group).
__device__ inline tsm_ids tsm_cuda_ids(const tsm_cuda_args& a, bool* inside) {
  tsm_ids t;
  const unsigned block[3] = {blockIdx.x, blockIdx.y, blockIdx.z};
  const unsigned tid[3] = {threadIdx.x, threadIdx.y, threadIdx.z};
  const unsigned dim[3] = {blockDim.x, blockDim.y, blockDim.z};
  unsigned size[3];
  *inside = true;
  for (int d = 0; d < 3; ++d) {
    const unsigned g = a.origin[d] + block[d];
    size[d] = min(dim[d], a.grid[d] - g * a.group[d]);  // the group's real size: smaller at the grid's end
    *inside = *inside && tid[d] < size[d];
    t.thread_position_in_threadgroup[d] = tid[d];
    t.threadgroup_position_in_grid[d] = g;
    t.threads_per_threadgroup[d] = size[d];
    t.dispatch_threads_per_threadgroup[d] = a.group[d];
    t.threads_per_grid[d] = a.grid[d];
    t.threadgroups_per_grid[d] = (a.grid[d] + a.group[d] - 1) / a.group[d];
    t.thread_position_in_grid[d] = g * a.group[d] + tid[d];
  }
  const unsigned linear = tid[0] + size[0] * (tid[1] + size[1] * tid[2]);
  const unsigned total = size[0] * size[1] * size[2];
  t.thread_index_in_threadgroup = linear;
  t.thread_index_in_simdgroup = linear % 32u;
  t.simdgroup_index_in_threadgroup = linear / 32u;
  t.simdgroups_per_threadgroup = (total + 31u) / 32u;
  t.threads_per_simdgroup = 32u;
  return t;
}

// The shader's own functions carry no execution space; on CUDA they must be device functions. MSL helpers are
// declared `inline` (or are templates of inline functions), so this gives each of them `__device__`.
#define inline __device__ inline
