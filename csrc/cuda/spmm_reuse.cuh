// The SpMM stage with operand reuse (docs/cuda.md, "Operand reuse: a panel-staged SpMM"). Included by
// csr_linear_cuda.cu after Params, checked_index, checked_range, load_vec, widen and narrow.
//
// A block of 16 warps owns a window of 16 * RW consecutive CSR rows (a warp RW of them, its sums in registers
// across the whole walk) and one batch chunk of CW = 32 * P columns. It walks the gathered operand bt in panels of
// PC features: bt[c0 .. c0 + PC, n0 .. n0 + CW] is copied into shared memory with cp.async (double-buffered, the
// next panel in flight while the block works on the current one), and every edge of the window whose column
// falls in the panel reads its CW values from there instead of from L2. A staged value serves 16 * RW * density
// edges (2.56 at 1% with RW = 16) where the direct kernel reads it from L2 once per edge.
//
// Per (row, panel) the warp needs the row's edges inside the panel. They are contiguous because columns ascend
// within a row; reuse_segments_kernel finds them beforehand by binary search (seg[r][q] = the first edge of row r
// whose column is >= q * PC), and lane j of a warp holds the boundary of its row j, handed to the warp by a
// shuffle. The walk takes the boundaries as a running maximum, so the edges of a row are partitioned into
// consecutive ranges, each met exactly once, whatever the column order; an edge whose column is outside the
// current panel (only possible when columns do not ascend) reads its row of bt from global memory, so the sum
// stays right for any order.
//
// Index safety as in the direct kernel: reuse_segments_kernel reads the row pointer through checked_range (its
// boundaries lie in [0, edges], and ptr's error word is set there), the walk clamps every column with
// checked_index and sets the column array's error word at its end.
#pragma once

namespace reuse {

constexpr int kWarps = 16;
constexpr int kThreads = kWarps * 32;
// One panel buffer; two of them: 128 KB, one block an SM. The rest of the SM's 256 KB stays L1 (the launch asks
// for that carve-out): the walk reads the window's column indices and values through L1, 256 rows' current lines
// of each, 64 KB.
constexpr int kPanelBytes = 64 * 1024;
constexpr int kGroup = 4;               // edges whose loads are issued together

// Rows a warp owns: 16 float sums of P = 4 columns fit 64 registers; double sums take twice that, so 8 rows.
template <typename Acc>
__host__ __device__ constexpr int rows_per_warp() {
  return sizeof(Acc) == 8 ? 8 : 16;
}
template <typename T, int P>
__host__ __device__ constexpr int panel_features() {
  return kPanelBytes / (32 * P * int(sizeof(T)));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void prefetch_l1(const void* p) { asm volatile("prefetch.global.L1 [%0];" ::"l"(p)); }
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// seg[r * (panels + 1) + q], q in [0, panels]: the first edge of row r whose column is >= q * pc (the row's end
// for q = panels), found by binary search inside the row's checked range, so every value lies in [0, edges].
template <typename T, typename Acc>
__global__ void __launch_bounds__(256) reuse_segments_kernel(const Params<T, Acc> p, int32_t* seg, int panels,
                                                             int pc) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const int stride = panels + 1;
  if (i >= int64_t(p.nrows) * stride) return;
  const int r = int(i / stride), q = int(i % stride);
  bool bad = false;
  const int2 range = checked_range(p, r, bad);
  if (bad && q == 0) *p.ptr_error = 1;
  int lo = range.x, hi = range.y;
  if (q > 0 && q < panels) {  // panel 0 starts at the row's start: an edge with a negative column is walked and flagged
    const int target = q * pc;
    while (lo < hi) {
      const int mid = (lo + hi) >> 1;
      if (p.col[mid] < target) lo = mid + 1; else hi = mid;
    }
  }
  seg[i] = q == panels ? hi : lo;
}

template <typename T, typename Acc, int P, int RW>
__global__ void __launch_bounds__(kThreads, 1) reuse_spmm_kernel(const Params<T, Acc> p, const int32_t* seg) {
  constexpr int R = kWarps * RW;
  constexpr int CW = 32 * P;
  constexpr int PC = panel_features<T, P>();
  constexpr int kPieces = CW * int(sizeof(T)) / 16;  // 16-byte copies per staged feature
  static_assert(kPieces * 16 == CW * int(sizeof(T)), "a staged feature is whole 16-byte pieces");
  static_assert(RW <= 32, "lane j holds row j's boundaries");
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* panel_buf = reinterpret_cast<T*>(smem_raw);  // [2][PC][CW]

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int window = blockIdx.x * R, n0 = blockIdx.y * CW;
  const int panels = (p.ncols + PC - 1) / PC;
  const int my_row = window + warp * RW + lane;  // the row whose boundaries this lane holds (lane < RW)
  const bool holds_row = lane < RW && my_row < p.nrows;
  const int32_t* my_seg = seg + int64_t(holds_row ? my_row : 0) * (panels + 1);
  int seg_begin = holds_row ? my_seg[0] : 0;  // the running start of the row's next range
  unsigned seen_col = 0;

  auto stage = [&](int q) {
    T* dst = panel_buf + (q & 1) * PC * CW;
    const int c0 = q * PC, features = min(PC, p.ncols - c0);
    const T* src = p.bt + int64_t(c0) * p.ldb + n0;
    for (int i = threadIdx.x; i < features * kPieces; i += kThreads) {
      const int f = i / kPieces, piece = i % kPieces;
      cp_async16(reinterpret_cast<char*>(dst + f * CW) + 16 * piece,
                 reinterpret_cast<const char*>(src + int64_t(f) * p.ldb) + 16 * piece);
    }
  };

  Acc acc[RW][P];
#pragma unroll
  for (int j = 0; j < RW; ++j)
#pragma unroll
    for (int q = 0; q < P; ++q) acc[j][q] = Acc(0);

  const T* bt_lane = p.bt + n0 + lane * P;  // the global fallback for an edge outside the current panel
  stage(0);
  cp_async_commit();
  for (int q = 0; q < panels; ++q) {
    // The next panel's copy goes into the buffer read during panel q - 1, which the barrier at the end of that
    // panel has released; an empty group on the last panel keeps the wait count uniform.
    if (q + 1 < panels) stage(q + 1);
    cp_async_commit();
    const int seg_end = holds_row ? max(my_seg[q + 1], seg_begin) : 0;
    cp_async_wait<1>();
    __syncthreads();
    const T* pan = panel_buf + (q & 1) * PC * CW + lane * P;
    const int c0 = q * PC;
#pragma unroll
    for (int j = 0; j < RW; ++j) {
      const int b = __shfl_sync(0xffffffffu, seg_begin, j), e = __shfl_sync(0xffffffffu, seg_end, j);
      for (int k = b; k < e; k += kGroup) {
        const int n = min(kGroup, e - k);  // warp-uniform
        int c[kGroup];
        Acc w[kGroup];
        T g[kGroup][P];
#pragma unroll
        for (int u = 0; u < kGroup; ++u) {
          if (u < n) {
            c[u] = checked_index(p.col[k + u], p.ncols, seen_col);
            w[u] = widen<Acc>(p.val[k + u]);
          }
        }
#pragma unroll
        for (int u = 0; u < kGroup; ++u) {
          if (u < n) {
            const unsigned off = static_cast<unsigned>(c[u] - c0);
            if (off < static_cast<unsigned>(PC)) {
              load_vec<T, P>(pan + off * CW, g[u]);
            } else {
              load_vec<T, P>(bt_lane + int64_t(c[u]) * p.ldb, g[u]);
            }
          }
        }
#pragma unroll
        for (int u = 0; u < kGroup; ++u) {
          if (u < n) {
#pragma unroll
            for (int v = 0; v < P; ++v) acc[j][v] += w[u] * widen<Acc>(g[u][v]);
          }
        }
      }
    }
    // The line after the one holding the row's next edges, into L1 ahead of its use (a miss there is an L2 round
    // trip that the warp, one of 16 an SM, would wait for).
    if (holds_row && seg_end < p.edges) {
      prefetch_l1(p.col + min(seg_end + 128 / int(sizeof(int32_t)), p.edges - 1));
      prefetch_l1(p.val + min(seg_end + 128 / int(sizeof(T)), p.edges - 1));
    }
    seg_begin = seg_end;
    __syncthreads();  // every warp is done with this buffer before panel q + 2 is copied into it
  }

  // acc -> shared [row][CW + 1] -> out[n0 + b, row] (threads run along rows: coalesced writes), in rounds of as
  // many warps as the panel buffers hold.
  constexpr int IO = CW + 1;
  constexpr int kRoundWarps = 2 * kPanelBytes / (RW * IO * int(sizeof(Acc))) < kWarps
                                  ? 2 * kPanelBytes / (RW * IO * int(sizeof(Acc)))
                                  : kWarps;
  static_assert(kRoundWarps >= 1, "one warp's sums fit the panel buffers");
  Acc* sm = reinterpret_cast<Acc*>(smem_raw);
  const int cols_here = min(CW, p.batch - n0);
  for (int w0 = 0; w0 < kWarps; w0 += kRoundWarps) {
    if (warp >= w0 && warp < w0 + kRoundWarps) {
#pragma unroll
      for (int j = 0; j < RW; ++j)
#pragma unroll
        for (int v = 0; v < P; ++v) sm[((warp - w0) * RW + j) * IO + lane * P + v] = acc[j][v];
    }
    __syncthreads();
    // The round's rows: its warps' (the last round may hold fewer than kRoundWarps), inside the matrix.
    const int r0 = window + w0 * RW, rows_here = min(min(kRoundWarps, kWarps - w0) * RW, p.nrows - r0);
    for (int idx = threadIdx.x; idx < kRoundWarps * RW * CW; idx += kThreads) {
      const int i = idx % (kRoundWarps * RW), b = idx / (kRoundWarps * RW);
      if (i < rows_here && b < cols_here) p.out[int64_t(n0 + b) * p.nrows + r0 + i] = narrow<T>(sm[i * IO + b]);
    }
    __syncthreads();
  }
  if (seen_col >= static_cast<unsigned>(p.ncols)) *p.col_error = 1;
}

// The chunk width of the reuse walk: 16-byte-or-wider lane segments where the padded batch allows (P = 4, any
// width the direct kernel pads to above 32 columns is a multiple of 128), one value a lane otherwise.
inline int pick_p(int ldb) { return ldb % 128 == 0 ? 4 : 1; }

template <typename T, typename Acc, int P, int RW>
void launch_p(const Params<T, Acc>& prm) {
  constexpr int PC = panel_features<T, P>();
  constexpr int R = kWarps * RW;
  const int panels = (prm.ncols + PC - 1) / PC;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor seg = at::empty({int64_t(prm.nrows) * (panels + 1)},
                             at::TensorOptions(at::kCUDA).device_index(c10::cuda::current_device()).dtype(at::kInt));
  const int64_t threads = int64_t(prm.nrows) * (panels + 1);
  reuse_segments_kernel<T, Acc><<<int((threads + 255) / 256), 256, 0, stream>>>(prm, seg.mutable_data_ptr<int32_t>(),
                                                                                 panels, PC);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  constexpr int smem = 2 * kPanelBytes;
  auto kernel = reuse_spmm_kernel<T, Acc, P, RW>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  // The smallest shared-memory carve-out that holds the block (plus the 1 KB the system reserves a block), so
  // that the rest of the SM's memory is L1: left to itself the driver may pick the largest carve-out.
  int sm_bytes = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sm_bytes, cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                                        c10::cuda::current_device()));
  const int carveout = std::min(100, int((int64_t(smem + 1024) * 100 + sm_bytes - 1) / sm_bytes));
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, carveout));
  const dim3 grid((prm.nrows + R - 1) / R, prm.ldb / (32 * P));
  kernel<<<grid, kThreads, smem, stream>>>(prm, seg.const_data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// half_window: 8 rows a warp (128-row windows) instead of rows_per_warp's 16.
template <typename T, typename Acc>
void launch(const Params<T, Acc>& prm, bool half_window) {
  constexpr int RW = rows_per_warp<Acc>();
  if (pick_p(prm.ldb) == 4) {
    if (half_window) return launch_p<T, Acc, 4, 8>(prm);
    return launch_p<T, Acc, 4, RW>(prm);
  }
  return launch_p<T, Acc, 1, RW>(prm);
}

}  // namespace reuse
