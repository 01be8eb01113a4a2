// CUDA kernels of the csr_linear ops' vector layout, called by csr_linear_cuda.cu (docs/cuda.md, "Vector layout
// kernels").
//
// A vector feeds V consecutive outputs from one input, so the by-group view of the layer is, per group g, a small
// dense product: y[:, gV:gV+V] = x[:, S_g] . W_g, with S_g the group's k_g sources (src_by_dst over col_ptr[g] ..
// col_ptr[g+1]) and W_g the [k_g, V] rows of its vectors (weight[perm[k]]). Each gathered input row now serves V
// outputs instead of one, which is what lets tensor cores take over:
// - the input is transposed once per call into a feature-major, zero-padded xT [in_features, ldb], so that a
//   gathered source row is a contiguous run of batch values (except by the staged forward below);
// - forward (16-bit values, sm_80+), groups of few sources: a block copies a batch tile of x as it is into shared
//   memory and runs mma.sync per group on it, A fragments gathered from the staged rows (vec_forward_staged);
// - forward (16-bit values, sm_80+), otherwise: a block owns one group and a batch tile of 128; per step of 32
//   sources it stages the gathered xT rows and the W_g rows in shared memory with cp.async (3 stages in flight)
//   and runs mma.sync m16n8k16 (fp32 accumulate) with M = batch, N = V, K = sources; fragments come from
//   ldmatrix(.trans);
// - grad_w (16-bit, sm_80+): per group, G_g [k_g, V] = X^T[S_g, :] . grad_out[:, gV:gV+V], M = sources, N = V,
//   K = batch, the group's grad_out columns read batch-major straight from grad_out (V contiguous values a row);
// - grad_x (16-bit, sm_80+), both strategies, where two blocks of its tile fit an SM: each vector's contribution
//   W_j . grad_out[tile, group]^T on tensor cores into a shared-memory tile, then summed per source in order and
//   written batch-major (vec_grad_x_contrib); fused_atomic then adds grad_w atomically, without grad_x;
// - grad_x elsewhere, fused_atomic: the grad_w kernel also forms W_g [k_g, V] . grad_out^T[gV:gV+V, batch] (K = V)
//   and scatter-adds it into a float32 grad_x^T [in_features, ldb] with red.global.add (.v2 on sm_90): one pass,
//   the atomics go to grad_x and grad_w;
// - grad_x elsewhere, atomic_free: a warp owns a source and walks its vectors on CUDA cores, reading the V rows of
//   the vector's group from a feature-major copy of grad_out (every grad_x element written once, in a fixed order);
// - atomic_free's grad_w splits the batch into at most 8 ranges (so that small layers still fill the GPU), each
//   written exclusively to a float32 partial [split, vectors, V]; a last kernel sums the splits in order and
//   rounds once: deterministic.
// - float32, float64, and every dtype below sm_80, take CUDA-core kernels of the same shapes (a warp per group or
//   per source, a lane per batch element, V sums a lane).
// Index values are never read on the host: every index a kernel reads is clamped into its tensor and a bad one
// sets its array's error word, as in unstructured_csr_linear_cuda.cu (docs/architecture.md, "Index safety").
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string_view>
#include <type_traits>
#include <utility>

#include "../csr_linear_checks.h"
#include "cuda_common.cuh"

namespace torch_sparse_metal {
namespace {

// The padded batch of xT and of the float32 grad_x^T: a whole number of the tensor-core kernels' batch tiles.
constexpr int kBatchTile = 128;

// ------------------------------------------------------------------------------------------- shared pieces
// A by-group (or by-source) range [begin, end) clamped into [0, edges), as csr_linear's checked_range: a pointer
// array that does not start at 0, decreases, or does not end at `edges` sets `bad`.
__device__ __forceinline__ int2 checked_range(const int32_t* ptr, int r, int nrows, int edges, bool& bad) {
  const int b = ptr[r], e = ptr[r + 1];
  const int lo = min(static_cast<unsigned>(b), static_cast<unsigned>(edges));
  const int hi = min(max(e, lo), edges);
  bad = lo != b || hi != e || (r == 0 && b != 0) || (r == nrows - 1 && e != edges);
  return make_int2(lo, hi);
}

template <typename Acc>
__device__ __forceinline__ void atomic_add(Acc* p, Acc v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 600
  if constexpr (std::is_same_v<Acc, double>) {
    auto* word = reinterpret_cast<unsigned long long*>(p);
    unsigned long long old = *word, seen;
    do {
      seen = old;
      old = atomicCAS(word, seen, __double_as_longlong(__longlong_as_double(seen) + v));
    } while (old != seen);
    return;
  }
#endif
  atomicAdd(p, v);
}

// Two adjacent float32 sums, one vector reduction on sm_90 (8-byte aligned p).
__device__ __forceinline__ void atomic_add2(float* p, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(p), "f"(a), "f"(b) : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
#endif
}

// Four adjacent float32 sums, one vector reduction on sm_90 (16-byte aligned p).
__device__ __forceinline__ void atomic_add4(float* p, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(a), "f"(b), "f"(c), "f"(d)
               : "memory");
#else
  atomicAdd(p, a);
  atomicAdd(p + 1, b);
  atomicAdd(p + 2, c);
  atomicAdd(p + 3, d);
#endif
}

// The offsets where a kernel ran into a bad index: error words set once, at the kernel's end.
struct Errors {
  int* ptr;   // the pointer array read (col_ptr or row_ptr)
  int* idx;   // the gathered index (src_by_dst or dst)
  int* perm;  // perm (by-group kernels only)
  int* src_ptr = nullptr;  // row_ptr, where a by-group kernel also walks sources (vec_grad_x_contrib)
};

// v as Out: through float for the 16-bit types, unchanged where the types agree (double stays double).
template <typename Out, typename In>
__device__ __forceinline__ Out convert(In v) {
  if constexpr (std::is_same_v<In, Out>) {
    return v;
  } else {
    return narrow<Out>(widen<float>(v));
  }
}

// out[c, n] = in[n, c] (converted to Out) for n < rows, 0 for rows <= n < ld_out: the feature-major, zero-padded
// copy of a batch-major tensor (x, grad_out), and the way back for grad_x^T. Tiles of 64 x 64, threads 32 x 8,
// each thread moving two adjacent values a step: as one access where `pairs_in` / `pairs_out` say the rows allow
// it (even leading dimension, base aligned to two values), so that a warp reads and writes 64 values of a row. The
// shared tile's odd row stride keeps the column reads in distinct banks.
template <typename T>
struct alignas(2 * sizeof(T)) Pair {
  T a, b;
};

template <typename In, typename Out>
__global__ void __launch_bounds__(256)
    transpose_kernel(const In* __restrict__ in, Out* __restrict__ out, int rows, int cols, int ld_in, int ld_out,
                     bool pairs_in, bool pairs_out) {
  __shared__ Out tile[64][65];
  const int c0 = blockIdx.x * 64, n0 = blockIdx.y * 64, tx = threadIdx.x;
#pragma unroll
  for (int i = threadIdx.y; i < 64; i += 8) {
    const int n = n0 + i, c = c0 + 2 * tx;
    Out v0 = convert<Out>(0.0f), v1 = convert<Out>(0.0f);
    if (n < rows) {
      if (pairs_in && c + 1 < cols) {
        const Pair<In> q = *reinterpret_cast<const Pair<In>*>(in + int64_t(n) * ld_in + c);
        v0 = convert<Out>(q.a);
        v1 = convert<Out>(q.b);
      } else {
        if (c < cols) v0 = convert<Out>(in[int64_t(n) * ld_in + c]);
        if (c + 1 < cols) v1 = convert<Out>(in[int64_t(n) * ld_in + c + 1]);
      }
    }
    tile[i][2 * tx] = v0;
    tile[i][2 * tx + 1] = v1;
  }
  __syncthreads();
#pragma unroll
  for (int i = threadIdx.y; i < 64; i += 8) {
    const int c = c0 + i, n = n0 + 2 * tx;
    if (c >= cols) continue;
    Out* o = out + int64_t(c) * ld_out + n;
    if (pairs_out && n + 1 < ld_out) {
      *reinterpret_cast<Pair<Out>*>(o) = Pair<Out>{tile[2 * tx][i], tile[2 * tx + 1][i]};
    } else {
      if (n < ld_out) o[0] = tile[2 * tx][i];
      if (n + 1 < ld_out) o[1] = tile[2 * tx + 1][i];
    }
  }
}

// gw[i] = sum over splits s (in order) of partial[s, i], rounded once: atomic_free's grad_w.
template <typename T, typename Acc>
__global__ void __launch_bounds__(256) reduce_splits_kernel(const Acc* __restrict__ partial, T* __restrict__ gw,
                                                            int64_t n, int splits) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  Acc s = partial[i];
  for (int k = 1; k < splits; ++k) s += partial[k * n + i];
  gw[i] = narrow<T>(s);
}

// Arguments of the vector kernels. xT [in, ldb] feature-major; go [batch, groups*V] batch-major grad_out.
template <typename T, typename Acc>
struct VecParams {
  const int32_t* ptr;       // col_ptr (by-group kernels) or row_ptr (by-source kernel)
  const int32_t* idx;       // src_by_dst or dst
  const int32_t* perm;      // by-group position -> vector
  const T* w;               // [vectors, V]
  const T* xt;              // [in, ldb]
  const T* go;              // [batch, out]
  T* y;                     // forward output [batch, out], or grad_x [batch, in]
  Acc* gw;                  // grad_w: float partial [splits, vectors, V] or the atomic sum [vectors, V]
  Acc* gxt;                 // fused_atomic: grad_x^T [in, ldb], summed with atomics
  Errors err;
  int batch, in, groups, vectors, ldb;
  int split_steps;          // batch tiles per split (grad_w kernels: of kBatchTile rows, or vec_grad_w_tiles' tiles)
  const T* x;               // [batch, in] batch-major input (the staged forward, vec_grad_w_tiles)
  const int32_t* src_ptr;   // row_ptr beside the by-group arrays (vec_grad_x_contrib)
  bool atomic_gw = false;   // vec_grad_w_tiles: grad_w added atomically (else written to the split's partial)
};

// ----------------------------------------------------------------------------------- CUDA-core kernels
constexpr int kSimtWarps = 8;

// The V values of a weight row (16-byte aligned: V * sizeof(T) is a multiple of 16 for every listed V and dtype)
// in the accumulate type, read as 16-byte words.
template <typename T, typename Acc, int V>
__device__ __forceinline__ void load_row(const T* p, Acc (&out)[V]) {
  constexpr int kWords = V * int(sizeof(T)) / 16, kPer = 16 / int(sizeof(T));
  static_assert(kWords * 16 == V * int(sizeof(T)), "weight rows are whole 16-byte words");
#pragma unroll
  for (int i = 0; i < kWords; ++i) {
    const uint4 q = reinterpret_cast<const uint4*>(p)[i];
    T v[kPer];
    memcpy(v, &q, 16);
#pragma unroll
    for (int e = 0; e < kPer; ++e) out[i * kPer + e] = widen<Acc>(v[e]);
  }
}

// Forward: warp = one group, lane = one batch element of a chunk of 32 (grid.y); V sums a lane.
template <typename T, typename Acc, int V>
__global__ void __launch_bounds__(kSimtWarps * 32) vec_forward_simt(const VecParams<T, Acc> p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = blockIdx.x * kSimtWarps + warp;
  if (g >= p.groups) return;
  const int n = blockIdx.y * 32 + lane;
  bool bad = false;
  unsigned seen_src = 0, seen_perm = 0;
  const int2 r = checked_range(p.ptr, g, p.groups, p.vectors, bad);
  Acc acc[V];
#pragma unroll
  for (int l = 0; l < V; ++l) acc[l] = Acc(0);
  for (int k = r.x; k < r.y; ++k) {
    const int s = checked_index(p.idx[k], p.in, seen_src), j = checked_index(p.perm[k], p.vectors, seen_perm);
    const Acc xv = widen<Acc>(p.xt[int64_t(s) * p.ldb + n]);
    Acc wr[V];
    load_row<T, Acc, V>(p.w + int64_t(j) * V, wr);
#pragma unroll
    for (int l = 0; l < V; ++l) acc[l] += wr[l] * xv;
  }
  if (n < p.batch) {
    T* out = p.y + int64_t(n) * p.groups * V + int64_t(g) * V;
#pragma unroll
    for (int l = 0; l < V; ++l) out[l] = narrow<T>(acc[l]);
  }
  if (lane == 0 && bad) *p.err.ptr = 1;
  if (seen_src >= unsigned(p.in)) *p.err.idx = 1;
  if (seen_perm >= unsigned(p.vectors)) *p.err.perm = 1;
}

// atomic_free's grad_w: warp = one group and one batch split (grid.y). Lane (row, l) = (lane / V, lane % V): the
// warp covers R = 32 / V batch rows and the V columns of the group, so that its grad_out reads are R contiguous runs
// of V values (from L1: the group's columns serve all its vectors). Per vector, a lane sums its column's products
// over its rows, the R rows are added at the end, and the split's sums go, exclusively, to its partial.
template <typename T, typename Acc, int V>
__global__ void __launch_bounds__(kSimtWarps * 32) vec_grad_w_simt(const VecParams<T, Acc> p) {
  constexpr int R = 32 / V;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, l = lane % V, row = lane / V;
  const int g = blockIdx.x * kSimtWarps + warp;
  if (g >= p.groups) return;
  bool bad = false;
  unsigned seen_src = 0, seen_perm = 0;
  const int2 r = checked_range(p.ptr, g, p.groups, p.vectors, bad);
  const int out = p.groups * V;
  const int n_lo = blockIdx.y * p.split_steps * kBatchTile;
  const int n_hi = min(n_lo + p.split_steps * kBatchTile, p.batch);
  const T* gcol = p.go + int64_t(g) * V + l;
  for (int k = r.x; k < r.y; ++k) {
    const int s = checked_index(p.idx[k], p.in, seen_src), j = checked_index(p.perm[k], p.vectors, seen_perm);
    const T* xr = p.xt + int64_t(s) * p.ldb;
    Acc d = Acc(0);
    for (int n = n_lo + row; n < n_hi; n += R) d += widen<Acc>(xr[n]) * widen<Acc>(gcol[int64_t(n) * out]);
#pragma unroll
    for (int off = 16; off >= V; off >>= 1) d += __shfl_xor_sync(0xffffffffu, d, off);
    if (row == 0) p.gw[int64_t(blockIdx.y) * p.vectors * V + int64_t(j) * V + l] = d;
  }
  if (lane == 0 && bad) *p.err.ptr = 1;
  if (seen_src >= unsigned(p.in)) *p.err.idx = 1;
  if (seen_perm >= unsigned(p.vectors)) *p.err.perm = 1;
}

// fused_atomic on CUDA cores: warp = one group and 32 batch elements (grid.y), a lane holding its row's V grad_out
// values of the group. Per vector: grad_x^T[s, n] += W_j . grad_out[n, gV:gV+V] (a coalesced atomic a lane), and
// grad_w[j, :] += sum over the warp's rows of x[n, s] * grad_out[n, gV:gV+V] (one reduce-scatter, V atomics).
template <typename T, typename Acc, int V>
__global__ void __launch_bounds__(kSimtWarps * 32) vec_fused_simt(const VecParams<T, Acc> p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = blockIdx.x * kSimtWarps + warp;
  if (g >= p.groups) return;
  bool bad = false;
  unsigned seen_src = 0, seen_perm = 0;
  const int2 r = checked_range(p.ptr, g, p.groups, p.vectors, bad);
  const int n = blockIdx.y * 32 + lane;
  const bool valid = n < p.batch;
  Acc gy[V];
  if (valid) {
    load_row<T, Acc, V>(p.go + int64_t(n) * p.groups * V + int64_t(g) * V, gy);
  } else {
#pragma unroll
    for (int l = 0; l < V; ++l) gy[l] = Acc(0);
  }
  for (int k = r.x; k < r.y; ++k) {
    const int s = checked_index(p.idx[k], p.in, seen_src), j = checked_index(p.perm[k], p.vectors, seen_perm);
    const Acc xv = widen<Acc>(p.xt[int64_t(s) * p.ldb + n]);  // zero beyond the batch (padded xT)
    Acc wr[V], d[V];
    load_row<T, Acc, V>(p.w + int64_t(j) * V, wr);
    Acc gx = Acc(0);
#pragma unroll
    for (int l = 0; l < V; ++l) {
      gx += wr[l] * gy[l];
      d[l] = xv * gy[l];
    }
    if (valid) atomic_add(p.gxt + int64_t(s) * p.ldb + n, gx);
    warp_reduce_scatter<V>(d, lane);
    if (lane < V) atomic_add(p.gw + int64_t(j) * V + lane, d[0]);
  }
  if (lane == 0 && bad) *p.err.ptr = 1;
  if (seen_src >= unsigned(p.in)) *p.err.idx = 1;
  if (seen_perm >= unsigned(p.vectors)) *p.err.perm = 1;
}

// atomic_free pass 2, grad_x: warp = one source (8 consecutive sources a block), lanes over a chunk of 128 batch
// elements (grid.y), 4 a lane. Per vector of the source, the warp reads the V rows of its group from the
// feature-major grad_out^T (p.go here: [out, ldb]), each 128 contiguous values, and adds weight[j, l] times them.
// The 8 x 128 tile goes out batch-major through shared memory.
constexpr int kWalkP = 4;

template <typename T, typename Acc, int V>
__global__ void __launch_bounds__(kSimtWarps * 32) vec_grad_x_walk(const VecParams<T, Acc> p) {
  constexpr int P = kWalkP, CW = 32 * P;
  __shared__ Acc tile[kSimtWarps][CW + 1];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int s0 = blockIdx.x * kSimtWarps, s = s0 + warp, n0 = blockIdx.y * CW;
  bool bad = false;
  unsigned seen_dst = 0;
  Acc acc[P];
#pragma unroll
  for (int q = 0; q < P; ++q) acc[q] = Acc(0);
  if (s < p.in) {
    const int2 r = checked_range(p.ptr, s, p.in, p.vectors, bad);
    for (int j = r.x; j < r.y; ++j) {
      const int g = checked_index(p.idx[j], p.groups, seen_dst);
      Acc wr[V];
      load_row<T, Acc, V>(p.w + int64_t(j) * V, wr);
      const T* base = p.go + int64_t(g) * V * p.ldb + n0 + lane * P;
      T v[V][P];
#pragma unroll
      for (int l = 0; l < V; ++l) load_vec<T, P>(base + int64_t(l) * p.ldb, v[l]);
#pragma unroll
      for (int l = 0; l < V; ++l)
#pragma unroll
        for (int q = 0; q < P; ++q) acc[q] += wr[l] * widen<Acc>(v[l][q]);
    }
  }
#pragma unroll
  for (int q = 0; q < P; ++q) tile[warp][lane * P + q] = acc[q];
  __syncthreads();
  const int rows_here = min(kSimtWarps, p.in - s0);
  for (int idx = threadIdx.x; idx < kSimtWarps * CW; idx += kSimtWarps * 32) {
    const int i = idx % kSimtWarps, b = idx / kSimtWarps, n = n0 + b;
    if (i < rows_here && n < p.batch) p.y[int64_t(n) * p.in + s0 + i] = narrow<T>(tile[i][b]);
  }
  if (bad) *p.err.ptr = 1;
  if (seen_dst >= unsigned(p.groups)) *p.err.idx = 1;
}

// ---------------------------------------------------------------------------------- tensor-core kernels
// mma.sync / ldmatrix / cp.async (sm_80+). Below sm_80 the kernels compile to a trap; the host never launches
// them there (use_tensor_cores).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
#define TSM_VECTOR_MMA 1
#endif

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared, asynchronously; zero-filled (nothing read) when !valid.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
#ifdef TSM_VECTOR_MMA
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_u32(smem)), "l"(gmem),
               "r"(valid ? 16 : 0));
#endif
}
__device__ __forceinline__ void cp_async_commit() {
#ifdef TSM_VECTOR_MMA
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
#ifdef TSM_VECTOR_MMA
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// ldmatrix: lane t gives the address of row t % 8 of matrix t / 8; without .trans lane t receives (row t/4,
// columns 2(t%4), 2(t%4)+1) of each matrix, with .trans (rows 2(t%4), 2(t%4)+1, column t/4).
template <bool kTrans>
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p) {
#ifdef TSM_VECTOR_MMA
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_u32(p)));
  }
#endif
}
template <bool kTrans>
__device__ __forceinline__ void ldsm_x2(uint32_t (&r)[2], const void* p) {
#ifdef TSM_VECTOR_MMA
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_u32(p)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1])
                 : "r"(smem_u32(p)));
  }
#endif
}

// c += a . b, m16n8k16 (a: 4 registers, b: 2) or m16n8k8 (a: 2, b: 1), fp32 accumulate.
template <typename T>
__device__ __forceinline__ void mma_k16(float (&c)[4], const uint32_t* a, const uint32_t* b) {
#ifdef TSM_VECTOR_MMA
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#endif
}
template <typename T>
__device__ __forceinline__ void mma_k8(float (&c)[4], const uint32_t* a, const uint32_t* b) {
#ifdef TSM_VECTOR_MMA
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b[0]));
  } else {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5}, {%6}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b[0]));
  }
#endif
}

template <typename T>
__device__ __forceinline__ void store2(T* p, float a, float b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
  } else {
    *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
  }
}

// Row stride (values) of a shared tile whose rows are V values wide: +8 values (16 bytes) where 8 rows of ldmatrix
// would otherwise meet in the same banks.
template <int V>
constexpr int padded_row() {
  return V >= 16 ? V + 8 : V;
}

// B fragments (K16 x N8) of every n-tile for the K16 step at row k0 of a [K][N] row-major shared tile `t` of
// stride `ld`: ldmatrix.trans (rows are K); matrices (k0, n 0-7), (k0+8, n 0-7), (k0, n 8-15), (k0+8, n 8-15), ...
template <typename T, int NT>
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[NT][2], const T* t, int ld, int k0, int lane) {
  if constexpr (NT == 1) {
    uint32_t r[2];
    ldsm_x2<true>(r, t + (k0 + (lane % 8) + 8 * ((lane / 8) % 2)) * ld);
    b[0][0] = r[0];
    b[0][1] = r[1];
  } else {
#pragma unroll
    for (int np = 0; np < NT / 2; ++np) {
      uint32_t r[4];
      ldsm_x4<true>(r, t + (k0 + (lane % 8) + 8 * ((lane / 8) % 2)) * ld + np * 16 + 8 * (lane / 16));
      b[2 * np][0] = r[0];
      b[2 * np][1] = r[1];
      b[2 * np + 1][0] = r[2];
      b[2 * np + 1][1] = r[3];
    }
  }
}

// A fragment (16 x 16, row-major) at (m0, k0) of a [M][K] row-major shared tile: ldmatrix without .trans.
template <typename T>
__device__ __forceinline__ void load_a_mk(uint32_t (&a)[4], const T* t, int ld, int m0, int k0, int lane) {
  ldsm_x4<false>(a, t + (m0 + (lane % 8) + 8 * ((lane / 8) % 2)) * ld + k0 + 8 * (lane / 16));
}

// Forward tile: 4 warps, each 32 batch rows (two m16 tiles) of the block's 128; 32 sources a stage, 3 stages.
template <int V>
struct FwdTile {
  static constexpr int kWarps = 4, kMt = 2, kBt = kWarps * kMt * 16, kKs = 32, kStages = 3;
  static constexpr int kXs = kBt + 8;  // row stride of the staged xT rows: 16 bytes of skew per row
  static constexpr int kWs = padded_row<V>();
  static_assert(kBt == kBatchTile, "the forward's batch tile is the padding of xT");
};

template <typename T, int V>
__global__ void __launch_bounds__(FwdTile<V>::kWarps * 32) vec_forward_mma(const VecParams<T, float> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  using F = FwdTile<V>;
  constexpr int NT = V / 8;
  __shared__ __align__(16) T xs[F::kStages][F::kKs][F::kXs];
  __shared__ __align__(16) T ws[F::kStages][F::kKs][F::kWs];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = blockIdx.x, n0 = blockIdx.y * F::kBt;
  bool bad = false;
  unsigned seen_src = 0, seen_perm = 0;
  const int2 r = checked_range(p.ptr, g, p.groups, p.vectors, bad);
  const int steps = (r.y - r.x + F::kKs - 1) / F::kKs;

  auto load = [&](int slot, int step) {
    const int k0 = r.x + step * F::kKs;
    constexpr int kChunks = F::kBt / 8;  // 16-byte chunks of a staged row
    for (int i = tid; i < F::kKs * kChunks; i += F::kWarps * 32) {
      const int row = i / kChunks, c = i % kChunks, k = k0 + row;
      const bool valid = k < r.y;
      const int s = valid ? checked_index(p.idx[k], p.in, seen_src) : 0;
      cp_async16(&xs[slot][row][c * 8], p.xt + int64_t(s) * p.ldb + n0 + c * 8, valid);
    }
    for (int i = tid; i < F::kKs * NT; i += F::kWarps * 32) {
      const int row = i / NT, c = i % NT, k = k0 + row;
      const bool valid = k < r.y;
      const int j = valid ? checked_index(p.perm[k], p.vectors, seen_perm) : 0;
      cp_async16(&ws[slot][row][c * 8], p.w + int64_t(j) * V + c * 8, valid);
    }
  };

  float acc[F::kMt][NT][4];
#pragma unroll
  for (int mt = 0; mt < F::kMt; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;

#pragma unroll
  for (int st = 0; st < F::kStages - 1; ++st) {
    if (st < steps) load(st, st);
    cp_async_commit();
  }
  for (int step = 0; step < steps; ++step) {
    cp_async_wait<F::kStages - 2>();
    __syncthreads();  // the stage is complete for every thread, and the slot refilled below is no longer read
    const int next = step + F::kStages - 1;
    if (next < steps) load(next % F::kStages, next);
    cp_async_commit();
    const int slot = step % F::kStages;
#pragma unroll
    for (int kk = 0; kk < F::kKs; kk += 16) {
      uint32_t a[F::kMt][4], b[NT][2];
#pragma unroll
      for (int mt = 0; mt < F::kMt; ++mt) {
        // A[m = batch][k = source] = xs[k][m]: .trans; matrices (k, m 0-7), (k, m 8-15), (k+8, m 0-7), (k+8, m 8-15).
        const int m0 = warp * F::kMt * 16 + mt * 16;
        ldsm_x4<true>(a[mt], &xs[slot][kk + (lane % 8) + 8 * (lane / 16)][m0 + 8 * ((lane / 8) % 2)]);
      }
      load_b_kn<T, NT>(b, &ws[slot][0][0], F::kWs, kk, lane);
#pragma unroll
      for (int mt = 0; mt < F::kMt; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_k16<T>(acc[mt][nt], a[mt], b[nt]);
    }
  }
  cp_async_wait<0>();

  const int out = p.groups * V;
#pragma unroll
  for (int mt = 0; mt < F::kMt; ++mt) {
    const int n = n0 + warp * F::kMt * 16 + mt * 16 + lane / 4;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = g * V + nt * 8 + 2 * (lane % 4);
      if (n < p.batch) store2(p.y + int64_t(n) * out + col, acc[mt][nt][0], acc[mt][nt][1]);
      if (n + 8 < p.batch) store2(p.y + int64_t(n + 8) * out + col, acc[mt][nt][2], acc[mt][nt][3]);
    }
  }
  if (tid == 0 && bad) *p.err.ptr = 1;
  if (seen_src >= unsigned(p.in)) *p.err.idx = 1;
  if (seen_perm >= unsigned(p.vectors)) *p.err.perm = 1;
#endif
}

// Forward from a staged batch tile (16-bit values, sm_80+): a block owns kM = 16 * MT batch rows and every group
// of its grid.y share. It copies x[n0 .. n0+kM, :] into shared memory as it is (batch-major, cp.async): x is read
// once, and no transposed copy of it is written. Each warp then takes groups in turn and, per step of 16 of a
// group's sources, builds the A fragments (batch x gathered sources) from the staged rows value by value, the B
// fragments (sources x V) from the vectors' weight rows, and runs mma.sync m16n8k16. Those value-by-value loads
// (ldmatrix cannot gather columns) make a step dearer than the other kernel's, so the host takes this kernel only
// for groups of few sources on average (kStagedFanIn), where the transposed copy of x it saves costs more.
// The mean sources a group up to which the forward takes the staged kernel (VectorWork::staged_forward).
constexpr int kStagedFanIn = 32;

template <int MT>
struct StagedFwd {
  static constexpr int kWarps = 8, kM = 16 * MT;
  // Row stride in values: 16 bytes past the row, so that the rows of a fragment start in different banks.
  __host__ __device__ static int ld(int in) { return in + 8; }
  static size_t smem_bytes(int in) { return size_t(kM) * ld(in) * 2; }
};

__device__ __forceinline__ uint32_t pack2(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }

template <typename T, int V, int MT>
__global__ void __launch_bounds__(StagedFwd<MT>::kWarps * 32) vec_forward_staged(const VecParams<T, float> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  using F = StagedFwd<MT>;
  constexpr int NT = V / 8;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* xs = reinterpret_cast<T*>(smem_raw);
  const uint16_t* xv = reinterpret_cast<const uint16_t*>(smem_raw);
  const uint16_t* wv = reinterpret_cast<const uint16_t*>(p.w);
  const int ld = F::ld(p.in), chunks = p.in / 8;  // in % 8 == 0 (the host checks): whole 16-byte chunks a row
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int n0 = blockIdx.x * F::kM;
  for (int i = tid; i < F::kM * chunks; i += F::kWarps * 32) {
    const int row = i / chunks, c = i % chunks, n = n0 + row;
    const bool valid = n < p.batch;  // rows past the batch are zero-filled
    cp_async16(xs + row * ld + c * 8, p.x + int64_t(valid ? n : 0) * p.in + c * 8, valid);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();

  bool bad_any = false;
  unsigned seen_src = 0, seen_perm = 0;
  const int out = p.groups * V;
  const int qa = lane % 4, ra = lane / 4;  // fragment coordinates: source pair 2 qa (and +8), row / column ra
  for (int g = blockIdx.y * F::kWarps + warp; g < p.groups; g += F::kWarps * gridDim.y) {
    bool bad = false;
    const int2 r = checked_range(p.ptr, g, p.groups, p.vectors, bad);
    bad_any |= bad;
    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
    for (int kc = r.x; kc < r.y; kc += 32) {
      // 32 of the group's sources and vectors, one a lane, read together; each step takes its lane's from them.
      const int kl = kc + lane;
      const int s_lane = kl < r.y ? checked_index(p.idx[kl], p.in, seen_src) : 0;
      const int j_lane = kl < r.y ? checked_index(p.perm[kl], p.vectors, seen_perm) : 0;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int k0 = kc + 16 * half;
        if (k0 >= r.y) break;  // warp-uniform
        // This lane's four sources of the step, k0 + 2 qa + {0, 1, 8, 9}; past the group's end the A and B values are
        // zero (not the staged column 0, whose non-finite values would turn 0 * x into NaN).
        int s[4], j[4];
        bool v[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int from = 16 * half + 2 * qa + (e & 1) + 8 * (e >> 1);
          v[e] = kc + from < r.y;
          s[e] = __shfl_sync(0xffffffffu, s_lane, from);
          j[e] = __shfl_sync(0xffffffffu, j_lane, from);
        }
        uint32_t b[NT][2];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          uint16_t w[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) w[e] = v[e] ? wv[int64_t(j[e]) * V + nt * 8 + ra] : uint16_t(0);
          b[nt][0] = pack2(w[0], w[1]);
          b[nt][1] = pack2(w[2], w[3]);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint16_t* r0 = xv + (mt * 16 + ra) * ld;
          const uint16_t* r1 = r0 + 8 * ld;
          uint16_t x0[4], x1[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            x0[e] = v[e] ? r0[s[e]] : uint16_t(0);
            x1[e] = v[e] ? r1[s[e]] : uint16_t(0);
          }
          const uint32_t a[4] = {pack2(x0[0], x0[1]), pack2(x1[0], x1[1]), pack2(x0[2], x0[3]), pack2(x1[2], x1[3])};
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) mma_k16<T>(acc[mt][nt], a, b[nt]);
        }
      }
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int n = n0 + mt * 16 + ra;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int col = g * V + nt * 8 + 2 * qa;
        if (n < p.batch) store2(p.y + int64_t(n) * out + col, acc[mt][nt][0], acc[mt][nt][1]);
        if (n + 8 < p.batch) store2(p.y + int64_t(n + 8) * out + col, acc[mt][nt][2], acc[mt][nt][3]);
      }
    }
  }
  if (bad_any) *p.err.ptr = 1;
  if (seen_src >= unsigned(p.in)) *p.err.idx = 1;
  if (seen_perm >= unsigned(p.vectors)) *p.err.perm = 1;
#endif
}

// Backward tile: 4 warps, each 16 sources (one m16 tile) of the block's chunk of 64; batch steps of 64, staged as
// the chunk's gathered xT rows and the group's grad_out rows (V values each).
template <int V>
struct BwdTile {
  static constexpr int kWarps = 4, kMs = kWarps * 16, kBk = 64, kStages = V == 32 ? 2 : 3;
  static constexpr int kXs = kBk + 8;
  static constexpr int kGs = padded_row<V>();
  static_assert(kBatchTile % kBk == 0, "a batch tile is whole steps");
};

// grad_w of one group over the block's batch split (grid.y: split_steps tiles of kBatchTile), and with kGx grad_x
// by atomics into gxt. grad_w goes to p.gw: added atomically (kAtomicGw, fused_atomic) or written to the split's
// partial (atomic_free).
template <typename T, int V, bool kGx, bool kAtomicGw = kGx>
__global__ void __launch_bounds__(BwdTile<V>::kWarps * 32) vec_backward_mma(const VecParams<T, float> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  using B = BwdTile<V>;
  constexpr int NT = V / 8;
  __shared__ __align__(16) T xs[B::kStages][B::kMs][B::kXs];
  __shared__ __align__(16) T gs[B::kStages][B::kBk][B::kGs];
  __shared__ __align__(16) T ws[kGx ? B::kMs : 1][B::kGs];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = blockIdx.x;
  bool bad = false;
  unsigned seen_src = 0, seen_perm = 0;
  const int2 r = checked_range(p.ptr, g, p.groups, p.vectors, bad);
  const int out = p.groups * V;
  const int t_lo = blockIdx.y * p.split_steps * (kBatchTile / B::kBk);
  const int t_hi = min(t_lo + p.split_steps * (kBatchTile / B::kBk), p.ldb / B::kBk);
  const int steps = max(t_hi - t_lo, 0);
  const int m0 = warp * 16;

  for (int c0 = r.x; c0 < r.y; c0 += B::kMs) {
    auto load = [&](int slot, int t) {
      const int nb = t * B::kBk;
      constexpr int kChunks = B::kBk / 8;
      for (int i = tid; i < B::kMs * kChunks; i += B::kWarps * 32) {
        const int row = i / kChunks, c = i % kChunks, k = c0 + row;
        const bool valid = k < r.y;
        const int s = valid ? checked_index(p.idx[k], p.in, seen_src) : 0;
        cp_async16(&xs[slot][row][c * 8], p.xt + int64_t(s) * p.ldb + nb + c * 8, valid);
      }
      for (int i = tid; i < B::kBk * NT; i += B::kWarps * 32) {
        const int row = i / NT, c = i % NT, n = nb + row;
        const bool valid = n < p.batch;
        cp_async16(&gs[slot][row][c * 8], p.go + int64_t(valid ? n : 0) * out + int64_t(g) * V + c * 8, valid);
      }
    };
    if constexpr (kGx) {
      for (int i = tid; i < B::kMs * NT; i += B::kWarps * 32) {
        const int row = i / NT, c = i % NT, k = c0 + row;
        const bool valid = k < r.y;
        const int j = valid ? checked_index(p.perm[k], p.vectors, seen_perm) : 0;
        cp_async16(&ws[row][c * 8], p.w + int64_t(j) * V + c * 8, valid);
      }
    }
#pragma unroll
    for (int st = 0; st < B::kStages - 1; ++st) {
      if (st < steps) load(st, t_lo + st);
      cp_async_commit();  // the first group also carries ws
    }
    // The rows of this thread's accumulator fragments (c0/c1: row lane/4, c2/c3: row lane/4 + 8) and their sources.
    const int ka = c0 + m0 + lane / 4, kb = ka + 8;
    const bool va = ka < r.y, vb = kb < r.y;
    float gw_acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) gw_acc[nt][i] = 0.f;
    uint32_t wa[V / 16 > 0 ? V / 16 : 1][4];  // A fragments of W (kGx): per K16 step, or two registers at V = 8
    int sa = 0, sb = 0;
    if constexpr (kGx) {
      sa = va ? checked_index(p.idx[ka], p.in, seen_src) : 0;
      sb = vb ? checked_index(p.idx[kb], p.in, seen_src) : 0;
    }

    for (int step = 0; step < steps; ++step) {
      cp_async_wait<B::kStages - 2>();
      __syncthreads();
      if constexpr (kGx) {
        // W_g's chunk rows are in shared memory now: its A fragments (M = source, K = lane l).
        if (step == 0 && V == 8) {
          uint32_t t2[2];
          ldsm_x2<false>(t2, &ws[m0 + (lane % 8) + 8 * ((lane / 8) % 2)][0]);
          wa[0][0] = t2[0];
          wa[0][1] = t2[1];
        } else if (step == 0) {
#pragma unroll
          for (int kv = 0; kv < V / 16; ++kv) load_a_mk<T>(wa[kv], &ws[0][0], B::kGs, m0, kv * 16, lane);
        }
      }
      const int next = step + B::kStages - 1;
      if (next < steps) load(next % B::kStages, t_lo + next);
      cp_async_commit();
      const int slot = step % B::kStages;
      // grad_w: A[m = source][k = batch] = xs (row-major), B[k = batch][n = lane] = gs (.trans).
#pragma unroll
      for (int kk = 0; kk < B::kBk; kk += 16) {
        uint32_t a[4], b[NT][2];
        load_a_mk<T>(a, &xs[slot][0][0], B::kXs, m0, kk, lane);
        load_b_kn<T, NT>(b, &gs[slot][0][0], B::kGs, kk, lane);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma_k16<T>(gw_acc[nt], a, b[nt]);
      }
      if constexpr (kGx) {
        // grad_x^T[source][batch] += A[m = source][k = lane] (W_g) . B[k = lane][n = batch] = gs[n][k] (no .trans).
        const int nb = (t_lo + step) * B::kBk;
#pragma unroll
        for (int np = 0; np < B::kBk / 16; ++np) {
          float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
          if constexpr (V == 8) {
            uint32_t bq[2];
            // matrices (n 0-7, l 0-7), (n 8-15, l 0-7): one register each, n-tiles 2np and 2np+1.
            ldsm_x2<false>(bq, &gs[slot][np * 16 + (lane % 8) + 8 * ((lane / 8) % 2)][0]);
            mma_k8<T>(c[0], wa[0], &bq[0]);
            mma_k8<T>(c[1], wa[0], &bq[1]);
          } else {
#pragma unroll
            for (int kv = 0; kv < V / 16; ++kv) {
              uint32_t bq[4];
              // matrices (n 0-7, l 0-7), (n 0-7, l 8-15), (n 8-15, l 0-7), (n 8-15, l 8-15).
              ldsm_x4<false>(bq, &gs[slot][np * 16 + (lane % 8) + 8 * (lane / 16)][kv * 16 + 8 * ((lane / 8) % 2)]);
              mma_k16<T>(c[0], wa[kv], &bq[0]);
              mma_k16<T>(c[1], wa[kv], &bq[2]);
            }
          }
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            // Lanes 2i and 2i+1 hold columns 4i..4i+1 and 4i+2..4i+3 of rows ka and kb: one exchange gives the even
            // lane four columns of row ka and the odd lane four of row kb, added with one 16-byte reduction each.
            const bool odd = lane & 1;
            const float s0 = __shfl_xor_sync(0xffffffffu, odd ? c[h][0] : c[h][2], 1);
            const float s1 = __shfl_xor_sync(0xffffffffu, odd ? c[h][1] : c[h][3], 1);
            const int n = nb + np * 16 + h * 8 + 4 * ((lane % 4) / 2);
            if (!odd && va) atomic_add4(p.gxt + int64_t(sa) * p.ldb + n, c[h][0], c[h][1], s0, s1);
            if (odd && vb) atomic_add4(p.gxt + int64_t(sb) * p.ldb + n, s0, s1, c[h][2], c[h][3]);
          }
        }
      }
    }
    cp_async_wait<0>();
    // grad_w of the chunk's vectors: rows ka / kb (by-group positions), columns nt*8 + 2(lane%4).
    const int ja = va ? checked_index(p.perm[ka], p.vectors, seen_perm) : 0;
    const int jb = vb ? checked_index(p.perm[kb], p.vectors, seen_perm) : 0;
    float* base = p.gw + (kAtomicGw ? 0 : int64_t(blockIdx.y) * p.vectors * V);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int l = nt * 8 + 2 * (lane % 4);
      if constexpr (kAtomicGw) {
        if (va) atomic_add2(base + int64_t(ja) * V + l, gw_acc[nt][0], gw_acc[nt][1]);
        if (vb) atomic_add2(base + int64_t(jb) * V + l, gw_acc[nt][2], gw_acc[nt][3]);
      } else {
        if (va) *reinterpret_cast<float2*>(base + int64_t(ja) * V + l) = make_float2(gw_acc[nt][0], gw_acc[nt][1]);
        if (vb) *reinterpret_cast<float2*>(base + int64_t(jb) * V + l) = make_float2(gw_acc[nt][2], gw_acc[nt][3]);
      }
    }
    __syncthreads();  // xs, gs and ws are refilled by the next chunk
  }
  if (tid == 0 && bad) *p.err.ptr = 1;
  if (seen_src >= unsigned(p.in)) *p.err.idx = 1;
  if (seen_perm >= unsigned(p.vectors)) *p.err.perm = 1;
#endif
}

// grad_x on tensor cores (16-bit values, sm_80+; both strategies), read from grad_out as it is (batch-major) and
// written to grad_x as it is: no transposed copy of either and no atomics. A block owns a batch tile of kN = 8 * NB
// rows and first copies col_ptr and perm into shared memory (every group's range and vectors are read by every
// block).
// - Phase 1, warps taking groups in turn, kUnroll groups at once (their loads in flight together): the
//   contributions of a group's vectors to the tile,
//     C_g [k_g, kN] = W_g [k_g, V] . grad_out[tile, gV:gV+V]^T  (mma, M = the group's vectors, N = batch, K = V),
//   B fragments read straight from grad_out (a batch row's V values of the group are contiguous, the mma's column
//   order), A fragments from the vectors' weight rows; C row k is stored in shared memory under its vector's
//   by-source index perm[k]: contrib[j][n].
// - Phase 2, a lane per source: grad_x[n, s] = the sum of contrib[j][n] over the source's vectors, which are the
//   contiguous rows row_ptr[s] .. row_ptr[s+1], added in that order and rounded once (deterministic); a warp writes
//   32 adjacent sources of a batch row.
// The tile of contributions is the layer's vectors times kN floats, so the host takes this kernel where two blocks
// of it fit an SM (VectorWork::contrib_rows).
template <int NB>
struct GxTile {
  static constexpr int kWarps = 8, kN = 8 * NB, kUnroll = 4;
  // Row stride in floats: 4 past the row, so that 32 lanes reading 16 bytes of consecutive rows meet each bank the
  // fewest times (8 rows span the 32 banks).
  static constexpr int kStride = kN + 4;
  // contrib [vectors][kStride] floats, then perm [vectors] and col_ptr [groups + 1].
  static size_t smem_bytes(int vectors, int groups) {
    return (size_t(vectors) * (kStride + 1) + size_t(groups) + 1) * sizeof(float);
  }
};

template <typename T>
__device__ __forceinline__ uint32_t load_pair(const T* p, bool valid) {
  return valid ? *reinterpret_cast<const uint32_t*>(p) : 0u;
}

template <typename T, int V, int NB>
__global__ void __launch_bounds__(GxTile<NB>::kWarps * 32) vec_grad_x_contrib(const VecParams<T, float> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  using G = GxTile<NB>;
  constexpr int U = G::kUnroll, KS = V == 8 ? 1 : V / 16;  // K steps: m16n8k16, or one m16n8k8 at V = 8
  extern __shared__ __align__(16) float contrib[];
  int* const perm = reinterpret_cast<int*>(contrib + size_t(p.vectors) * G::kStride);
  int* const col_ptr = perm + p.vectors;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gq = lane / 4, tq = lane % 4;
  const int n0 = blockIdx.x * G::kN, out = p.groups * V;
  bool bad_group = false, bad_source = false;
  unsigned seen_perm = 0;
  // Zeros first: a vector no group lists (a perm that repeats an index) then adds nothing rather than stale values.
  for (int i = tid; i < p.vectors * G::kStride / 4; i += G::kWarps * 32)
    reinterpret_cast<float4*>(contrib)[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int i = tid; i < p.vectors; i += G::kWarps * 32) perm[i] = checked_index(p.perm[i], p.vectors, seen_perm);
  for (int i = tid; i <= p.groups; i += G::kWarps * 32) col_ptr[i] = p.ptr[i];
  __syncthreads();

  for (int g0 = warp; g0 < p.groups; g0 += G::kWarps * U) {
    // B[k = lane l][n = batch row] = grad_out[n0 + n][gV + l]: this lane's (rows 2tq, 2tq + 1 of each K8, column gq).
    uint32_t b[U][NB][KS][2];
    int2 r[U];
    int chunks = 0;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int g = g0 + u * G::kWarps;
      r[u] = make_int2(0, 0);
      if (g < p.groups) {
        bool bad = false;
        r[u] = checked_range(col_ptr, g, p.groups, p.vectors, bad);
        bad_group |= bad;
      }
      chunks = max(chunks, (r[u].y - r[u].x + 15) / 16);
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const int n = n0 + nb * 8 + gq;
        const bool valid = n < p.batch && g < p.groups;
        const T* row = p.go + (valid ? int64_t(n) * out + int64_t(g) * V : 0) + 2 * tq;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          b[u][nb][ks][0] = load_pair(row + ks * 16, valid);
          b[u][nb][ks][1] = V == 8 ? 0u : load_pair(row + ks * 16 + 8, valid);
        }
      }
    }
    for (int chunk = 0; chunk < chunks; ++chunk) {
      // A[m = vector k of the chunk][k = lane l] = weight[perm[k]][l]: rows gq and gq + 8 of this lane.
      uint32_t a[U][KS][4];
      int ja[U], jb[U];
      bool va[U], vb[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int ka = r[u].x + chunk * 16 + gq, kb = ka + 8;
        va[u] = ka < r[u].y;
        vb[u] = kb < r[u].y;
        ja[u] = va[u] ? perm[ka] : 0;
        jb[u] = vb[u] ? perm[kb] : 0;
        const T* wa = p.w + int64_t(ja[u]) * V + 2 * tq;
        const T* wb = p.w + int64_t(jb[u]) * V + 2 * tq;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
          a[u][ks][0] = load_pair(wa + ks * 16, va[u]);
          a[u][ks][1] = load_pair(wb + ks * 16, vb[u]);
          a[u][ks][2] = V == 8 ? 0u : load_pair(wa + ks * 16 + 8, va[u]);
          a[u][ks][3] = V == 8 ? 0u : load_pair(wb + ks * 16 + 8, vb[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (r[u].x + chunk * 16 >= r[u].y) continue;  // this group has no chunk left (the same for the whole warp)
        float c[NB][4];
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          c[nb][0] = c[nb][1] = c[nb][2] = c[nb][3] = 0.f;
#pragma unroll
          for (int ks = 0; ks < KS; ++ks) {
            if constexpr (V == 8) {
              mma_k8<T>(c[nb], a[u][0], b[u][nb][0]);
            } else {
              mma_k16<T>(c[nb], a[u][ks], b[u][nb][ks]);
            }
          }
        }
        // C: rows gq (vector ja) and gq + 8 (vector jb), batch columns nb * 8 + 2tq, + 1.
#pragma unroll
        for (int nb = 0; nb < NB; ++nb) {
          float* ca = contrib + ja[u] * G::kStride + nb * 8 + 2 * tq;
          float* cb = contrib + jb[u] * G::kStride + nb * 8 + 2 * tq;
          if (va[u]) *reinterpret_cast<float2*>(ca) = make_float2(c[nb][0], c[nb][1]);
          if (vb[u]) *reinterpret_cast<float2*>(cb) = make_float2(c[nb][2], c[nb][3]);
        }
      }
    }
  }
  __syncthreads();

  // Phase 2; the next source's range is read while this one is summed.
  int2 next = make_int2(0, 0);
  bool next_bad = false;
  if (warp * 32 + lane < p.in) next = checked_range(p.src_ptr, warp * 32 + lane, p.in, p.vectors, next_bad);
  for (int s0 = warp * 32; s0 < p.in; s0 += G::kWarps * 32) {
    const int s = s0 + lane;
    const int2 r = next;
    bad_source |= next_bad;
    if (s + G::kWarps * 32 < p.in) next = checked_range(p.src_ptr, s + G::kWarps * 32, p.in, p.vectors, next_bad);
    float acc[G::kN];
#pragma unroll
    for (int n = 0; n < G::kN; ++n) acc[n] = 0.f;
    for (int j = r.x; j < r.y; ++j) {
      const float4* row = reinterpret_cast<const float4*>(contrib + j * G::kStride);
#pragma unroll
      for (int q = 0; q < G::kN / 4; ++q) {
        const float4 v = row[q];
        acc[4 * q] += v.x;
        acc[4 * q + 1] += v.y;
        acc[4 * q + 2] += v.z;
        acc[4 * q + 3] += v.w;
      }
    }
#pragma unroll
    for (int n = 0; n < G::kN; ++n)
      if (s < p.in && n0 + n < p.batch) p.y[int64_t(n0 + n) * p.in + s] = narrow<T>(acc[n]);
  }
  if (bad_group) *p.err.ptr = 1;
  if (bad_source) *p.err.src_ptr = 1;
  if (seen_perm >= unsigned(p.vectors)) *p.err.perm = 1;
#endif
}

// The transpose of an 8 x 8 matrix of 16-bit values held as an mma fragment (lane t: row t / 4, columns 2(t % 4)
// and 2(t % 4) + 1, the lower half first).
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t v) {
  uint32_t r = v;
#ifdef TSM_VECTOR_MMA
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(r) : "r"(v));
#endif
  return r;
}

// grad_w from batch tiles of x as it is (16-bit values, sm_80+): no transposed copy of x is written or read. A
// block owns a range of batch tiles (grid.y) and a set of the groups (grid.x, the fast index: the sets' blocks of a
// range stream the same tiles of x at about the same time, the later ones from L2). Per tile of kRows rows it
// copies x[n0 .. n0+kRows, :] into shared memory as it is (cp.async; the next tile's copy in flight),
// and each warp adds, for each of its slots (16 consecutive by-group vectors of one group, an m16 tile),
//   G[k, l] += sum over the tile's rows n of x[n, src(k)] * grad_out[n, gV + l]   (mma, M = vectors, N = V, K = batch):
// A fragments gathered from the staged rows value by value (a vector's source is any column), B fragments read from
// grad_out as it is (a row's V values of the group are contiguous) and turned into the mma's column order by
// movmatrix, the next slot's already in flight. Warp w of set s takes the groups s + sets * (w + kWarps * i) and
// keeps its slots' sums in registers over the block's whole range; a warp holds kSlots of them, and where some warp
// of the block has more, the block walks its range again for the next kSlots (passes; the host picks the sets so
// that one pass is the rule). At the end each slot's sums are added atomically into grad_w (fused_atomic) or written
// to the range's partial [range, vectors, V] (atomic_free), which reduce_splits_kernel sums in order.
template <int V, int KT>
struct TileGw {
  static constexpr int kWarps = 8, kRows = 16 * KT, NT = V / 8;
  static constexpr int kSlots = 24 / NT;  // 16 x V sums a slot: 96 floats a lane in all
  // Row stride in values: 16 bytes past the row (cp.async writes whole 16-byte chunks; in % 8 == 0).
  __host__ __device__ static int ld(int in) { return in + 8; }
  // The slots' tables: per warp and slot, the 16 vectors' sources, then (group, first by-group position, end).
  static constexpr size_t kTableBytes = size_t(kWarps) * kSlots * (16 + 3) * sizeof(int);
  // Two tiles of x (the one in use, the next one's copy), then the tables.
  static size_t smem_bytes(int in) { return 2 * size_t(kRows) * ld(in) * 2 + kTableBytes; }
};
// Where the host takes vec_grad_w_tiles (VectorWork::tiles_plan): at most this many group sets, and groups of at
// most this many sources on average.
constexpr int kMaxTileSets = 2, kTilesFanIn = 32;

template <typename T, int V, int KT>
__global__ void __launch_bounds__(TileGw<V, KT>::kWarps * 32, 1) vec_grad_w_tiles(const VecParams<T, float> p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  using G = TileGw<V, KT>;
  constexpr int NT = G::NT, S = G::kSlots;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int ld = G::ld(p.in), chunks = p.in / 8, tile_values = G::kRows * ld;
  T* const xs = reinterpret_cast<T*>(smem_raw);
  int* const src_tab = reinterpret_cast<int*>(smem_raw + 2 * size_t(tile_values) * sizeof(T));
  int* const meta_tab = src_tab + G::kWarps * S * 16;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, gq = lane / 4, tq = lane % 4;
  int* const my_src = src_tab + warp * S * 16;
  int* const my_meta = meta_tab + warp * S * 3;
  const int set = blockIdx.x, sets = gridDim.x, out = p.groups * V;
  const int tiles = (p.batch + G::kRows - 1) / G::kRows;
  const int t_lo = blockIdx.y * p.split_steps, t_hi = min(t_lo + p.split_steps, tiles);
  bool bad_group = false;
  unsigned seen_src = 0, seen_perm = 0;

  // This warp's chunks; the block walks its range once per kSlots of the most any warp has.
  int mine = 0;
  for (int g = set + sets * warp; g < p.groups; g += sets * G::kWarps) {
    bool bad = false;
    const int2 r = checked_range(p.ptr, g, p.groups, p.vectors, bad);
    bad_group |= bad;
    mine += (r.y - r.x + 15) / 16;
  }
  __shared__ int most;
  if (tid == 0) most = 0;
  __syncthreads();
  if (lane == 0) atomicMax(&most, mine);
  __syncthreads();
  const int passes = (most + S - 1) / S;

  auto load_tile = [&](int slot, int t) {
    T* dst = xs + slot * tile_values;
    const int n0 = t * G::kRows;
    for (int i = tid; i < G::kRows * chunks; i += G::kWarps * 32) {
      const int row = i / chunks, c = i % chunks, n = n0 + row;
      const bool valid = n < p.batch;  // rows past the batch are zero-filled
      cp_async16(dst + row * ld + c * 8, p.x + int64_t(valid ? n : 0) * p.in + c * 8, valid);
    }
  };
  // B fragments of the group g for the tile at n0: b[kt][nt][h] = B[k = 16 kt + 8 h + 2tq, +1][n = gq] of n-tile nt,
  // B[k][n] = grad_out[n0 + k][gV + 8 nt + n]. Loaded as the fragment of its transpose (row gq, columns 2tq, +1:
  // two adjacent values of a grad_out row), turned by movmatrix where used.
  auto load_b = [&](uint32_t (&b)[KT][NT][2], int g, int n0) {
#pragma unroll
    for (int kt = 0; kt < KT; ++kt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = n0 + 16 * kt + 8 * h + gq;
        const bool valid = n < p.batch;
        const T* row = p.go + (valid ? int64_t(n) * out + int64_t(g) * V : 0) + 2 * tq;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) b[kt][nt][h] = load_pair(row + 8 * nt, valid);
      }
  };

  for (int pass = 0; pass < passes; ++pass) {
    // This pass's slots: the warp's chunks pass * S .. pass * S + S - 1, in group order.
    int used = 0, seen = 0;
    for (int g = set + sets * warp; g < p.groups && seen < (pass + 1) * S; g += sets * G::kWarps) {
      bool bad = false;
      const int2 r = checked_range(p.ptr, g, p.groups, p.vectors, bad);
      for (int c0 = r.x; c0 < r.y && seen < (pass + 1) * S; c0 += 16, ++seen) {
        if (seen < pass * S) continue;
        if (lane < 16) {
          const int k = c0 + lane;
          my_src[used * 16 + lane] = k < r.y ? checked_index(p.idx[k], p.in, seen_src) : 0;
        }
        if (lane == 0) {
          my_meta[used * 3] = g;
          my_meta[used * 3 + 1] = c0;
          my_meta[used * 3 + 2] = r.y;
        }
        ++used;
      }
    }
    __syncwarp();
    float acc[S][NT][4] = {};

    if (t_lo < t_hi) load_tile(0, t_lo);
    cp_async_commit();
    for (int t = t_lo; t < t_hi; ++t) {
      cp_async_wait<0>();
      __syncthreads();  // tile t is in; every warp is done with the tile before it
      const int buf = (t - t_lo) & 1;
      if (t + 1 < t_hi) load_tile(buf ^ 1, t + 1);
      cp_async_commit();
      const uint16_t* x0 = reinterpret_cast<const uint16_t*>(xs + buf * tile_values);
      const int n0 = t * G::kRows;
      uint32_t b[KT][NT][2], next[KT][NT][2];
      int g_cur = used > 0 ? my_meta[0] : 0;
      if (used > 0) load_b(next, g_cur, n0);
#pragma unroll
      for (int i = 0; i < S; ++i) {
        if (i >= used) break;  // warp-uniform
#pragma unroll
        for (int kt = 0; kt < KT; ++kt)
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            b[kt][nt][0] = next[kt][nt][0];
            b[kt][nt][1] = next[kt][nt][1];
          }
        if (i + 1 < used && my_meta[(i + 1) * 3] != g_cur) {  // the next slot's group: its loads in flight now
          g_cur = my_meta[(i + 1) * 3];
          load_b(next, g_cur, n0);
        }
        const int sa = my_src[i * 16 + gq], sb = my_src[i * 16 + gq + 8];
#pragma unroll
        for (int kt = 0; kt < KT; ++kt) {
          // A[m = vector][k = batch row] = x[n0 + k][src]: rows gq (sa) and gq + 8 (sb), k = 2tq, +1, +8, +9.
          const uint16_t* r0 = x0 + (16 * kt + 2 * tq) * ld;
          const uint16_t* r8 = r0 + 8 * ld;
          const uint32_t a[4] = {pack2(r0[sa], r0[ld + sa]), pack2(r0[sb], r0[ld + sb]), pack2(r8[sa], r8[ld + sa]),
                                 pack2(r8[sb], r8[ld + sb])};
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) {
            const uint32_t bb[2] = {movmatrix_trans(b[kt][nt][0]), movmatrix_trans(b[kt][nt][1])};
            mma_k16<T>(acc[i][nt], a, bb);
          }
        }
      }
    }
    cp_async_wait<0>();

    // The slots' sums: rows gq (vector ja) and gq + 8 (jb), columns 8 nt + 2tq, + 1.
    float* base = p.gw + (p.atomic_gw ? 0 : int64_t(blockIdx.y) * p.vectors * V);
#pragma unroll
    for (int i = 0; i < S; ++i) {
      if (i >= used) break;
      const int c0 = my_meta[i * 3 + 1], end = my_meta[i * 3 + 2];
      const int ka = c0 + gq, kb = ka + 8;
      const bool va = ka < end, vb = kb < end;
      const int ja = va ? checked_index(p.perm[ka], p.vectors, seen_perm) : 0;
      const int jb = vb ? checked_index(p.perm[kb], p.vectors, seen_perm) : 0;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int l = 8 * nt + 2 * tq;
        if (p.atomic_gw) {
          if (va) atomic_add2(base + int64_t(ja) * V + l, acc[i][nt][0], acc[i][nt][1]);
          if (vb) atomic_add2(base + int64_t(jb) * V + l, acc[i][nt][2], acc[i][nt][3]);
        } else {
          if (va) *reinterpret_cast<float2*>(base + int64_t(ja) * V + l) = make_float2(acc[i][nt][0], acc[i][nt][1]);
          if (vb) *reinterpret_cast<float2*>(base + int64_t(jb) * V + l) = make_float2(acc[i][nt][2], acc[i][nt][3]);
        }
      }
    }
    __syncthreads();  // the next pass refills the tiles and this warp's tables
  }
  if (bad_group) *p.err.ptr = 1;
  if (seen_src >= unsigned(p.in)) *p.err.idx = 1;
  if (seen_perm >= unsigned(p.vectors)) *p.err.perm = 1;
#endif
}

// ------------------------------------------------------------------------------------------------ host side
template <typename Body>
decltype(auto) dispatch_block(int64_t v, Body&& body) {
  switch (v) {
#define TSM_BLOCK_CASE(b) \
  case b:                 \
    return body(std::integral_constant<int, b>{});
    TSM_FOR_EACH_VECTOR_BLOCK(TSM_BLOCK_CASE)
#undef TSM_BLOCK_CASE
    default:
      TORCH_CHECK(false, "torch_sparse_metal: no CUDA vector kernel for blocks of ", v);
  }
}

int device_attribute(cudaDeviceAttr what, const at::Device& device) {
  int v = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&v, what, device.index()));
  return v;
}

// Tensor cores take the 16-bit types on sm_80 and later; everything else runs on CUDA cores.
// TORCH_SPARSE_METAL_VECTOR_CUDA_CORES=1 sends the 16-bit types to the CUDA-core kernels too, so that the tests
// run the path of GPUs before sm_80 on any GPU.
template <typename T>
bool use_tensor_cores(const at::Device& device) {
  if constexpr (!std::is_same_v<T, __nv_bfloat16> && !std::is_same_v<T, __half>) {
    return false;
  } else {
    const char* force = std::getenv("TORCH_SPARSE_METAL_VECTOR_CUDA_CORES");
    if (force != nullptr && std::string_view(force) == "1") return false;
    return device_attribute(cudaDevAttrComputeCapabilityMajor, device) >= 8;
  }
}

int sm_count(const at::Device& device) { return device_attribute(cudaDevAttrMultiProcessorCount, device); }

// Lets `kernel` take `bytes` of dynamic shared memory on `device` (above 48 KiB it must be allowed first). The
// largest size allowed so far is remembered per kernel and device, so that a launch's host work is one lookup.
void allow_dynamic_smem(const void* kernel, size_t bytes, const at::Device& device) {
  static std::mutex mutex;
  static std::map<std::pair<const void*, int>, size_t> allowed;
  const std::lock_guard<std::mutex> lock(mutex);
  size_t& have = allowed[{kernel, int(device.index())}];
  if (have >= bytes) return;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes)));
  have = bytes;
}

inline int64_t padded_batch(int64_t batch) { return (batch + kBatchTile - 1) / kBatchTile * kBatchTile; }

// A copy with 16-byte-aligned data where the tensor's own is not (cp.async reads 16-byte chunks of rows).
at::Tensor aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0 ? t : t.clone();
}

template <typename T>
bool pair_aligned(const T* p, int ld) {
  return ld % 2 == 0 && reinterpret_cast<uintptr_t>(p) % (2 * sizeof(T)) == 0;
}

template <typename In, typename Out>
void launch_transpose(const In* in, Out* out, int rows, int cols, int ld_in, int ld_out) {
  if (cols == 0 || ld_out == 0) return;
  const dim3 grid((cols + 63) / 64, (std::max(rows, ld_out) + 63) / 64);
  transpose_kernel<In, Out><<<grid, dim3(32, 8), 0, c10::cuda::getCurrentCUDAStream()>>>(
      in, out, rows, cols, ld_in, ld_out, pair_aligned(in, ld_in), pair_aligned(out, ld_out));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The feature-major, zero-padded [cols, ldb] copy of a contiguous [batch, cols] tensor.
template <typename T>
at::Tensor feature_major(const at::Tensor& x, int64_t ldb) {
  at::Tensor xt = at::empty({x.size(1), ldb}, x.options());
  launch_transpose<T, T>(device_ptr<T>(x), device_ptr<T>(xt), int(x.size(0)), int(x.size(1)), int(x.size(1)),
                         int(ldb));
  return xt;
}

// Batch splits of atomic_free's grad_w: enough blocks to fill the GPU about four times (`blocks` a split), at
// most 8 partials.
int grad_w_splits(int64_t blocks, int64_t ldb, const at::Device& device) {
  const int64_t tiles = ldb / kBatchTile;
  const int64_t want = (4 * int64_t(sm_count(device)) + blocks - 1) / std::max<int64_t>(blocks, 1);
  return int(std::clamp<int64_t>(want, 1, std::min<int64_t>(8, tiles)));
}

// The vector layout's work on one problem: the forward, and the backward with a member function per strategy of
// contract.h (run_strategy). grad_w goes to the call's accumulate-type buffer, zero-filled where the strategy adds into
// it.
template <typename T, typename Acc, int V>
class VectorWork {
 public:
  // `call` and `go` (grad_out, 16-byte aligned) only for the backward.
  VectorWork(const VecParams<T, Acc>& prm, const at::Device& dev, int64_t ldb, BackwardCall* call = nullptr,
             const at::Tensor& go = at::Tensor())
      : prm_(prm), dev_(dev), ldb_(ldb), mma_(tensor_cores(dev)), call_(call), go_(go) {}

  // `x`: the contiguous [batch, in] input. The staged kernel reads it as it is where a batch tile of it fits in
  // shared memory; the other kernels read its feature-major copy.
  void forward(const at::Tensor& x) {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    if constexpr (std::is_same_v<Acc, float> && sizeof(T) == 2) {
      if (mma_ && staged_forward(x, stream)) return;
    }
    const at::Tensor xt = feature_major<T>(x, ldb_);
    prm_.xt = device_ptr<T>(xt);
    if constexpr (std::is_same_v<Acc, float> && sizeof(T) == 2) {
      if (mma_) {
        vec_forward_mma<T, V><<<dim3(prm_.groups, ldb_ / kBatchTile), FwdTile<V>::kWarps * 32, 0, stream>>>(prm_);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return;
      }
    }
    const dim3 grid((prm_.groups + kSimtWarps - 1) / kSimtWarps, (prm_.batch + 31) / 32);
    vec_forward_simt<T, Acc, V><<<grid, kSimtWarps * 32, 0, stream>>>(prm_);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // On tensor cores where the contributions' tiles fit: grad_w added atomically, then grad_x by vec_grad_x_contrib
  // (batch-major, no grad_x^T to fill and transpose back). Otherwise one pass: grad_w and grad_x^T (float32 / Acc)
  // meet in atomic adds; then grad_x^T is rounded and transposed back to batch-major. One batch tile a block
  // (grid.y, the slow index): the blocks resident together then share a tile of xT (and grad_x^T) in L2.
  void fused_atomic() {
    prm_.gw = device_ptr<Acc>(call_->grad_w);
    if (const int rows = mma_ ? contrib_rows() : 0; rows > 0) {
      if (const auto plan = tiles_plan()) {
        launch_tiles(*plan, true);
      } else {
        grad_w<false, true>(int(ldb_ / kBatchTile));
      }
      contrib_grad_x(rows, c10::cuda::getCurrentCUDAStream());
      return;
    }
    at::Tensor gxt = at::zeros({prm_.in, ldb_}, call_->grad_w.options());
    prm_.gxt = device_ptr<Acc>(gxt);
    grad_w<true>(int(ldb_ / kBatchTile));
    launch_transpose<Acc, T>(device_ptr<Acc>(gxt), device_ptr<T>(call_->grad_x), prm_.in, prm_.batch, int(ldb_),
                             prm_.in);
  }

  // Pass 1: grad_w, each split's sums written once to its partial, summed in order; pass 2: grad_x, from the
  // vectors' contributions to a batch tile (tensor cores) or a warp per source.
  void atomic_free() {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    const auto plan = tiles_plan();
    const int splits = plan ? plan->ranges
                            : grad_w_splits(mma_ ? prm_.groups : (prm_.groups + kSimtWarps - 1) / kSimtWarps, ldb_,
                                            dev_);
    at::Tensor partial = empty_output({splits, prm_.vectors, V}, call_->grad_w.options());
    prm_.gw = device_ptr<Acc>(partial);
    int used = splits;
    if (plan) {
      launch_tiles(*plan, false);
    } else {
      used = grad_w<false>(splits);
    }
    const int64_t n = int64_t(prm_.vectors) * V;
    reduce_splits_kernel<Acc, Acc><<<unsigned((n + 255) / 256), 256, 0, stream>>>(
        device_ptr<Acc>(partial), device_ptr<Acc>(call_->grad_w), n, used);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    if (const int rows = mma_ ? contrib_rows() : 0; rows > 0) {
      contrib_grad_x(rows, stream);
      return;
    }
    const at::Tensor gt = feature_major<T>(go_, ldb_);  // [out, ldb]: a group's V rows, contiguous in batch
    VecParams<T, Acc> by_source = prm_;
    by_source.ptr = call_->row_ptr.const_data_ptr<int32_t>();
    by_source.idx = call_->dst.const_data_ptr<int32_t>();
    by_source.go = device_ptr<T>(gt);
    by_source.err = {error_word(dev_, IndexArray::row_ptr), error_word(dev_, IndexArray::dst), nullptr};
    const dim3 grid((prm_.in + kSimtWarps - 1) / kSimtWarps, ldb_ / (32 * kWalkP));
    vec_grad_x_walk<T, Acc, V><<<grid, kSimtWarps * 32, 0, stream>>>(by_source);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

 private:
  // The staged forward (vec_forward_staged), where x's rows are whole 16-byte chunks, a tile of 16 rows fits in
  // shared memory, and the groups have at most kStagedFanIn sources on average: its cost grows with the steps of 16
  // sources a group takes for every 16 batch rows, while the other kernel's transposed copy of x costs the same at
  // any density, and from about two steps a group on the transposed copy is the cheaper (docs/cuda.md). The tile:
  // the largest (16, 32 or 64 rows) that leaves room for two blocks an SM and still gives every SM two tiles; else
  // 16 rows, one block an SM. A small batch splits the groups over grid.y, so that the GPU still fills (each share
  // stages the tile again, from L2). Returns false where it does not apply.
  bool staged_forward(const at::Tensor& x, cudaStream_t stream) {
    if constexpr (std::is_same_v<Acc, float> && sizeof(T) == 2) {
      if (prm_.in % 8 != 0 || reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 != 0) return false;
      if (int64_t(prm_.vectors) > int64_t(kStagedFanIn) * prm_.groups) return false;
      const size_t optin = optin_smem();
      if (StagedFwd<1>::smem_bytes(prm_.in) > optin) return false;
      const int64_t sms = sm_count(dev_);
      auto fits = [&](size_t bytes, int rows) {
        return bytes <= optin / 2 - 1024 && (prm_.batch + rows - 1) / rows >= 2 * sms;
      };
      prm_.x = device_ptr<T>(x);
      if (fits(StagedFwd<4>::smem_bytes(prm_.in), 64)) {
        launch_staged<4>(stream);
        return true;
      }
      if (fits(StagedFwd<2>::smem_bytes(prm_.in), 32)) {
        launch_staged<2>(stream);
        return true;
      }
      launch_staged<1>(stream);
      return true;
    } else {
      return false;
    }
  }

  // grad_x by vec_grad_x_contrib where two blocks of its tile of the vectors' contributions fit an SM (16 batch
  // rows a tile, else 8); else the strategies take their other kernels. With one block an SM (a layer of many
  // vectors) the kernel waits on its loads, and it measured slower than fused_atomic's single pass (docs/cuda.md).
  int contrib_rows() const {
    if constexpr (std::is_same_v<Acc, float> && sizeof(T) == 2) {
      const size_t two_an_sm = optin_smem() / 2 - 1024;
      if (GxTile<2>::smem_bytes(prm_.vectors, prm_.groups) <= two_an_sm) return GxTile<2>::kN;
      if (GxTile<1>::smem_bytes(prm_.vectors, prm_.groups) <= two_an_sm) return GxTile<1>::kN;
    }
    return 0;
  }

  void contrib_grad_x(int rows, cudaStream_t stream) {
    if constexpr (std::is_same_v<Acc, float> && sizeof(T) == 2) {
      if (prm_.batch == 0) return;
      VecParams<T, Acc> p = prm_;
      p.src_ptr = call_->row_ptr.const_data_ptr<int32_t>();
      p.err.src_ptr = error_word(dev_, IndexArray::row_ptr);
      rows == GxTile<2>::kN ? launch_contrib<2>(p, stream) : launch_contrib<1>(p, stream);
    }
  }

  template <int NB>
  void launch_contrib(const VecParams<T, Acc>& p, cudaStream_t stream) {
    if constexpr (std::is_same_v<Acc, float> && sizeof(T) == 2) {
      using G = GxTile<NB>;
      const size_t smem = G::smem_bytes(p.vectors, p.groups);
      auto kernel = vec_grad_x_contrib<T, V, NB>;
      allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, dev_);
      kernel<<<unsigned((p.batch + G::kN - 1) / G::kN), G::kWarps * 32, smem, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }

  size_t optin_smem() const { return size_t(device_attribute(cudaDevAttrMaxSharedMemoryPerBlockOptin, dev_)); }

  template <int MT>
  void launch_staged(cudaStream_t stream) {
    if constexpr (std::is_same_v<Acc, float> && sizeof(T) == 2) {
      using F = StagedFwd<MT>;
      const size_t smem = F::smem_bytes(prm_.in);
      auto kernel = vec_forward_staged<T, V, MT>;
      allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, dev_);
      const int64_t tiles = (prm_.batch + F::kM - 1) / F::kM;
      const int64_t group_blocks = (prm_.groups + F::kWarps - 1) / F::kWarps;
      const int64_t shares = std::clamp<int64_t>((2 * sm_count(dev_) + tiles - 1) / tiles, 1, group_blocks);
      kernel<<<dim3(unsigned(tiles), unsigned(shares)), F::kWarps * 32, smem, stream>>>(prm_);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }

  static bool tensor_cores(const at::Device& dev) {
    if constexpr (std::is_same_v<Acc, float> && sizeof(T) == 2) {
      return use_tensor_cores<T>(dev);
    } else {
      return false;
    }
  }

  // grad_w over batch splits, and with kFused grad_x by atomics: the tensor-core kernel (a block per group and
  // split) or the CUDA-core one (a warp per group and split). kAtomicGw (tensor cores only) adds grad_w atomically
  // without grad_x. Returns the splits launched.
  template <bool kFused, bool kAtomicGw = kFused>
  int grad_w(int splits) {
    const auto stream = c10::cuda::getCurrentCUDAStream();
    xt_ = feature_major<T>(call_->x, ldb_);
    prm_.xt = device_ptr<T>(xt_);
    prm_.split_steps = int((ldb_ / kBatchTile + splits - 1) / splits);
    const int grid_y = int((ldb_ / kBatchTile + prm_.split_steps - 1) / prm_.split_steps);
    if constexpr (std::is_same_v<Acc, float> && sizeof(T) == 2) {
      if (mma_) {
        vec_backward_mma<T, V, kFused, kAtomicGw>
            <<<dim3(prm_.groups, grid_y), BwdTile<V>::kWarps * 32, 0, stream>>>(prm_);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        return grid_y;
      }
    }
    TORCH_INTERNAL_ASSERT(kFused == kAtomicGw, "grad_w without grad_x by atomics runs on tensor cores only");
    if constexpr (kFused) {
      vec_fused_simt<T, Acc, V><<<dim3((prm_.groups + kSimtWarps - 1) / kSimtWarps, (prm_.batch + 31) / 32),
                                  kSimtWarps * 32, 0, stream>>>(prm_);
    } else {
      vec_grad_w_simt<T, Acc, V>
          <<<dim3((prm_.groups + kSimtWarps - 1) / kSimtWarps, grid_y), kSimtWarps * 32, 0, stream>>>(prm_);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return grid_y;
  }

  // How vec_grad_w_tiles runs a call: k16 steps a tile, group sets, batch ranges and the tiles a range.
  struct TilesPlan {
    int kt, sets, ranges, steps;
  };

  // vec_grad_w_tiles where x's rows are whole 16-byte chunks, two tiles of x fit in shared memory (of 32 rows, else
  // 16), the groups hold at most kTilesFanIn sources on average and their slots fit in kMaxTileSets sets. Every set
  // reads all of x, and a warp reads a slot's grad_out values for every tile, so with a single tile in flight, more
  // sets or more slots a group, the transposed copy and the per-group kernel cost less (docs/cuda.md). The slots a
  // layer needs are estimated from its size (index values are never read on the host), with a tenth spare; a block
  // whose warps have more walks its range again. A range per SM, about.
  std::optional<TilesPlan> tiles_plan() const {
    if constexpr (std::is_same_v<Acc, float> && sizeof(T) == 2) {
      const at::Tensor& x = call_->x;
      if (!mma_ || prm_.in % 8 != 0 || reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 != 0) return std::nullopt;
      if (int64_t(prm_.vectors) > int64_t(kTilesFanIn) * prm_.groups) return std::nullopt;
      constexpr double kPerSet = TileGw<V, 1>::kWarps * TileGw<V, 1>::kSlots;
      const double slots = 1.1 * (double(prm_.vectors) / 16 + 0.5 * prm_.groups);
      const int sets = std::min(prm_.groups, std::max(1, int(std::ceil(slots / kPerSet))));
      if (sets > kMaxTileSets) return std::nullopt;
      const size_t optin = optin_smem() - 256;  // beside the kernel's static shared memory
      TilesPlan plan{0, sets, 0, 0};
      if (TileGw<V, 2>::smem_bytes(prm_.in) <= optin) {
        plan.kt = 2;
      } else if (TileGw<V, 1>::smem_bytes(prm_.in) <= optin) {
        plan.kt = 1;
      } else {
        return std::nullopt;
      }
      const int64_t tiles = (prm_.batch + 16 * plan.kt - 1) / (16 * plan.kt);
      const int64_t want = std::max<int64_t>(1, sm_count(dev_) / sets);
      plan.steps = int((tiles + want - 1) / want);
      plan.ranges = int((tiles + plan.steps - 1) / plan.steps);
      return plan;
    } else {
      return std::nullopt;
    }
  }

  void launch_tiles(const TilesPlan& plan, bool atomic) {
    plan.kt == 2 ? launch_tiles<2>(plan, atomic) : launch_tiles<1>(plan, atomic);
  }

  template <int KT>
  void launch_tiles(const TilesPlan& plan, bool atomic) {
    if constexpr (std::is_same_v<Acc, float> && sizeof(T) == 2) {
      VecParams<T, Acc> p = prm_;
      p.x = device_ptr<T>(call_->x);
      p.split_steps = plan.steps;
      p.atomic_gw = atomic;
      const size_t smem = TileGw<V, KT>::smem_bytes(p.in);
      auto kernel = vec_grad_w_tiles<T, V, KT>;
      allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem, dev_);
      kernel<<<dim3(unsigned(plan.sets), unsigned(plan.ranges)), TileGw<V, KT>::kWarps * 32, smem,
               c10::cuda::getCurrentCUDAStream()>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  }

  VecParams<T, Acc> prm_;
  at::Device dev_;
  int64_t ldb_;
  bool mma_;
  BackwardCall* call_;
  at::Tensor go_;
  at::Tensor xt_;  // the feature-major copy of x, where a backward kernel reads one
};

}  // namespace

template <>
void layout_forward_cuda<Layout::Vector>(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& col_ptr,
                                         const at::Tensor& src_by_dst, const at::Tensor& perm, at::Tensor& y) {
  const int64_t ldb = padded_batch(x.size(0));
  const at::Tensor xc = x.contiguous(), wc = aligned16(weight.contiguous());
  const at::Device dev = x.device();
  dispatch_value_type(x.scalar_type(), "csr_linear_cuda (vector)", [&](auto types) {
    using T = typename DeviceType<typename decltype(types)::T>::type;
    using Acc = typename decltype(types)::Acc;
    const VecParams<T, Acc> prm{col_ptr.const_data_ptr<int32_t>(),
                                src_by_dst.const_data_ptr<int32_t>(),
                                perm.const_data_ptr<int32_t>(),
                                device_ptr<T>(wc),
                                nullptr,
                                nullptr,
                                device_ptr<T>(y),
                                nullptr,
                                nullptr,
                                {error_word(dev, IndexArray::col_ptr), error_word(dev, IndexArray::src_by_dst),
                                 error_word(dev, IndexArray::perm)},
                                int(x.size(0)),
                                int(x.size(1)),
                                int(col_ptr.numel() - 1),
                                int(weight.size(0)),
                                int(ldb),
                                0};
    dispatch_block(weight.size(1), [&](auto block) {
      VectorWork<T, Acc, decltype(block)::value>(prm, dev, ldb).forward(xc);
    });
  });
}

template <>
void layout_backward_cuda<Layout::Vector>(BackwardCall& call, Strategy which) {
  const int64_t ldb = padded_batch(call.x.size(0));
  const at::Device dev = call.x.device();
  const at::Tensor wc = aligned16(call.weight), go = aligned16(call.grad_out);
  dispatch_value_type(call.x.scalar_type(), "csr_linear_backward_cuda (vector)", [&](auto types) {
    using T = typename DeviceType<typename decltype(types)::T>::type;
    using Acc = typename decltype(types)::Acc;
    const VecParams<T, Acc> prm{call.col_ptr.const_data_ptr<int32_t>(),
                                call.src_by_dst.const_data_ptr<int32_t>(),
                                call.perm.const_data_ptr<int32_t>(),
                                device_ptr<T>(wc),
                                nullptr,
                                device_ptr<T>(go),
                                device_ptr<T>(call.grad_x),
                                nullptr,
                                nullptr,
                                {error_word(dev, IndexArray::col_ptr), error_word(dev, IndexArray::src_by_dst),
                                 error_word(dev, IndexArray::perm)},
                                int(call.x.size(0)),
                                int(call.x.size(1)),
                                int(call.col_ptr.numel() - 1),
                                int(call.weight.size(0)),
                                int(ldb),
                                1};
    dispatch_block(call.weight.size(1), [&](auto block) {
      VectorWork<T, Acc, decltype(block)::value> work(prm, dev, ldb, &call, go);
      run_strategy(which, work);
    });
  });
}

}  // namespace torch_sparse_metal
