// The unstructured layout (weight [E]) of the CUDA backend of the csr_linear ops: its kernels and its forward and
// backward (layout_forward_cuda / layout_backward_cuda), called by the ops in csr_linear_cuda.cu; the vector
// layout's are in vector_csr_linear_cuda.cu (see docs/architecture.md for the contract, docs/cuda.md for the
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
// - Several edges' rows are in flight per warp (kInFlight), read from L2. The batch chunks of a row run in
//   separate blocks of grid.y, so the blocks resident at one time share a chunk and its slice of the gathered
//   operand stays in L2.
// - fused_atomic on 16-bit values issues more instructions per edge than the gathers need time (the SDDMM
//   reduction), so at large sizes its lanes take 32 bytes of a row instead of 16 (wide_lanes): the per-edge
//   work then covers twice the columns.
// - The weight gradient (an SDDMM) is a reduction per edge over the warp's batch chunk, then one atomicAdd
//   per (edge, chunk) in fused_atomic, or an exclusive read-modify-write in atomic_free pass 1, whose block
//   loops over all chunks itself. fused_atomic reduces 16 edges (8 at P >= 8) at a time with one reduce-scatter
//   (lane u ends with edge u's sum); atomic_free pass 1 reduces each edge with a butterfly (the group of 16
//   measured slower there at 4096x4096, docs/cuda.md).
// - Values are stored as T and summed as Acc (contract.h: float32 for the 16-bit types). grad_w is summed in
//   an Acc buffer, which for 16-bit T is a scratch rounded to T once at the end.
// - Index values are not read on the host (that would wait for the GPU): every index a kernel reads is clamped
//   into its tensor, and a bad one sets the array's device error word (contract.h's TSM_FOR_EACH_INDEX_ARRAY),
//   which take_index_errors reads at the next check (docs/architecture.md, "Index safety").
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <type_traits>
#include <utility>

#include "cuda_common.cuh"

namespace torch_sparse_metal {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;

// The stages of a CSR walk, named as in the CPU kernel table and the Metal kernels (docs/architecture.md, "Where the
// contract lives").
enum class Stage {
  Spmm,             // out[n, r] = sum_k val[k] * bt[col[k], n]: the forward, and atomic_free pass 2 (grad_x)
  SpmmSddmmAtomic,  // Spmm, and gw[k] += sum_n a[n, r] * bt[col[k], n] with atomics (fused_atomic)
  Sddmm,            // gw[k] = sum_n a[n, r] * bt[col[k], n] over the whole batch, no atomics (atomic_free pass 1)
};

template <typename T, typename Acc>
struct Params {
  const int32_t* ptr;  // [nrows + 1] CSR row pointer
  const int32_t* col;  // [E] column (gathered feature) per edge, ascending within a row
  int* ptr_error;      // error words of ptr and col
  int* col_error;
  const T* val;        // [E] edge values (the stages with an SpMM)
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

template <typename Acc>
__device__ __forceinline__ Acc warp_sum(Acc v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  return v;
}

// Resident blocks per SM the register allocation must allow: 2, and 3 for the walks with an SpMM summing in float:
// fused_atomic's 16 SDDMM partial sums, and the SpMM's 8 gathered segments in flight, would otherwise leave room
// for 2 blocks only; the third block hides more gather latency than the registers it costs (docs/cuda.md,
// "Registers of fused_atomic" and "Wide lanes, more edges in flight, faster transposes").
template <typename Acc>
constexpr int min_blocks(Stage s) {
  return (s == Stage::SpmmSddmmAtomic || s == Stage::Spmm) && sizeof(Acc) == 4 ? 3 : 2;
}

// G: edges per SDDMM reduction (16: one reduce-scatter per group; 0: each edge reduced on its own).
template <typename T, typename Acc, int P, Stage S, int G>
__global__ void __launch_bounds__(kThreads, min_blocks<Acc>(S)) csr_tile_kernel(const Params<T, Acc> p) {
  constexpr int CW = 32 * P;  // batch columns per chunk
  constexpr int IO = CW + 1;  // padded row of the batch-major <-> feature-major tile: no bank conflicts
  constexpr bool kSpmm = S != Stage::Sddmm;
  constexpr bool kSddmm = S != Stage::Spmm;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Acc* sm = reinterpret_cast<Acc*>(smem_raw);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int r0 = blockIdx.x * kWarps, r = r0 + warp;
  bool bad_ptr = false;
  unsigned seen_col = 0;
  const int2 range = r < p.nrows ? checked_range(p, r, bad_ptr) : make_int2(0, 0);
  const int begin = range.x, end = range.y;
  const int rows_here = min(kWarps, p.nrows - r0);

  // Stages with an SpMM: one chunk per block (grid.y); the Sddmm stage walks all chunks so that it owns its edges.
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
    auto spmm_update = [&](Acc w, const T (&g)[P]) {
#pragma unroll
      for (int q = 0; q < P; ++q) acc[q] += w * widen<Acc>(g[q]);
    };
    auto partial_dot = [&](const T (&g)[P]) {
      Acc d = Acc(0);
#pragma unroll
      for (int q = 0; q < P; ++q) d += xa[q] * widen<Acc>(g[q]);
      return d;
    };
    auto store_gw = [&](int k, Acc d) {
      if constexpr (S == Stage::SpmmSddmmAtomic) {
        atomicAdd(p.gw + k, d);
      } else {
        p.gw[k] = chunk == 0 ? d : p.gw[k] + d;  // only this thread ever touches gw[k]
      }
    };
    auto value = [&](int k) { return kSpmm ? widen<Acc>(p.val[k]) : Acc(0); };

    const T* bt = p.bt + n0 + lane * P;
    // Edges whose gathered rows are in flight at once per warp, as the rows come from L2 and their latency needs
    // hiding: 64 bytes a lane (four 16-byte segments, or two of 32 bytes), and twice that in the SpMM-only walks,
    // whose registers allow it.
    constexpr int kInFlight = P * sizeof(T) >= 32 ? 2 : S == Stage::Spmm ? 8 : 4;
    if constexpr (kSddmm && G > 0) {
      // Groups of G edges: every lane keeps its partial dot product of each edge, and one reduce-scatter leaves
      // lane u with edge u's sum: 31 shuffles and one warp-wide store per 16 edges (G = 16) instead of 5
      // shuffles and a single-lane store per edge.
      constexpr int U = G < kInFlight ? G : kInFlight;
      for (int kb = begin; kb < end; kb += G) {
        const int n = min(G, end - kb);  // warp-uniform
        Acc part[G];
#pragma unroll
        for (int u = 0; u < G; ++u) part[u] = Acc(0);
#pragma unroll
        for (int u0 = 0; u0 < G; u0 += U) {
          if (u0 < n) {
            int c[U];
            T g[U][P];
#pragma unroll
            for (int u = 0; u < U; ++u)
              c[u] = u0 + u < n ? checked_index(p.col[kb + u0 + u], p.ncols, seen_col) : 0;
#pragma unroll
            for (int u = 0; u < U; ++u)
              if (u0 + u < n) load_vec<T, P>(bt + int64_t(c[u]) * p.ldb, g[u]);
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
      auto edge = [&](int k, const T (&g)[P]) {
        if constexpr (kSpmm) spmm_update(value(k), g);
        if constexpr (kSddmm) {
          const Acc d = warp_sum(partial_dot(g));
          if (lane == 0) store_gw(k, d);
        }
      };
      int k = begin;
      for (; k + kInFlight <= end; k += kInFlight) {
        int c[kInFlight];
        T g[kInFlight][P];
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) c[u] = checked_index(p.col[k + u], p.ncols, seen_col);
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) load_vec<T, P>(bt + int64_t(c[u]) * p.ldb, g[u]);
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) edge(k + u, g[u]);
      }
      for (; k < end; ++k) {
        T g[P];
        load_vec<T, P>(bt + int64_t(checked_index(p.col[k], p.ncols, seen_col)) * p.ldb, g);
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

// The feature-major, zero-padded copy of the gathered operand: out[c, n] = in[n, c] for n < batch, 0 for
// batch <= n < ldb. One block of 32 x 8 threads moves a tile of 32V x 32V values, V = values per 4-byte word (2
// for 16-bit T), so that a warp reads and writes 128 contiguous bytes of a row in word accesses. The shared
// tile's row stride is odd (in values), so that the column reads of the second phase fall in distinct banks.
constexpr int kTransposeRows = 8;  // blockDim.y of the transpose: 32 x 8 threads

template <typename T>
struct Transpose {
  static constexpr int V = sizeof(T) < 4 ? 4 / sizeof(T) : 1;
  static constexpr int W = 32 * V;  // tile side
  const T* in;
  T* out;
  int batch, cols, ldb;
  bool word_rows;  // rows of `in` start word-aligned, so a word read never straddles two rows
  __host__ __device__ int tiles() const { return (cols + W - 1) / W * ((ldb + W - 1) / W); }
};

template <typename T>
__device__ __forceinline__ void transpose_tile(const Transpose<T>& t, int tile) {
  constexpr int V = Transpose<T>::V, W = Transpose<T>::W, S = W + 1;
  using Word = std::conditional_t<V == 1, T, uint32_t>;
  __shared__ T sm[W * S];
  const int tx = threadIdx.x, tiles_x = (t.cols + W - 1) / W;
  const int c0 = tile % tiles_x * W, n0 = tile / tiles_x * W;
  // All of a thread's reads are issued before its first store into the tile, so that they are in flight together.
  constexpr int R = W / kTransposeRows;
  T v[R][V];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int n = n0 + threadIdx.y + r * kTransposeRows, c = c0 + V * tx;
    if (V > 1 && t.word_rows && n < t.batch && c + V <= t.cols) {
      const Word word = *reinterpret_cast<const Word*>(t.in + int64_t(n) * t.cols + c);
      memcpy(v[r], &word, sizeof(word));
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i)
        v[r][i] = (n < t.batch && c + i < t.cols) ? t.in[int64_t(n) * t.cols + c + i] : narrow<T>(0.0f);
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int i = 0; i < V; ++i) sm[(threadIdx.y + r * kTransposeRows) * S + V * tx + i] = v[r][i];
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int y = threadIdx.y + r * kTransposeRows, c = c0 + y, n = n0 + V * tx;
    if (c >= t.cols || n >= t.ldb) continue;  // ldb is a multiple of 32: a word lies wholly inside or outside it
    T out[V];
#pragma unroll
    for (int i = 0; i < V; ++i) out[i] = sm[(V * tx + i) * S + y];
    Word word;
    memcpy(&word, out, sizeof(word));
    *reinterpret_cast<Word*>(t.out + int64_t(c) * t.ldb + n) = word;
  }
}

template <typename T>
__global__ void __launch_bounds__(256) transpose_pad_kernel(const Transpose<T> t) {
  transpose_tile(t, blockIdx.x);
}

// out[i] = in[index[i]] over n elements, a bad index guarded: the forward's edge values in by-destination order.
// A block of 256 threads gathers 1024 values, four a thread, their reads in flight together.
template <typename T>
struct Gather {
  static constexpr int kPerBlock = 1024;
  const T* in;
  const int32_t* index;
  T* out;
  int n;
  int* error;
  __host__ __device__ int blocks() const { return (n + kPerBlock - 1) / kPerBlock; }
};

template <typename T>
__device__ __forceinline__ void gather_block(const Gather<T>& g, int block) {
  constexpr int kThreadsHere = 32 * kTransposeRows;  // launched with the transpose's block shape
  constexpr int kEach = Gather<T>::kPerBlock / kThreadsHere;
  const int i0 = block * Gather<T>::kPerBlock + threadIdx.y * blockDim.x + threadIdx.x;
  unsigned seen = 0;
  T v[kEach];
#pragma unroll
  for (int j = 0; j < kEach; ++j) {
    const int i = i0 + j * kThreadsHere;
    if (i < g.n) v[j] = g.in[checked_index(g.index[i], g.n, seen)];
  }
#pragma unroll
  for (int j = 0; j < kEach; ++j) {
    const int i = i0 + j * kThreadsHere;
    if (i < g.n) g.out[i] = v[j];
  }
  if (seen >= static_cast<unsigned>(g.n)) *g.error = 1;
}

// The forward's two preparations in one launch, so that they run side by side: the transposed input (the first
// t.tiles() blocks) and the edge values in by-destination order (the rest).
template <typename T>
__global__ void __launch_bounds__(256) forward_operands_kernel(const Transpose<T> t, const Gather<T> g) {
  const int tiles = t.tiles();
  if (static_cast<int>(blockIdx.x) < tiles) {
    transpose_tile(t, blockIdx.x);
  } else {
    gather_block(g, blockIdx.x - tiles);
  }
}

// Batch values per lane: 16 bytes per gathered row and lane (P = 4 for 4-byte values, 8 for 2-byte ones, which
// also halves the per-edge work per column), unless the batch is small: P = 1 up to 32, and 4 up to 128. This
// sets the padding of the gathered operand; a launch may then take 32 bytes a lane (wide_lanes).
inline int pick_p(int64_t batch, int64_t value_bytes) {
  if (batch <= 32) return 1;
  return value_bytes == 2 && batch > 128 ? 8 : 4;
}

// Whether fused_atomic on 16-bit values takes 32 bytes a lane (P = 16) instead of 16: a lane then reads two
// 16-byte segments per edge, so that the per-edge work (index and value loads, index checks, the SDDMM reduction
// and its atomic), which bounds this kernel where a segment holds 8 values, is spent on twice the columns (the
// SpMM-only walks are bound by L2 reads instead, and were slower so: docs/cuda.md). Taken where the padded batch
// holds whole chunks of twice the width and the blocks still fill the GPU four times over.
inline bool wide_lanes(int p, int value_bytes, int nrows, int ldb) {
  if (value_bytes != 2 || p != 8 || ldb % (64 * p) != 0) return false;
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  return int64_t(nrows + kWarps - 1) / kWarps * (ldb / (64 * p)) >= 4 * int64_t(sms);
}

// The [cols, ldb] feature-major, zero-padded copy of a contiguous [batch, cols] tensor (allocated) and the
// transpose that fills it (not yet launched). `t` must stay alive until the transpose is launched.
template <typename T>
std::pair<at::Tensor, Transpose<T>> feature_major(const at::Tensor& t, int64_t ldb) {
  const int64_t batch = t.size(0), cols = t.size(1);
  at::Tensor out = at::empty({cols, ldb}, t.options());
  const bool word_rows = cols % Transpose<T>::V == 0 && reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 4 == 0;
  return {out, Transpose<T>{device_ptr<T>(t), device_ptr<T>(out), int(batch), int(cols), int(ldb), word_rows}};
}

template <typename T>
void launch_transpose(const Transpose<T>& t) {
  if (t.tiles() == 0) return;
  transpose_pad_kernel<T><<<t.tiles(), dim3(32, kTransposeRows), 0, c10::cuda::getCurrentCUDAStream()>>>(t);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The SDDMM group of a stage (docs/cuda.md): per edge for Sddmm (atomic_free pass 1); for SpmmSddmmAtomic 16 edges,
// or 8 at P = 8, whose 8 SpMM sums a lane beside 16 partial sums would pass min_blocks' register cap and spill.
template <Stage S, int P>
constexpr int sddmm_group() {
  return S != Stage::SpmmSddmmAtomic ? 0 : P > 4 ? 8 : 16;
}

template <typename T, typename Acc, int P, Stage S>
void launch_one(const Params<T, Acc>& prm, int chunks) {
  constexpr int G = sddmm_group<S, P>();
  const size_t smem = size_t(kWarps) * (32 * P + 1) * sizeof(Acc);
  auto kernel = csr_tile_kernel<T, Acc, P, S, G>;
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
  }
  const dim3 grid((prm.nrows + kWarps - 1) / kWarps, S == Stage::Sddmm ? 1 : chunks);
  kernel<<<grid, kThreads, smem, c10::cuda::getCurrentCUDAStream()>>>(prm);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// One CSR walk: picks the chunk width.
template <Stage S, typename T, typename Acc>
void launch(const Params<T, Acc>& prm) {
  if (prm.nrows == 0) return;
  int p = pick_p(prm.batch, sizeof(T));
  if (S == Stage::SpmmSddmmAtomic && wide_lanes(p, sizeof(T), prm.nrows, prm.ldb)) p *= 2;
  const int chunks = prm.ldb / (32 * p);
  if (chunks == 0) return;
  if (p == 1) return launch_one<T, Acc, 1, S>(prm, chunks);
  if constexpr (sizeof(T) == 2) {
    if (p == 8) return launch_one<T, Acc, 8, S>(prm, chunks);
    if constexpr (S == Stage::SpmmSddmmAtomic) {
      if (p == 16) return launch_one<T, Acc, 16, S>(prm, chunks);
    }
  }
  return launch_one<T, Acc, 4, S>(prm, chunks);
}

inline int64_t padded_batch(int64_t batch, int64_t value_bytes) {
  const int64_t cw = 32 * pick_p(batch, value_bytes);
  return (batch + cw - 1) / cw * cw;
}

// The unstructured layout's backward: CSR walks over sources, a member function per strategy (run_strategy).
template <typename T, typename Acc>
struct WalkBackward {
  const Params<T, Acc>& prm;
  void fused_atomic() { launch<Stage::SpmmSddmmAtomic>(prm); }  // one dispatch
  void atomic_free() {
    launch<Stage::Sddmm>(prm);  // pass 1: grad_w, per edge
    launch<Stage::Spmm>(prm);   // pass 2: grad_x, per source
  }
};

}  // namespace

// The unstructured layout's forward (weight [E]): the edge values gathered into by-destination order and x made
// feature-major in one dispatch, then the SpMM over outputs.
template <>
void layout_forward_cuda<Layout::Unstructured>(const at::Tensor& x, const at::Tensor& weight,
                                               const at::Tensor& col_ptr, const at::Tensor& src_by_dst,
                                               const at::Tensor& perm, at::Tensor& y) {
  const int64_t batch = x.size(0), in_features = x.size(1), out_features = col_ptr.numel() - 1;
  const int64_t ldb = padded_batch(batch, x.element_size());
  const int64_t edges = weight.numel();
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  // Edge values in by-destination order: one gather per call instead of an indirection per (edge, chunk).
  at::Tensor w_by_dst = at::empty_like(wc);
  dispatch_value_type(x.scalar_type(), "csr_linear_cuda", [&](auto types) {
    using T = typename DeviceType<typename decltype(types)::T>::type;
    using Acc = typename decltype(types)::Acc;
    const auto [xt, transpose] = feature_major<T>(xc, ldb);
    const Gather<T> gather{device_ptr<T>(wc), perm.const_data_ptr<int32_t>(), device_ptr<T>(w_by_dst), int(edges),
                           error_word(x.device(), IndexArray::perm)};
    forward_operands_kernel<T><<<transpose.tiles() + gather.blocks(), dim3(32, kTransposeRows), 0,
                                 c10::cuda::getCurrentCUDAStream()>>>(transpose, gather);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    const Params<T, Acc> prm{col_ptr.const_data_ptr<int32_t>(), src_by_dst.const_data_ptr<int32_t>(),
                             error_word(x.device(), IndexArray::col_ptr),
                             error_word(x.device(), IndexArray::src_by_dst),
                             device_ptr<T>(w_by_dst), device_ptr<T>(xt), nullptr, device_ptr<T>(y), nullptr,
                             int(out_features), int(in_features), int(batch), int(ldb), int(edges)};
    launch<Stage::Spmm>(prm);
  });
}

template <>
void layout_backward_cuda<Layout::Unstructured>(BackwardCall& call, Strategy which) {
  const at::Tensor& x = call.x;
  const int64_t batch = x.size(0), in_features = x.size(1), out_features = call.grad_out.size(1);
  const int64_t ldb = padded_batch(batch, x.element_size());
  dispatch_value_type(x.scalar_type(), "csr_linear_backward_cuda", [&](auto types) {
    using T = typename DeviceType<typename decltype(types)::T>::type;
    using Acc = typename decltype(types)::Acc;
    const auto [gt, transpose] = feature_major<T>(call.grad_out, ldb);
    launch_transpose(transpose);
    const Params<T, Acc> prm{call.row_ptr.const_data_ptr<int32_t>(), call.dst.const_data_ptr<int32_t>(),
                             error_word(x.device(), IndexArray::row_ptr), error_word(x.device(), IndexArray::dst),
                             device_ptr<T>(call.weight), device_ptr<T>(gt), device_ptr<T>(x),
                             device_ptr<T>(call.grad_x), device_ptr<Acc>(call.grad_w), int(in_features),
                             int(out_features), int(batch), int(ldb), int(call.weight.numel())};
    WalkBackward<T, Acc> run{prm};
    run_strategy(which, run);
  });
}

}  // namespace torch_sparse_metal
