// CUDA kernels for the csr_linear ops (see docs/architecture.md for the contract, docs/cuda.md for the
// measurements behind the choices below).
//
// Every kernel is one tiled CSR walk. A block owns 8 * J CSR rows (outputs for the forward, sources
// for the backward) and one batch chunk of CW = 32 * P columns; lane l of a warp holds P consecutive batch
// elements. Per edge the warp reads one row of a feature-major operand (xT for the forward, gT for the
// backward), CW contiguous values, either straight from global memory (L2) or from a shared-memory tile.
//
// Why this shape:
// - The only operand read at random rows is the gathered one. It is transposed once per call into a
//   feature-major, zero-padded [features, ldb] buffer (one tiled transpose kernel) so that a gathered row is
//   CW contiguous values: 16-byte loads, coalesced. The block's own rows (x for the SDDMM, y / grad_x for the
//   output) are read and written batch-major directly, transposed through shared memory, so they cost no
//   extra pass.
// - Direct mode (the default): one CSR row per warp, four edges' rows in flight, read from L2. The batch
//   chunks of a row run in separate blocks of grid.y, so the blocks resident at one time share a chunk and
//   its slice of the gathered operand stays in L2.
// - Staged mode (opt-in, TORCH_SPARSE_METAL_CUDA_STAGE=1): the block walks the gathered operand in
//   double-buffered cp.async tiles in shared memory that all its 8 * J rows read. Edges are sorted within a
//   CSR row, so each row keeps a cursor that only moves forward across tiles: no search. It was slower than
//   direct at every measured size (register-limited to 25% occupancy; docs/cuda.md) and is kept for the
//   record and for further work.
// - The weight gradient (an SDDMM) is a reduction per edge over the warp's batch chunk, then one atomicAdd
//   per (edge, chunk) in fused_atomic, or an exclusive read-modify-write in atomic_free pass 1, whose block
//   loops over all chunks itself. The fused direct mode reduces 16 edges at a time with one reduce-scatter
//   (lane u ends with edge u's sum); the other modes reduce each edge with a butterfly.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cstdlib>

#include "../csr_linear_checks.h"

namespace torch_sparse_metal {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kStageBytes = 48 * 1024;  // per buffer; two buffers, two blocks per SM in Hopper's 228 KB

enum class Mode {
  SpMM,             // out[n, r] = sum_k val[k] * bt[col[k], n]
  SpMMSddmmAtomic,  // SpMM, and gw[k] += sum_n a[n, r] * bt[col[k], n] with atomics (fused_atomic)
  SddmmExclusive,   // gw[k] = sum_n a[n, r] * bt[col[k], n] over the whole batch, no atomics (atomic_free pass 1)
};

template <typename T>
struct Params {
  const int32_t* ptr;  // [nrows + 1] CSR row pointer
  const int32_t* col;  // [E] column (gathered feature) per edge, ascending within a row
  const T* val;        // [E] edge values (SpMM modes)
  const T* bt;         // [ncols, ldb] gathered operand, feature-major, zero beyond `batch`
  const T* a;          // [batch, nrows] batch-major row operand of the SDDMM
  T* out;              // [batch, nrows] batch-major SpMM output
  T* gw;               // [E] weight gradient
  int nrows, ncols, batch, ldb, stage_rows;
};

// P consecutive values, as 16-byte loads where the width allows (all callers keep P*sizeof(T) aligned).
template <typename T, int P>
__device__ __forceinline__ void load_vec(const T* p, T (&v)[P]) {
  if constexpr ((P * sizeof(T)) % 16 == 0) {
#pragma unroll
    for (int i = 0; i < P * int(sizeof(T)) / 16; ++i) {
      const float4 q = reinterpret_cast<const float4*>(p)[i];
      memcpy(reinterpret_cast<char*>(v) + 16 * i, &q, 16);
    }
  } else {
#pragma unroll
    for (int i = 0; i < P; ++i) v[i] = p[i];
  }
}

// Asynchronous 16-byte global -> shared copies (sm_80+): a whole tile in flight without staging registers.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// v[u] is this lane's share of value u (G values, G a power of two <= 32); afterwards v[0] is the warp's total
// of value lane % G. Offsets W >= G add the partner's share of every value; offsets below G halve: a lane keeps
// the half of its values whose bit W matches its own lane bit and adds its partner's share of them. G values cost
// G * log2(32 / G) + G - 1 shuffles (31 for G = 16, 5 for G = 1). A template per step, not a loop: with a loop
// nvcc kept v in local memory.
template <int G, int W = 16, typename T>
__device__ __forceinline__ void warp_reduce_scatter(T (&v)[G], int lane) {
  if constexpr (W >= G) {
#pragma unroll
    for (int i = 0; i < G; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], W);
  } else {
    const bool upper = lane & W;
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const T send = upper ? v[i] : v[i + W];
      const T keep = upper ? v[i + W] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, W);
    }
  }
  if constexpr (W > 1) warp_reduce_scatter<G, W / 2>(v, lane);
}

// G: edges per SDDMM reduction in the direct mode (0: each edge reduced on its own with a butterfly).
template <typename T, int P, int J, bool kStaged, Mode M, int G>
__global__ void __launch_bounds__(kThreads, 2) csr_tile_kernel(const Params<T> p) {
  constexpr int CW = 32 * P;  // batch columns per chunk
  constexpr int R = kWarps * J;
  constexpr int IO = CW + 1;  // padded row of the batch-major <-> feature-major tile: no bank conflicts
  constexpr bool kSpmm = M != Mode::SddmmExclusive;
  constexpr bool kSddmm = M != Mode::SpMM;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sm = reinterpret_cast<T*>(smem_raw);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r0 = blockIdx.x * R;
  int cur0[J], end[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int r = r0 + warp * J + j;
    cur0[j] = r < p.nrows ? p.ptr[r] : 0;
    end[j] = r < p.nrows ? p.ptr[r + 1] : 0;
  }
  const int rows_here = min(R, p.nrows - r0);

  // SpMM modes: one chunk per block (grid.y); the exclusive SDDMM walks all chunks so that it owns its edges.
  const int chunk_lo = kSpmm ? blockIdx.y : 0, chunk_hi = kSpmm ? blockIdx.y + 1 : p.ldb / CW;
  for (int chunk = chunk_lo; chunk < chunk_hi; ++chunk) {
    const int n0 = chunk * CW, cols_here = min(CW, p.batch - n0);
    T xa[kSddmm ? J : 1][P];
    T acc[kSpmm ? J : 1][P];
    if constexpr (kSddmm) {
      // a[n0 .. n0+CW, r0 .. r0+R] -> sm[i][b] (threads run along i: coalesced global reads).
      for (int idx = threadIdx.x; idx < R * CW; idx += kThreads) {
        const int i = idx % R, b = idx / R;
        sm[i * IO + b] = (i < rows_here && b < cols_here) ? p.a[int64_t(n0 + b) * p.nrows + r0 + i] : T(0);
      }
      __syncthreads();
#pragma unroll
      for (int j = 0; j < J; ++j)
#pragma unroll
        for (int q = 0; q < P; ++q) xa[j][q] = sm[(warp * J + j) * IO + lane * P + q];
      __syncthreads();
    }
    if constexpr (kSpmm) {
#pragma unroll
      for (int j = 0; j < J; ++j)
#pragma unroll
        for (int q = 0; q < P; ++q) acc[j][q] = T(0);
    }

    // One edge's contributions from its gathered row segment g: the SpMM update, and this lane's part of the
    // SDDMM dot product; store_gw adds a finished dot product into grad_w.
    auto spmm_update = [&](int j, T w, const T (&g)[P]) {
#pragma unroll
      for (int q = 0; q < P; ++q) acc[j][q] += w * g[q];
    };
    auto partial_dot = [&](int j, const T (&g)[P]) {
      T d = T(0);
#pragma unroll
      for (int q = 0; q < P; ++q) d += xa[j][q] * g[q];
      return d;
    };
    auto store_gw = [&](int k, T d) {
      if constexpr (M == Mode::SpMMSddmmAtomic) {
        atomicAdd(p.gw + k, d);
      } else {
        p.gw[k] = chunk == 0 ? d : p.gw[k] + d;  // only this thread ever touches gw[k]
      }
    };
    auto edge = [&](int j, int k, T w, const T (&g)[P]) {
      if constexpr (kSpmm) spmm_update(j, w, g);
      if constexpr (kSddmm) {
        const T d = warp_sum(partial_dot(j, g));
        if (lane == 0) store_gw(k, d);
      }
    };

    int cur[J];
#pragma unroll
    for (int j = 0; j < J; ++j) cur[j] = cur0[j];
    if constexpr (kStaged) {
      // Double-buffered tiles of stage_rows gathered rows: cp.async fills tile t + 1 while tile t is used.
      constexpr int V = CW * int(sizeof(T)) / 16;  // 16-byte vectors per staged row
      const int tiles = (p.ncols + p.stage_rows - 1) / p.stage_rows;
      auto issue = [&](int t) {
        const int c0 = t * p.stage_rows, rows = min(p.stage_rows, p.ncols - c0);
        T* buf = sm + (t & 1) * p.stage_rows * CW;
        for (int idx = threadIdx.x; idx < rows * V; idx += kThreads) {
          const int r = idx / V, v = idx % V;
          cp_async16(buf + idx * (16 / int(sizeof(T))), p.bt + int64_t(c0 + r) * p.ldb + n0 + v * (16 / int(sizeof(T))));
        }
        cp_async_commit();
      };
      issue(0);
      for (int t = 0; t < tiles; ++t) {
        if (t + 1 < tiles) {
          issue(t + 1);
          cp_async_wait<1>();
        } else {
          cp_async_wait<0>();
        }
        __syncthreads();
        const int c0 = t * p.stage_rows, c1 = min(c0 + p.stage_rows, p.ncols);
        const T* buf = sm + (t & 1) * p.stage_rows * CW;
        // The next (up to) 32 edges of every row, one coalesced load per row, all rows' loads in flight
        // together: lane u holds edge cur[j] + u. Edge indices then come from shuffles, not dependent loads.
        int my_c[J];
        T my_v[J];
#pragma unroll
        for (int j = 0; j < J; ++j) {
          const int kk = cur[j] + lane;
          my_c[j] = kk < end[j] ? __ldg(p.col + kk) : INT_MAX;
          my_v[j] = kSpmm && kk < end[j] ? __ldg(p.val + kk) : T(0);
        }
#pragma unroll
        for (int j = 0; j < J; ++j) {
          int k = cur[j];
          for (int u = 0; k < end[j]; ++u, ++k) {
            if (u == 32) {  // more than 32 edges of this row in one tile: refill
              u = 0;
              my_c[j] = k + lane < end[j] ? __ldg(p.col + k + lane) : INT_MAX;
              my_v[j] = kSpmm && k + lane < end[j] ? __ldg(p.val + k + lane) : T(0);
            }
            const int c = __shfl_sync(0xffffffffu, my_c[j], u);
            if (c >= c1) break;
            T g[P];
            load_vec<T, P>(buf + (c - c0) * CW + lane * P, g);
            edge(j, k, __shfl_sync(0xffffffffu, my_v[j], u), g);
          }
          cur[j] = k;
        }
        __syncthreads();  // tile t + 2 overwrites this buffer
      }
    } else {
      const T* bt = p.bt + n0 + lane * P;
#pragma unroll
      for (int j = 0; j < J; ++j) {
        if constexpr (kSddmm && G > 0) {
          // Groups of G edges: every lane keeps its partial dot product of each edge, and one reduce-scatter
          // leaves lane u with edge u's sum: 31 shuffles and one warp-wide store per 16 edges (G = 16) instead
          // of 5 shuffles and a single-lane store per edge.
          constexpr int U = G < 4 ? G : 4;  // edges in flight: the gathered rows come from L2
          for (int kb = cur[j]; kb < end[j]; kb += G) {
            const int n = min(G, end[j] - kb);  // warp-uniform
            T part[G];
#pragma unroll
            for (int u = 0; u < G; ++u) part[u] = T(0);
#pragma unroll
            for (int u0 = 0; u0 < G; u0 += U) {
              if (u0 < n) {
                int c[U];
                T g[U][P];
#pragma unroll
                for (int u = 0; u < U; ++u) c[u] = u0 + u < n ? p.col[kb + u0 + u] : 0;
#pragma unroll
                for (int u = 0; u < U; ++u)
                  if (u0 + u < n) load_vec<T, P>(bt + int64_t(c[u]) * p.ldb, g[u]);
#pragma unroll
                for (int u = 0; u < U; ++u) {
                  if (u0 + u < n) {
                    if constexpr (kSpmm) spmm_update(j, p.val[kb + u0 + u], g[u]);
                    part[u0 + u] = partial_dot(j, g[u]);
                  }
                }
              }
            }
            warp_reduce_scatter<G>(part, lane);
            if (lane < n) store_gw(kb + lane, part[0]);
          }
        } else {
          int k = cur[j];
          // Four edges in flight per warp: the gathered rows come from L2, so latency needs hiding.
          for (; k + 4 <= end[j]; k += 4) {
            int c[4];
            T g[4][P];
#pragma unroll
            for (int u = 0; u < 4; ++u) c[u] = p.col[k + u];
#pragma unroll
            for (int u = 0; u < 4; ++u) load_vec<T, P>(bt + int64_t(c[u]) * p.ldb, g[u]);
#pragma unroll
            for (int u = 0; u < 4; ++u) edge(j, k + u, kSpmm ? p.val[k + u] : T(0), g[u]);
          }
          for (; k < end[j]; ++k) {
            T g[P];
            load_vec<T, P>(bt + int64_t(p.col[k]) * p.ldb, g);
            edge(j, k, kSpmm ? p.val[k] : T(0), g);
          }
        }
      }
    }

    if constexpr (kSpmm) {
      // acc -> sm[i][b] -> out[n0 + b, r0 + i] (threads run along i: coalesced global writes).
#pragma unroll
      for (int j = 0; j < J; ++j)
#pragma unroll
        for (int q = 0; q < P; ++q) sm[(warp * J + j) * IO + lane * P + q] = acc[j][q];
      __syncthreads();
      for (int idx = threadIdx.x; idx < R * CW; idx += kThreads) {
        const int i = idx % R, b = idx / R;
        if (i < rows_here && b < cols_here) p.out[int64_t(n0 + b) * p.nrows + r0 + i] = sm[i * IO + b];
      }
    }
  }
}

// out[c, n] = in[n, c] for n < batch, 0 for batch <= n < ldb: the feature-major, zero-padded gathered operand.
template <typename T>
__global__ void transpose_pad_kernel(const T* __restrict__ in, T* __restrict__ out, int batch, int cols, int ldb) {
  __shared__ T tile[32][33];
  const int c0 = blockIdx.x * 32, n0 = blockIdx.y * 32;
  for (int y = threadIdx.y; y < 32; y += 8) {
    const int n = n0 + y, c = c0 + threadIdx.x;
    tile[y][threadIdx.x] = (n < batch && c < cols) ? in[int64_t(n) * cols + c] : T(0);
  }
  __syncthreads();
  for (int y = threadIdx.y; y < 32; y += 8) {
    const int c = c0 + y, n = n0 + threadIdx.x;
    if (c < cols) out[int64_t(c) * ldb + n] = tile[threadIdx.x][y];
  }
}

// Chunk width per warp: 128 batch columns (P = 4, 16-byte loads) unless the batch is small.
inline int pick_p(int64_t batch) { return batch <= 32 ? 1 : 4; }

// [batch, cols] -> [cols, ldb] feature-major with zero padding, ldb a multiple of the chunk width.
at::Tensor feature_major(const at::Tensor& t, int64_t ldb) {
  const int64_t batch = t.size(0), cols = t.size(1);
  at::Tensor out = at::empty({cols, ldb}, t.options());
  if (cols == 0 || ldb == 0) return out;
  const dim3 grid((cols + 31) / 32, ldb / 32), block(32, 8);
  AT_DISPATCH_FLOATING_TYPES(t.scalar_type(), "transpose_pad", [&] {
    transpose_pad_kernel<scalar_t><<<grid, block, 0, c10::cuda::getCurrentCUDAStream()>>>(
        t.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), int(batch), int(cols), int(ldb));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

// Staged mode is opt-in: TORCH_SPARSE_METAL_CUDA_STAGE=1 forces it (=0 forces direct, the default). On the
// H200 it lost to the direct mode at every density from 0.1% to 50% (docs/cuda.md), so no size picks it.
inline bool want_staged() {
  const char* env = std::getenv("TORCH_SPARSE_METAL_CUDA_STAGE");
  return env != nullptr && env[0] == '1';
}

template <typename T, int P, int J, bool kStaged, Mode M, int G = 0>
void launch_one(const Params<T>& prm, int chunks) {
  constexpr int CW = 32 * P, R = kWarps * J;
  const size_t io_bytes = size_t(R) * (CW + 1) * sizeof(T);
  const size_t stage_bytes = kStaged ? 2 * size_t(prm.stage_rows) * CW * sizeof(T) : 0;
  const size_t smem = std::max(io_bytes, stage_bytes);
  auto kernel = csr_tile_kernel<T, P, J, kStaged, M, G>;
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  }
  const dim3 grid((prm.nrows + R - 1) / R, M == Mode::SddmmExclusive ? 1 : chunks);
  kernel<<<grid, kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(prm);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Edges per SDDMM reduction in the direct mode (0: each edge on its own). Defaults from the H200 (docs/cuda.md):
// 16 for fused_atomic (1-17% faster than per edge at every measured size); per edge for the exclusive pass of
// atomic_free (16 was 7-9% slower at 4096x4096, 10% faster at 16384x16384). TORCH_SPARSE_METAL_CUDA_SDDMM=16|edge
// forces one for both (a measurement knob).
template <Mode M>
int sddmm_group() {
  const char* env = std::getenv("TORCH_SPARSE_METAL_CUDA_SDDMM");
  if (env != nullptr && env[0] != '\0') return env[0] == 'e' ? 0 : 16;
  return M == Mode::SpMMSddmmAtomic ? 16 : 0;
}

// One row per warp, read straight from L2; SpMM needs no reduction, the SDDMM modes pick their group size.
template <typename T, int P, Mode M>
void launch_direct(const Params<T>& prm, int chunks) {
  if constexpr (M == Mode::SpMM) {
    launch_one<T, P, 1, false, M>(prm, chunks);
  } else if (sddmm_group<M>() == 16) {
    launch_one<T, P, 1, false, M, 16>(prm, chunks);
  } else {
    launch_one<T, P, 1, false, M, 0>(prm, chunks);
  }
}

// Picks the chunk width and staging for one CSR walk. J = 8 rows per warp when staged (reuse of a staged tile
// grows with the rows of a block), J = 1 when direct; the exclusive SDDMM is always direct.
template <typename T, Mode M>
void launch(Params<T> prm) {
  if (prm.nrows == 0) return;
  const int p = pick_p(prm.batch);
  const int cw = 32 * p, chunks = prm.ldb / cw;
  if (chunks == 0) return;
  if constexpr (M == Mode::SddmmExclusive) {
    if (p == 1) return launch_direct<T, 1, M>(prm, chunks);
    return launch_direct<T, 4, M>(prm, chunks);
  } else {
    // Direct mode: one row per warp. Rows share nothing there, and small rows-per-block keep the grid large
    // when the batch gives few chunks (J = 8 left half of the H200 idle at batch <= 128).
    if (p == 1) return launch_direct<T, 1, M>(prm, chunks);
    if (prm.ncols > 0 && want_staged()) {
      // TORCH_SPARSE_METAL_CUDA_TILE=2x16: 64-column chunks and 16 rows per warp, twice the reuse of a staged
      // row for the same registers (a measurement knob; see docs/cuda.md).
      const char* tile = std::getenv("TORCH_SPARSE_METAL_CUDA_TILE");
      if (tile != nullptr && tile[0] == '2') {
        prm.stage_rows = int(kStageBytes / (64 * sizeof(T)));
        return launch_one<T, 2, 16, true, M>(prm, prm.ldb / 64);
      }
      prm.stage_rows = int(kStageBytes / (cw * sizeof(T)));
      return launch_one<T, 4, 8, true, M>(prm, chunks);
    }
    return launch_direct<T, 4, M>(prm, chunks);
  }
}

inline int64_t padded_batch(int64_t batch) {
  const int64_t cw = 32 * pick_p(batch);
  return (batch + cw - 1) / cw * cw;
}

at::Tensor csr_linear_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& row_ptr,
                           const at::Tensor& dst, const at::Tensor& src, const at::Tensor& col_ptr,
                           const at::Tensor& src_by_dst, const at::Tensor& perm, c10::string_view /*backward*/) {
  check_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  check_int32_sizes(x, "CUDA");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t batch = x.size(0), in_features = x.size(1), out_features = col_ptr.numel() - 1;
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({batch, out_features}, x.options());
  if (y.numel() == 0) return y;
  if (weight.numel() == 0) return y.zero_();
  const int64_t ldb = padded_batch(batch);
  const at::Tensor xt = feature_major(xc, ldb);
  // Edge values in by-destination order: one gather per call instead of an indirection per (edge, chunk).
  const at::Tensor w_by_dst = weight.contiguous().index_select(0, perm);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "csr_linear_cuda", [&] {
    Params<scalar_t> prm{col_ptr.const_data_ptr<int32_t>(), src_by_dst.const_data_ptr<int32_t>(),
                         w_by_dst.const_data_ptr<scalar_t>(), xt.const_data_ptr<scalar_t>(), nullptr,
                         y.mutable_data_ptr<scalar_t>(), nullptr, int(out_features), int(in_features), int(batch),
                         int(ldb), 0};
    launch<scalar_t, Mode::SpMM>(prm);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> csr_linear_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x,
                                                            const at::Tensor& weight, const at::Tensor& row_ptr,
                                                            const at::Tensor& dst, const at::Tensor& src,
                                                            c10::string_view strategy) {
  check_backward(grad_out, x, weight, row_ptr, dst, src);
  check_int32_sizes(x, "CUDA");
  const Strategy which = parse_strategy(strategy);
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t batch = x.size(0), in_features = x.size(1), out_features = grad_out.size(1), edges = weight.numel();
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), gc = grad_out.contiguous();
  at::Tensor gx = at::empty_like(xc);
  // fused_atomic accumulates into grad_w; atomic_free pass 1 writes every element exactly once.
  at::Tensor gw = which == Strategy::FusedAtomic || batch == 0 ? at::zeros_like(wc) : at::empty_like(wc);
  if (batch == 0 || in_features == 0) return {gx, gw};
  if (edges == 0) return {gx.zero_(), gw};
  const int64_t ldb = padded_batch(batch);
  const at::Tensor gt = feature_major(gc, ldb);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "csr_linear_backward_cuda", [&] {
    Params<scalar_t> prm{row_ptr.const_data_ptr<int32_t>(), dst.const_data_ptr<int32_t>(),
                         wc.const_data_ptr<scalar_t>(), gt.const_data_ptr<scalar_t>(), xc.const_data_ptr<scalar_t>(),
                         gx.mutable_data_ptr<scalar_t>(), gw.mutable_data_ptr<scalar_t>(), int(in_features),
                         int(out_features), int(batch), int(ldb), 0};
    if (which == Strategy::FusedAtomic) {
      launch<scalar_t, Mode::SpMMSddmmAtomic>(prm);  // one dispatch
    } else {
      launch<scalar_t, Mode::SddmmExclusive>(prm);   // pass 1: grad_w, per edge
      launch<scalar_t, Mode::SpMM>(prm);             // pass 2: grad_x, per source
    }
  });
  return {gx, gw};
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_sparse_metal, CUDA, m) {
  m.impl("csr_linear", &csr_linear_cuda);
  m.impl("csr_linear_backward", &csr_linear_backward_cuda);
}

}  // namespace torch_sparse_metal
