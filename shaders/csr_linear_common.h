// Helpers shared by the kernels in shaders/*.metal. torch.mps.compile_shader inlines only torch's own
// <c10/metal/...> headers, so the loader (torch_sparse_metal/backends/mps.py) concatenates this file in
// front of each .metal source; the .metal files therefore never #include it (hence no include guard either).
// In front of it the loader defines the host's layout numbers (TSM_<NAME>, backends/metal.py shader_defines): the
// constants below and in the shaders take them from there, so that the host's grids and the kernels' tiles agree.
//
// Conventions of every kernel here:
// - index tensors are int32; sizes arrive as Python ints, i.e. 64-bit (`constant long&`), and are narrowed
//   once to uint at the top of a kernel (the host guarantees every size and index fits int32);
// - outputs come first in the argument list, then inputs, then sizes;
// - helpers are `inline` (the CUDA translation of docs/metal.md relies on it) and accumulate in float.
#include <metal_stdlib>
using namespace metal;

#if !defined(TSM_SIMD_WIDTH) || !defined(TSM_MAX_ROWS) || !defined(TSM_FOR_EACH_METAL_TYPE)
#error "compile the shaders through torch_sparse_metal.backends.metal_source.load_source, which defines the host's constants"
#endif

// A kernel template instantiated under a host name, as MLX does: the signature is the template's (decltype), so
// it is written once. TSM_INSTANTIATE("spmm_float_p4", spmm, float, 4)
#define TSM_INSTANTIATE(name, func, ...) \
  template [[host_name(name)]] [[kernel]] decltype(func<__VA_ARGS__>) func<__VA_ARGS__>;

namespace tsm {

// Atomic float add on device memory (Metal 3 / macOS 13+ has atomic<float>). Relaxed order suffices:
// the value is only read by a later dispatch, which Metal orders after this one.
inline void atomic_add(device atomic<float>* p, float v) {
  atomic_fetch_add_explicit(p, v, memory_order_relaxed);
}

// Index guards. The host checks shapes only (reading index values would wait for the GPU), so a kernel clamps
// every index it reads into its tensor and records a bad one in that index array's error word, which
// torch_sparse_metal.check_index_errors reads (docs/architecture.md, "Index safety"): a malformed topology
// gives meaningless results, but no access leaves its tensors. A thread remembers a bad index in a register and
// reports it once, at its end (a device store inside the edge loop would serialise the index loads around it).

// v clamped into [0, limit) (compared unsigned, so negatives clamp too); `seen` keeps the largest value met, as
// unsigned, for report_index (two min/max per index, no branch).
inline uint checked_index(int v, uint limit, thread uint& seen) {
  seen = max(seen, uint(v));
  return min(uint(v), limit - 1);
}

// Row r's edge range [begin, end) of the CSR pointer array ptr over `edges` edges, clamped to begin <= end <=
// edges; an array that does not start at 0, decreases, or does not end at `edges` sets `bad`.
struct EdgeRange {
  int begin, end;
};
inline EdgeRange checked_range(device const int* ptr, uint r, uint nrows, uint edges, thread bool& bad) {
  const int b = ptr[r], e = ptr[r + 1];
  const int lo = int(min(uint(b), edges));
  const int hi = min(max(e, lo), int(edges));  // signed: a negative end empties the row rather than reaching nnz
  bad = bad || lo != b || hi != e || (r == 0 && b != 0) || (r + 1 == nrows && e != int(edges));
  return EdgeRange{lo, hi};
}

// Sets the error word if this thread met a bad index (words are only ever set to 1; many threads may).
inline void report(bool bad, device atomic_uint* error) {
  if (bad) {
    atomic_store_explicit(error, 1u, memory_order_relaxed);
  }
}

// The tiled kernels: a SIMD-group of 32 lanes owns one CSR row and one chunk of 32 * P batch columns of a
// feature-major operand; lane l holds the P consecutive columns l * P .. l * P + P - 1 of the chunk. A
// threadgroup holds up to kMaxRows SIMD-groups, which take consecutive rows of the same chunk.
constant constexpr uint kSimdWidth = TSM_SIMD_WIDTH;
constant constexpr uint kMaxRows = TSM_MAX_ROWS;

// The row-window SpMM (spmm_window): the gathered operand is staged in panels of kPanelBytes of threadgroup
// memory (half of the 32 KB a threadgroup may hold, so that two threadgroups can share a core's), i.e.
// kPanelBytes / (32 * P * sizeof(T)) features of one chunk of 32 * P batch columns; a SIMD-group owns
// TSM_WINDOW_ROWS_P<P> rows of the window (the host's WINDOW_ROWS: 16 at P = 1, 8 at P = 4; its sums, cursors
// and edge chunks stay in registers). docs/metal.md, "The row-window SpMM", gives the arithmetic.
constant constexpr uint kPanelBytes = 16384;
// vec<T, 4> without a comma, for threadgroup storage declarations (the executor's rewrite finds a declaration by
// its statement holding no comma outside array sizes: tsm_dev/msl/source.py).
template <typename T>
using vec4 = vec<T, 4>;

// P consecutive values from element i (a multiple of P) of a staged panel, as float: one vector load per 4.
template <typename T, int P>
inline void load_staged(threadgroup const vec4<T>* panel, uint i, thread float* v) {
  if (P % 4 == 0) {
    for (int q = 0; q < P; q += 4) {
      const vec<T, 4> f = panel[(i + q) / 4];
      v[q] = float(f.x);
      v[q + 1] = float(f.y);
      v[q + 2] = float(f.z);
      v[q + 3] = float(f.w);
    }
  } else {
    threadgroup const T* s = (threadgroup const T*)panel + i;
    for (int q = 0; q < P; ++q) {
      v[q] = float(s[q]);
    }
  }
}

// Row length of the threadgroup tile that moves a chunk between lanes and batch-major memory: one padding
// element, so that reading a column of the tile does not hit one memory bank 32 times.
template <int P>
inline uint tile_stride() {
  return kSimdWidth * P + 1;
}

// Component `lane` of v for lanes 0..3 (selects, not a dynamic index: v stays in registers).
inline float lane_component(float4 v, uint lane) {
  return lane == 0 ? v.x : lane == 1 ? v.y : lane == 2 ? v.z : v.w;
}

// One step of a SIMD-group reduce-scatter: of the 2W values v[0 .. 2W), a lane keeps the upper half if its lane
// bit W is set, else the lower half, and adds the share its partner (lane ^ W) holds of the half it keeps.
template <int W>
inline void scatter_step(thread float* v, uint lane) {
  const bool upper = (lane & W) != 0;
  for (int i = 0; i < W; ++i) {
    const float send = upper ? v[i] : v[i + W];
    const float keep = upper ? v[i + W] : v[i];
    v[i] = keep + simd_shuffle_xor(send, ushort(W));
  }
}

// v[u] (u < 16) is this lane's share of value u; returns the SIMD-group's total of value lane % 16. The
// shuffles of a step are independent, and 16 sums take 31 shuffles in 5 rounds (16 simd_sums: 80 in 5 rounds).
inline float reduce_scatter16(thread float* v, uint lane) {
  for (int i = 0; i < 16; ++i) {
    v[i] += simd_shuffle_xor(v[i], ushort(16));
  }
  scatter_step<8>(v, lane);
  scatter_step<4>(v, lane);
  scatter_step<2>(v, lane);
  scatter_step<1>(v, lane);
  return v[0];
}

// P consecutive values at p (16-byte aligned when P is a multiple of 4), as float: one vector load per 4.
template <typename T, int P>
inline void load_lanes(device const T* p, thread float* v) {
  if (P % 4 == 0) {
    for (int q = 0; q < P; q += 4) {
      const vec<T, 4> f = *((device const vec<T, 4>*)(p + q));
      v[q] = float(f.x);
      v[q + 1] = float(f.y);
      v[q + 2] = float(f.z);
      v[q + 3] = float(f.w);
    }
  } else {
    for (int q = 0; q < P; ++q) {
      v[q] = float(p[q]);
    }
  }
}

// Block (rows r0 .. r0 + rows, batch columns n0 .. n0 + 32 * P) of a batch-major [batch, nrows] matrix a,
// read through the tile so that global reads run along a row of a; returns this lane's P values of row
// r0 + simd (zero outside the matrix). Every thread of the threadgroup must call it (barriers).
template <typename T, int P>
inline void load_block(thread float* v, threadgroup float* tile, device const T* a, uint nrows, uint batch,
                       uint r0, uint n0, uint rows, uint simd, uint lane, uint tid) {
  const uint cw = kSimdWidth * P, stride = tile_stride<P>();
  const uint rows_here = min(rows, nrows - r0), cols_here = min(cw, batch - n0);
  for (uint i = tid; i < rows * cw; i += rows * kSimdWidth) {
    const uint row = i % rows, b = i / rows;
    tile[row * stride + b] = (row < rows_here && b < cols_here) ? float(a[ulong(n0 + b) * nrows + r0 + row]) : 0.0f;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int q = 0; q < P; ++q) {
    v[q] = tile[simd * stride + lane * P + q];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);  // the caller may reuse the tile
}

// The inverse of load_block: writes each lane's P values of row r0 + simd into the batch-major [batch, nrows]
// matrix out, through the tile, so that global writes run along a row of out. Every thread must call it.
template <typename T, int P>
inline void store_block(device T* out, threadgroup float* tile, thread const float* v, uint nrows, uint batch,
                        uint r0, uint n0, uint rows, uint simd, uint lane, uint tid) {
  const uint cw = kSimdWidth * P, stride = tile_stride<P>();
  for (int q = 0; q < P; ++q) {
    tile[simd * stride + lane * P + q] = v[q];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint rows_here = min(rows, nrows - r0), cols_here = min(cw, batch - n0);
  for (uint i = tid; i < rows * cw; i += rows * kSimdWidth) {
    const uint row = i % rows, b = i / rows;
    if (row < rows_here && b < cols_here) {
      out[ulong(n0 + b) * nrows + r0 + row] = T(tile[row * stride + b]);
    }
  }
}

}  // namespace tsm
