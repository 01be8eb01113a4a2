// CUDA kernels for the csr_linear ops (see docs/architecture.md for the contract, docs/cuda.md for the
// measurements behind the choices below).
//
// Every kernel is one CSR walk. A warp owns one CSR row (an output for the forward, a source for the backward)
// and one batch chunk of CW = 32 * P columns; lane l holds P consecutive batch elements. Per edge the warp
// reads one row of a feature-major operand (xT for the forward, gT for the backward): CW contiguous values.
//
// Why this shape:
// - The only operand read at random rows is the gathered one. It is transposed once per call into a
//   feature-major, zero-padded [features, ldb] buffer (one tiled transpose kernel) so that a gathered row is
//   CW contiguous values: vector loads, coalesced. The block's own rows (x for the SDDMM, y / grad_x for the
//   output) are read and written batch-major directly, transposed through shared memory, so they cost no
//   extra pass.
// - Four edges' rows are in flight per warp, read from L2. The batch chunks of a row run in separate blocks
//   of grid.y, so the blocks resident at one time share a chunk and its slice of the gathered operand stays
//   in L2.
// - That walk reads each gathered segment from L2 once per edge, which bounds the forward at large batches by
//   L2 throughput; there the forward stages a batch slice of the gathered operand in shared memory instead
//   (csr_row_tile_kernel: a thread per output row, so the 256 rows of a block share each staged value).
// - The weight gradient (an SDDMM) is a reduction per edge over the warp's batch chunk, then one atomicAdd
//   per (edge, chunk) in fused_atomic, or an exclusive read-modify-write in atomic_free pass 1, whose block
//   loops over all chunks itself. fused_atomic reduces 16 edges (8 at P = 8) at a time with one reduce-scatter
//   (lane u ends with edge u's sum); atomic_free pass 1 reduces each edge with a butterfly (the group of 16
//   measured slower there at 4096x4096, docs/cuda.md).
// - Values are stored as T and summed as Acc (contract.h: float32 for the 16-bit types). grad_w is summed in
//   an Acc buffer, which for 16-bit T is a scratch rounded to T once at the end.
// - Index values are not read on the host (that would wait for the GPU): every index a kernel reads is clamped
//   into its tensor, and a bad one sets the array's device error word (contract.h's TSM_FOR_EACH_INDEX_ARRAY),
//   which take_index_errors reads at the next check (docs/architecture.md, "Index safety").
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include "../csr_linear_checks.h"

namespace torch_sparse_metal {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

enum class Mode {
  SpMM,             // out[n, r] = sum_k val[k] * bt[col[k], n]
  SpMMSddmmAtomic,  // SpMM, and gw[k] += sum_n a[n, r] * bt[col[k], n] with atomics (fused_atomic)
  SddmmExclusive,   // gw[k] = sum_n a[n, r] * bt[col[k], n] over the whole batch, no atomics (atomic_free pass 1)
};

// The device types of c10's 16-bit value types (same layout), for the arithmetic of cuda_fp16.h / cuda_bf16.h.
template <typename T>
struct DeviceType {
  using type = T;
};
template <>
struct DeviceType<c10::Half> {
  using type = __half;
};
template <>
struct DeviceType<c10::BFloat16> {
  using type = __nv_bfloat16;
};

template <typename Acc, typename T>
__device__ __forceinline__ Acc widen(T v) {
  return static_cast<Acc>(v);
}
template <>
__device__ __forceinline__ float widen<float, __half>(__half v) {
  return __half2float(v);
}
template <>
__device__ __forceinline__ float widen<float, __nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}

template <typename T, typename Acc>
__device__ __forceinline__ T narrow(Acc v) {
  return static_cast<T>(v);
}
template <>
__device__ __forceinline__ __half narrow<__half, float>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16, float>(float v) {
  return __float2bfloat16_rn(v);
}

// v clamped into [0, limit) (compared unsigned, so negatives clamp too): a bad index cannot reach outside its
// tensor. `seen` keeps the largest value met; the kernel compares it with the limit once, at its end, and sets
// the error word then (two min/max per index, and no device store inside the edge loop, where it could alias
// the index loads and serialise them).
__device__ __forceinline__ int checked_index(int v, int limit, unsigned& seen) {
  seen = max(seen, static_cast<unsigned>(v));
  return min(static_cast<unsigned>(v), static_cast<unsigned>(limit - 1));
}

template <typename T, typename Acc>
struct Params {
  const int32_t* ptr;  // [nrows + 1] CSR row pointer
  const int32_t* col;  // [E] column (gathered feature) per edge, ascending within a row
  int* ptr_error;      // error words of ptr and col
  int* col_error;
  const T* val;        // [E] edge values (SpMM modes)
  const T* bt;         // [ncols, ldb] gathered operand, feature-major, zero beyond `batch`
  const T* a;          // [batch, nrows] batch-major row operand of the SDDMM
  T* out;              // [batch, nrows] batch-major SpMM output
  Acc* gw;             // [E] weight gradient, in the accumulate type
  int nrows, ncols, batch, ldb, edges;
};

// Row r's edge range [begin, end), clamped into [0, edges) with end >= begin; a pointer array that does not
// start at 0, decreases, or does not end at `edges` sets `bad`.
template <typename T, typename Acc>
__device__ __forceinline__ int2 checked_range(const Params<T, Acc>& p, int r, bool& bad) {
  const int b = p.ptr[r], e = p.ptr[r + 1];
  const int lo = min(static_cast<unsigned>(b), static_cast<unsigned>(p.edges));
  const int hi = min(max(e, lo), p.edges);  // signed: a negative end empties the row rather than reaching nnz
  bad = lo != b || hi != e || (r == 0 && b != 0) || (r == p.nrows - 1 && e != p.edges);
  return make_int2(lo, hi);
}

// P consecutive values as Acc, read with the widest aligned vector loads the width allows (callers keep the
// address aligned to P * sizeof(T)).
template <typename Acc, typename T, int P>
__device__ __forceinline__ void load_vec(const T* p, Acc (&v)[P]) {
  constexpr int kBytes = P * int(sizeof(T));
  T raw[P];
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      const float4 q = reinterpret_cast<const float4*>(p)[i];
      memcpy(reinterpret_cast<char*>(raw) + 16 * i, &q, 16);
    }
  } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 8; ++i) {
      const float2 q = reinterpret_cast<const float2*>(p)[i];
      memcpy(reinterpret_cast<char*>(raw) + 8 * i, &q, 8);
    }
  } else {
#pragma unroll
    for (int i = 0; i < P; ++i) raw[i] = p[i];
  }
#pragma unroll
  for (int i = 0; i < P; ++i) v[i] = widen<Acc>(raw[i]);
}

template <typename Acc>
__device__ __forceinline__ Acc warp_sum(Acc v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// v[u] is this lane's share of value u (G values, G a power of two <= 32); afterwards v[0] is the warp's total
// of value lane % G. Offsets W >= G add the partner's share of every value; offsets below G halve: a lane keeps
// the half of its values whose bit W matches its own lane bit and adds its partner's share of them. G values cost
// G * log2(32 / G) + G - 1 shuffles (31 for G = 16, 5 for G = 1). A template per step, not a loop: with a loop
// nvcc kept v in local memory.
template <int G, int W = 16, typename Acc>
__device__ __forceinline__ void warp_reduce_scatter(Acc (&v)[G], int lane) {
  if constexpr (W >= G) {
#pragma unroll
    for (int i = 0; i < G; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], W);
  } else {
    const bool upper = lane & W;
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const Acc send = upper ? v[i] : v[i + W];
      const Acc keep = upper ? v[i + W] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, W);
    }
  }
  if constexpr (W > 1) warp_reduce_scatter<G, W / 2>(v, lane);
}

// Resident blocks per SM the register allocation must allow: 2, and 3 for fused_atomic summing in float, whose 16
// SDDMM partial sums beside the SpMM's P would otherwise leave room for 2 blocks only; the third block hides more
// gather latency than the registers it costs (docs/cuda.md, "Registers of fused_atomic").
template <typename Acc>
constexpr int min_blocks(Mode m) {
  return m == Mode::SpMMSddmmAtomic && sizeof(Acc) == 4 ? 3 : 2;
}

// G: edges per SDDMM reduction (16: one reduce-scatter per group; 0: each edge reduced on its own).
template <typename T, typename Acc, int P, Mode M, int G>
__global__ void __launch_bounds__(kThreads, min_blocks<Acc>(M)) csr_tile_kernel(const Params<T, Acc> p) {
  constexpr int CW = 32 * P;  // batch columns per chunk
  constexpr int IO = CW + 1;  // padded row of the batch-major <-> feature-major tile: no bank conflicts
  constexpr bool kSpmm = M != Mode::SddmmExclusive;
  constexpr bool kSddmm = M != Mode::SpMM;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Acc* sm = reinterpret_cast<Acc*>(smem_raw);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r0 = blockIdx.x * kWarps, r = r0 + warp;
  bool bad_ptr = false;
  unsigned seen_col = 0;
  const int2 range = r < p.nrows ? checked_range(p, r, bad_ptr) : make_int2(0, 0);
  const int begin = range.x, end = range.y;
  const int rows_here = min(kWarps, p.nrows - r0);

  // SpMM modes: one chunk per block (grid.y); the exclusive SDDMM walks all chunks so that it owns its edges.
  const int chunk_lo = kSpmm ? blockIdx.y : 0, chunk_hi = kSpmm ? blockIdx.y + 1 : p.ldb / CW;
  for (int chunk = chunk_lo; chunk < chunk_hi; ++chunk) {
    const int n0 = chunk * CW, cols_here = min(CW, p.batch - n0);
    Acc xa[P], acc[P];
    if constexpr (kSddmm) {
      // a[n0 .. n0+CW, r0 .. r0+kWarps] -> sm[i][b] (threads run along i: coalesced global reads).
      for (int idx = threadIdx.x; idx < kWarps * CW; idx += kThreads) {
        const int i = idx % kWarps, b = idx / kWarps;
        sm[i * IO + b] = (i < rows_here && b < cols_here) ? widen<Acc>(p.a[int64_t(n0 + b) * p.nrows + r0 + i])
                                                          : Acc(0);
      }
      __syncthreads();
#pragma unroll
      for (int q = 0; q < P; ++q) xa[q] = sm[warp * IO + lane * P + q];
      __syncthreads();
    }
#pragma unroll
    for (int q = 0; q < P; ++q) acc[q] = Acc(0);

    // One edge's contributions from its gathered row segment g: the SpMM update, and this lane's part of the
    // SDDMM dot product; store_gw adds a finished dot product into grad_w.
    auto spmm_update = [&](Acc w, const Acc (&g)[P]) {
#pragma unroll
      for (int q = 0; q < P; ++q) acc[q] += w * g[q];
    };
    auto partial_dot = [&](const Acc (&g)[P]) {
      Acc d = Acc(0);
#pragma unroll
      for (int q = 0; q < P; ++q) d += xa[q] * g[q];
      return d;
    };
    auto store_gw = [&](int k, Acc d) {
      if constexpr (M == Mode::SpMMSddmmAtomic) {
        atomicAdd(p.gw + k, d);
      } else {
        p.gw[k] = chunk == 0 ? d : p.gw[k] + d;  // only this thread ever touches gw[k]
      }
    };
    auto value = [&](int k) { return kSpmm ? widen<Acc>(p.val[k]) : Acc(0); };

    const T* bt = p.bt + n0 + lane * P;
    if constexpr (kSddmm && G > 0) {
      // Groups of G edges: every lane keeps its partial dot product of each edge, and one reduce-scatter leaves
      // lane u with edge u's sum: 31 shuffles and one warp-wide store per 16 edges (G = 16) instead of 5
      // shuffles and a single-lane store per edge.
      constexpr int U = G < 4 ? G : 4;  // edges in flight: the gathered rows come from L2
      for (int kb = begin; kb < end; kb += G) {
        const int n = min(G, end - kb);  // warp-uniform
        Acc part[G];
#pragma unroll
        for (int u = 0; u < G; ++u) part[u] = Acc(0);
#pragma unroll
        for (int u0 = 0; u0 < G; u0 += U) {
          if (u0 < n) {
            int c[U];
            Acc g[U][P];
#pragma unroll
            for (int u = 0; u < U; ++u)
              c[u] = u0 + u < n ? checked_index(p.col[kb + u0 + u], p.ncols, seen_col) : 0;
#pragma unroll
            for (int u = 0; u < U; ++u)
              if (u0 + u < n) load_vec<Acc, T, P>(bt + int64_t(c[u]) * p.ldb, g[u]);
#pragma unroll
            for (int u = 0; u < U; ++u) {
              if (u0 + u < n) {
                if constexpr (kSpmm) spmm_update(value(kb + u0 + u), g[u]);
                part[u0 + u] = partial_dot(g[u]);
              }
            }
          }
        }
        warp_reduce_scatter<G>(part, lane);
        if (lane < n) store_gw(kb + lane, part[0]);
      }
    } else {
      auto edge = [&](int k, const Acc (&g)[P]) {
        if constexpr (kSpmm) spmm_update(value(k), g);
        if constexpr (kSddmm) {
          const Acc d = warp_sum(partial_dot(g));
          if (lane == 0) store_gw(k, d);
        }
      };
      int k = begin;
      // Four edges in flight per warp: the gathered rows come from L2, so latency needs hiding.
      for (; k + 4 <= end; k += 4) {
        int c[4];
        Acc g[4][P];
#pragma unroll
        for (int u = 0; u < 4; ++u) c[u] = checked_index(p.col[k + u], p.ncols, seen_col);
#pragma unroll
        for (int u = 0; u < 4; ++u) load_vec<Acc, T, P>(bt + int64_t(c[u]) * p.ldb, g[u]);
#pragma unroll
        for (int u = 0; u < 4; ++u) edge(k + u, g[u]);
      }
      for (; k < end; ++k) {
        Acc g[P];
        load_vec<Acc, T, P>(bt + int64_t(checked_index(p.col[k], p.ncols, seen_col)) * p.ldb, g);
        edge(k, g);
      }
    }

    if constexpr (kSpmm) {
      // acc -> sm[i][b] -> out[n0 + b, r0 + i] (threads run along i: coalesced global writes).
#pragma unroll
      for (int q = 0; q < P; ++q) sm[warp * IO + lane * P + q] = acc[q];
      __syncthreads();
      for (int idx = threadIdx.x; idx < kWarps * CW; idx += kThreads) {
        const int i = idx % kWarps, b = idx / kWarps;
        if (i < rows_here && b < cols_here) p.out[int64_t(n0 + b) * p.nrows + r0 + i] = narrow<T>(sm[i * IO + b]);
      }
    }
  }
  if (bad_ptr) *p.ptr_error = 1;
  if (seen_col >= static_cast<unsigned>(p.ncols)) *p.col_error = 1;
}

// The forward's SpMM at large batches (csr_row_tile_kernel): a thread per output row over a narrow batch slice
// whose panel of the gathered operand sits in shared memory.
//
// A block of 256 threads owns 256 consecutive output rows (thread t: row r0 + t) and one batch slice of S columns:
// 64 bytes of 16-bit values (S = 32) or float64 (S = 8), 128 bytes of float32 (S = 32), i.e. as many sums a
// thread as the register cap of three blocks an SM holds without spilling. It walks the input features in panels
// of K: xT[c0 .. c0 + K, n0 .. n0 + S] is staged in shared memory (cp.async, 16 bytes a thread, coalesced; two
// barriers a panel; 64 KB a block), and each thread adds the products of its row's edges whose column lies in the
// panel. A staged value serves 256 x density edges (12.8 at 5%) where the direct kernel reads it from L2 once per
// edge. What L2 still carries: the staging, in_features x slice bytes a block, and the indices, which a thread
// reads once per (row, slice), i.e. batch / S times per edge: 4 + sizeof(T) bytes of column and value per edge
// and slice, against the slice's bytes of gathered operand (64 in bf16, 128 in float32) that the direct kernel
// reads from L2 for the same products. Lanes read different rows, so those reads are uncoalesced: 16-byte loads of
// 4 edges' columns (and their values), the next group loaded while the current one is added.
//
// Bank conflicts: the 32 lanes of a warp read 16-byte chunks of 32 random staged features, and a 16-byte load is
// served a quarter-warp (8 lanes, 8 slots of 16 bytes: one 128-byte bank line) at a time. A staged feature takes a
// whole 128-byte line, a 64-byte slice stored twice (chunk j in slots j and j + 4). Lane l (q = l % 8) reads its
// chunks in the order of slots q ^ i, i = 0 .. C - 1, so the 8 lanes of a quarter-warp read 8 different slots
// whatever their rows: conflict-free. (A 64-byte row stride instead puts every row in one of two half-lines, and
// 8 random rows conflict 5-way on average.) The lane's sums are permuted to match (sum block i holds chunk
// (q % C) ^ i), which keeps every register index static; the output goes back through shared memory in order.
//
// Columns are read from the row in order, and the walk stops at the first column at or past the panel's end, so
// with ascending columns (every valid topology) each edge is added from shared memory in its panel. It does not
// depend on that order: an edge whose column lies below the current panel (a row whose columns decrease) is read
// from global memory instead, and the last panel takes every edge left, so every edge is added exactly once.
//
// Rows of a warp have different degrees (205 +- 14 at 4096 x 5%), so lanes idle at the end of the shorter rows
// of each panel; at these densities that costs ~10%.
constexpr int kRowTileFeatures = 512;  // K: features a panel, kRowTileLine bytes each
constexpr int kRowTileLine = 128;      // shared-memory bytes of a staged feature: a bank line
constexpr int kRowTileBlocksPerSm = 3;

template <typename T>
constexpr int row_tile_slice_bytes() {
  return sizeof(T) == 4 ? 128 : 64;  // S = 32 float sums a thread (16-bit, float32), 8 doubles (float64)
}
template <typename T>
constexpr int row_tile_slice() {  // S
  return row_tile_slice_bytes<T>() / int(sizeof(T));
}

// 16 bytes global -> shared without registers (cached in L1: a 64-byte slice's two copies read the same bytes).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;\n" ::"r"(
                   static_cast<unsigned>(__cvta_generic_to_shared(smem))),
               "l"(gmem));
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

template <typename T, typename Acc>
__global__ void __launch_bounds__(kThreads, kRowTileBlocksPerSm) csr_row_tile_kernel(const Params<T, Acc> p) {
  constexpr int kBytes = row_tile_slice_bytes<T>(), C = kBytes / 16, E = 16 / int(sizeof(T)), S = C * E;
  constexpr int kCopies = kRowTileLine / kBytes, K = kRowTileFeatures;
  constexpr int IO = S + 1;  // padded row of the output buffer: conflict-free reads by consecutive threads
  extern __shared__ __align__(128) unsigned char tile_smem[];

  const int q = threadIdx.x % 8, qc = q % C;  // position in the quarter-warp; the chunk read first
  const int r0 = blockIdx.x * kThreads, r = r0 + threadIdx.x, n0 = blockIdx.y * S;
  bool bad_ptr = false;
  unsigned seen_col = 0;
  const int2 range = r < p.nrows ? checked_range(p, r, bad_ptr) : make_int2(0, 0);
  const int end = range.y;

  // Edges g .. g + 3 (aligned to 4, so possibly a neighbour row's too: those are never added): columns clamped,
  // values as loaded (4 values in kValWords words).
  constexpr int kValWords = int(sizeof(T));
  struct Group {
    int col[4];
    unsigned val[kValWords];
  };
  auto load_group = [&](int g, Group& d) {
    if (g + 4 <= p.edges) {
      const int4 c = *reinterpret_cast<const int4*>(p.col + g);
      d.col[0] = c.x, d.col[1] = c.y, d.col[2] = c.z, d.col[3] = c.w;
      if constexpr (kValWords == 2) {
        const uint2 v = *reinterpret_cast<const uint2*>(p.val + g);
        d.val[0] = v.x, d.val[1] = v.y;
      } else {
#pragma unroll
        for (int i = 0; i < kValWords; i += 4) {
          const uint4 v = reinterpret_cast<const uint4*>(p.val + g)[i / 4];
          d.val[i] = v.x, d.val[i + 1] = v.y, d.val[i + 2] = v.z, d.val[i + 3] = v.w;
        }
      }
    } else {  // the array's last group
      T v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = min(g + u, p.edges - 1);
        d.col[u] = p.col[e];
        v[u] = p.val[e];
      }
      memcpy(d.val, v, sizeof(v));
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) d.col[u] = checked_index(d.col[u], p.ncols, seen_col);
  };
  auto value = [](const Group& d, int u) {
    T v;
    memcpy(&v, reinterpret_cast<const char*>(d.val) + u * sizeof(T), sizeof(T));
    return widen<Acc>(v);
  };
  int k = range.x, g = k & ~3;  // the first edge not yet added; its group
  Group cur{}, next{};          // group g and the one after it
  if (k < end) load_group(g, cur);
  if (g + 4 < end) load_group(g + 4, next);

  Acc acc[S];
#pragma unroll
  for (int i = 0; i < S; ++i) acc[i] = Acc(0);
  auto add_chunk = [&](int i, Acc w, const float4& raw) {  // sum block i += w * 16 bytes of T
    T t[E];
    memcpy(t, &raw, 16);
#pragma unroll
    for (int e = 0; e < E; ++e) acc[i * E + e] += w * widen<Acc>(t[e]);
  };

  const int panels = (p.ncols + K - 1) / K;
  for (int t = 0; t < panels; ++t) {
    const int c0 = t * K, width = min(K, p.ncols - c0);
    __syncthreads();  // every thread is done with the previous panel
    // Chunk j of feature f into slots j + C * ((m + f) % kCopies): the 8 threads of a quarter-warp write 8
    // different slots. cp.async: every load in flight at once, and no registers for them.
#pragma unroll 1
    for (int idx = threadIdx.x; idx < width * C; idx += kThreads) {
      const int f = idx / C, j = idx % C;
      const T* src = p.bt + int64_t(c0 + f) * p.ldb + n0 + j * E;
#pragma unroll
      for (int m = 0; m < kCopies; ++m)
        cp_async16(tile_smem + f * kRowTileLine + 16 * (j + C * ((m + f) % kCopies)), src);
    }
    cp_async_wait_all();
    __syncthreads();

    // The row's edges from k on while their columns lie below the panel's end.
    auto add_edge = [&](int c, Acc w) {
      if (c >= c0) {
        const unsigned char* line = tile_smem + (c - c0) * kRowTileLine;
#pragma unroll
        for (int i = 0; i < C; ++i) add_chunk(i, w, *reinterpret_cast<const float4*>(line + 16 * (q ^ i)));
      } else {  // an earlier panel's column: the row is not ascending
        const T* src = p.bt + int64_t(c) * p.ldb + n0;
#pragma unroll
        for (int i = 0; i < C; ++i) add_chunk(i, w, __ldg(reinterpret_cast<const float4*>(src + (qc ^ i) * E)));
      }
    };
    while (k < end) {
      bool stop = false;
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int e = g + u;
        if (!stop && e >= k && e < end) {
          if (cur.col[u] >= c0 + width) {
            stop = true;
            k = e;
          } else {
            add_edge(cur.col[u], value(cur, u));
          }
        }
      }
      if (stop) break;
      g += 4;
      k = g;
      if (g < end) {
        cur = next;
        if (g + 4 < end) load_group(g + 4, next);
      }
    }
  }

  // Sums -> this thread's row of io in batch order -> out[n0 + b, r] (consecutive threads: consecutive rows).
  __syncthreads();  // the last panel is done with
  Acc* io = reinterpret_cast<Acc*>(tile_smem) + threadIdx.x * IO;
#pragma unroll
  for (int i = 0; i < C; ++i)
#pragma unroll
    for (int e = 0; e < E; ++e) io[(qc ^ i) * E + e] = acc[i * E + e];
  if (r < p.nrows) {
    const int cols_here = min(S, p.batch - n0);
    for (int b = 0; b < cols_here; ++b) p.out[int64_t(n0 + b) * p.nrows + r] = narrow<T>(io[b]);
  }
  if (bad_ptr) *p.ptr_error = 1;
  if (seen_col >= static_cast<unsigned>(p.ncols)) *p.col_error = 1;
}

// out[c, n] = in[n, c] for n < batch, 0 for batch <= n < ldb: the feature-major, zero-padded gathered operand.
template <typename T>
__global__ void transpose_pad_kernel(const T* __restrict__ in, T* __restrict__ out, int batch, int cols, int ldb) {
  __shared__ T tile[32][33];
  const int c0 = blockIdx.x * 32, n0 = blockIdx.y * 32;
  for (int y = threadIdx.y; y < 32; y += 8) {
    const int n = n0 + y, c = c0 + threadIdx.x;
    tile[y][threadIdx.x] = (n < batch && c < cols) ? in[int64_t(n) * cols + c] : narrow<T>(0.0f);
  }
  __syncthreads();
  for (int y = threadIdx.y; y < 32; y += 8) {
    const int c = c0 + y, n = n0 + threadIdx.x;
    if (c < cols) out[int64_t(c) * ldb + n] = tile[threadIdx.x][y];
  }
}

// out[i] = in[index[i]] over n elements, a bad index guarded: the forward's edge values in by-destination order.
template <typename T>
__global__ void gather_kernel(const T* __restrict__ in, const int32_t* __restrict__ index, T* __restrict__ out,
                              int n, int* error) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  unsigned seen = 0;
  if (i < n) out[i] = in[checked_index(index[i], n, seen)];
  if (seen >= static_cast<unsigned>(n)) *error = 1;
}

// The error words of a device (zeros on first use), one int per index array; they live as long as the process.
// Returned by value (a handle to the same storage): a reference into the vector would dangle when another
// device's first use resizes it.
at::Tensor error_words(const at::Device& device) {
  static std::mutex mutex;
  static std::vector<at::Tensor> words;
  const std::lock_guard<std::mutex> lock(mutex);
  const size_t i = static_cast<size_t>(device.index());
  if (words.size() <= i) words.resize(i + 1);
  if (!words[i].defined())
    words[i] = at::zeros({static_cast<int64_t>(IndexArray::count)}, at::TensorOptions(device).dtype(at::kInt));
  return words[i];
}

int* error_word(const at::Device& device, IndexArray array) {
  return error_words(device).mutable_data_ptr<int>() + static_cast<int>(array);
}

std::vector<int64_t> take_index_errors_cuda(const at::Tensor& like) {
  const c10::cuda::CUDAGuard guard(like.device());
  at::Tensor words = error_words(like.device());
  const at::Tensor seen = words.to(at::kCPU, at::kLong);  // waits for the kernels queued before
  words.zero_();
  const int64_t* v = seen.const_data_ptr<int64_t>();
  return std::vector<int64_t>(v, v + seen.numel());
}

// Batch values per lane: 16 bytes per gathered row and lane (P = 4 for 4-byte values, 8 for 2-byte ones, which
// also halves the per-edge work per column), unless the batch is small: P = 1 up to 32, and 4 up to 128.
inline int pick_p(int64_t batch, int64_t value_bytes) {
  if (batch <= 32) return 1;
  return value_bytes == 2 && batch > 128 ? 8 : 4;
}

template <typename T>
const T* device_ptr(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.const_data_ptr());
}
template <typename T>
T* device_ptr(at::Tensor& t) {
  return reinterpret_cast<T*>(t.mutable_data_ptr());
}

// [batch, cols] -> [cols, ldb] feature-major with zero padding, ldb a multiple of the chunk width.
template <typename T>
at::Tensor feature_major(const at::Tensor& t, int64_t ldb) {
  const int64_t batch = t.size(0), cols = t.size(1);
  at::Tensor out = at::empty({cols, ldb}, t.options());
  if (cols == 0 || ldb == 0) return out;
  const dim3 grid((cols + 31) / 32, ldb / 32), block(32, 8);
  transpose_pad_kernel<T><<<grid, block, 0, c10::cuda::getCurrentCUDAStream()>>>(
      device_ptr<T>(t), device_ptr<T>(out), int(batch), int(cols), int(ldb));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// The SDDMM group of a mode (docs/cuda.md): per edge for the exclusive pass; for fused_atomic 16 edges, or 8 at
// P = 8, whose 8 SpMM sums a lane beside 16 partial sums would pass min_blocks' register cap and spill.
template <Mode M, int P>
constexpr int sddmm_group() {
  return M != Mode::SpMMSddmmAtomic ? 0 : P > 4 ? 8 : 16;
}

template <typename T, typename Acc, int P, Mode M>
void launch_one(const Params<T, Acc>& prm, int chunks) {
  constexpr int G = sddmm_group<M, P>();
  const size_t smem = size_t(kWarps) * (32 * P + 1) * sizeof(Acc);
  auto kernel = csr_tile_kernel<T, Acc, P, M, G>;
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  }
  const dim3 grid((prm.nrows + kWarps - 1) / kWarps, M == Mode::SddmmExclusive ? 1 : chunks);
  kernel<<<grid, kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(prm);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// One CSR walk: picks the chunk width.
template <Mode M, typename T, typename Acc>
void launch(const Params<T, Acc>& prm) {
  if (prm.nrows == 0) return;
  const int p = pick_p(prm.batch, sizeof(T));
  const int chunks = prm.ldb / (32 * p);
  if (chunks == 0) return;
  if (p == 1) return launch_one<T, Acc, 1, M>(prm, chunks);
  if constexpr (sizeof(T) == 2) {
    if (p == 8) return launch_one<T, Acc, 8, M>(prm, chunks);
  }
  return launch_one<T, Acc, 4, M>(prm, chunks);
}

// The row-tile kernel where it should pay: a batch of 256 or more; each staged value used by 4 or more edges on
// average (256 rows x density >= 4: below that, staging costs more than it saves); a full wave of resident blocks
// (it has 4x (16-bit) to 8x fewer blocks than the direct kernel); and the vector loads aligned (index views may
// be offset).
template <typename T, typename Acc>
dim3 row_tile_grid(const Params<T, Acc>& prm) {
  constexpr int S = row_tile_slice<T>();
  return dim3((prm.nrows + kThreads - 1) / kThreads, (prm.batch + S - 1) / S);
}

template <typename T, typename Acc>
bool use_row_tile(const Params<T, Acc>& prm) {
  if (prm.batch < 256 || int64_t(kThreads) * prm.edges < 4 * int64_t(prm.nrows) * prm.ncols) return false;
  const auto aligned = [](const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; };
  if (prm.ldb % row_tile_slice<T>() != 0 || !aligned(prm.col, 16) || !aligned(prm.val, 4 * sizeof(T)) ||
      !aligned(prm.bt, 16))
    return false;
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  const dim3 grid = row_tile_grid(prm);
  return grid.y <= 65535 && int64_t(grid.x) * grid.y >= int64_t(sms) * kRowTileBlocksPerSm;
}

template <typename T, typename Acc>
void launch_row_tile(const Params<T, Acc>& prm) {
  constexpr size_t kStage = size_t(kRowTileFeatures) * kRowTileLine;
  constexpr size_t kOut = size_t(kThreads) * (row_tile_slice<T>() + 1) * sizeof(Acc);
  static_assert(kOut <= kStage, "the output buffer reuses the staging buffer");
  auto kernel = csr_row_tile_kernel<T, Acc>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kStage)));
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                      int(cudaSharedmemCarveoutMaxShared)));
  kernel<<<row_tile_grid(prm), kThreads, kStage, c10::cuda::getCurrentCUDAStream()>>>(prm);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

inline int64_t padded_batch(int64_t batch, int64_t value_bytes) {
  const int64_t cw = 32 * pick_p(batch, value_bytes);
  return (batch + cw - 1) / cw * cw;
}

at::Tensor csr_linear_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& row_ptr,
                           const at::Tensor& dst, const at::Tensor& src, const at::Tensor& col_ptr,
                           const at::Tensor& src_by_dst, const at::Tensor& perm, c10::string_view /*backward*/) {
  check_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  check_int32_sizes(x, "CUDA");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t batch = x.size(0), in_features = x.size(1), out_features = col_ptr.numel() - 1;
  at::Tensor y = empty_output({batch, out_features}, x.options());
  if (y.numel() == 0) return y;
  if (weight.numel() == 0) return y.zero_();
  const int64_t ldb = padded_batch(batch, x.element_size());
  const int64_t edges = weight.numel();
  const at::Tensor wc = weight.contiguous();
  // Edge values in by-destination order: one gather per call instead of an indirection per (edge, chunk).
  at::Tensor w_by_dst = at::empty_like(wc);
  dispatch_value_type(x.scalar_type(), "csr_linear_cuda", [&](auto types) {
    using T = typename DeviceType<typename decltype(types)::T>::type;
    using Acc = typename decltype(types)::Acc;
    gather_kernel<T><<<(edges + 255) / 256, 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        device_ptr<T>(wc), perm.const_data_ptr<int32_t>(), device_ptr<T>(w_by_dst), int(edges),
        error_word(x.device(), IndexArray::perm));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const at::Tensor xt = feature_major<T>(x.contiguous(), ldb);
    const Params<T, Acc> prm{col_ptr.const_data_ptr<int32_t>(), src_by_dst.const_data_ptr<int32_t>(),
                             error_word(x.device(), IndexArray::col_ptr),
                             error_word(x.device(), IndexArray::src_by_dst),
                             device_ptr<T>(w_by_dst), device_ptr<T>(xt), nullptr, device_ptr<T>(y), nullptr,
                             int(out_features), int(in_features), int(batch), int(ldb), int(edges)};
    if (use_row_tile(prm)) {
      launch_row_tile(prm);
    } else {
      launch<Mode::SpMM>(prm);
    }
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> csr_linear_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                                            const at::Tensor& weight, const at::Tensor& row_ptr,
                                                            const at::Tensor& dst, const at::Tensor& src,
                                                            const at::Tensor& col_ptr, const at::Tensor& src_by_dst,
                                                            const at::Tensor& perm, c10::string_view strategy) {
  check_backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  check_int32_sizes(x, "CUDA");
  const Strategy which = parse_strategy(strategy);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t batch = x.size(0), in_features = x.size(1), out_features = grad_out.size(1), edges = weight.numel();
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor gx = empty_output(xc.sizes(), xc.options());
  // grad_w is summed in the accumulate type. fused_atomic adds into it; atomic_free pass 1 writes every element
  // exactly once.
  const at::TensorOptions acc_options = wc.options().dtype(accumulate_type(wc.scalar_type()));
  at::Tensor gw = which == Strategy::FusedAtomic || batch == 0 ? at::zeros(wc.sizes(), acc_options)
                                                               : empty_output(wc.sizes(), acc_options);
  if (batch == 0 || in_features == 0) return {gx, gw.to(wc.scalar_type())};
  if (edges == 0) return {gx.zero_(), gw.to(wc.scalar_type())};
  const int64_t ldb = padded_batch(batch, x.element_size());
  dispatch_value_type(x.scalar_type(), "csr_linear_backward_cuda", [&](auto types) {
    using T = typename DeviceType<typename decltype(types)::T>::type;
    using Acc = typename decltype(types)::Acc;
    const at::Tensor gt = feature_major<T>(grad_out.contiguous(), ldb);
    const Params<T, Acc> prm{row_ptr.const_data_ptr<int32_t>(), dst.const_data_ptr<int32_t>(),
                             error_word(x.device(), IndexArray::row_ptr), error_word(x.device(), IndexArray::dst),
                             device_ptr<T>(wc), device_ptr<T>(gt), device_ptr<T>(xc), device_ptr<T>(gx),
                             device_ptr<Acc>(gw), int(in_features), int(out_features), int(batch), int(ldb),
                             int(edges)};
    switch (which) {
      case Strategy::FusedAtomic:
        launch<Mode::SpMMSddmmAtomic>(prm);  // one dispatch
        break;
      case Strategy::AtomicFree:
        launch<Mode::SddmmExclusive>(prm);  // pass 1: grad_w, per edge
        launch<Mode::SpMM>(prm);            // pass 2: grad_x, per source
        break;
    }
  });
  return {gx, gw.to(wc.scalar_type())};
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_sparse_metal, CUDA, m) {
  m.impl("csr_linear", &csr_linear_cuda);
  m.impl("csr_linear_backward", &csr_linear_backward_cuda);
  m.impl("take_index_errors", &take_index_errors_cuda);
}

}  // namespace torch_sparse_metal
