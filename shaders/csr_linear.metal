// Metal kernels of torch_sparse_metal::csr_linear (forward) and csr_linear_backward (both strategies).
//
// The loader (torch_sparse_metal/backends/mps.py) prepends shaders/csr_linear_common.h; every kernel is a
// template over the value type T (and the batch values per lane P), instantiated at the end of this file as
// `<stage>_<T>` or `<stage>_<T>_p<P>` by one macro.
//
// Design. The op contract's activations are batch-major ([N, features]). A sparse layer gathers rows of one
// operand at random feature indices (x in the forward, grad_out in the backward); read batch-major, lanes of
// a SIMD-group that take different batch elements touch a different cache line each. So each op first copies
// the gathered operand to a feature-major, zero-padded [features, ldb] buffer (its <op>_operands kernel, which
// prepares the op's other operands in the same dispatch), and every other kernel walks one CSR row per
// SIMD-group with its 32 lanes spread over a chunk of 32 * P consecutive batch columns (P = 4: one 16-byte
// load per lane and gathered row, 512 contiguous bytes per SIMD-group).
// A row's own batch-major operand and output (x in the fused backward; y or grad_x) go through threadgroup
// memory (tsm::load_block / store_block), so that they too are read and written along rows. The weight
// gradient of an edge is a dot product over the batch: fused_atomic reduces each chunk's parts across the
// SIMD-group (16 edges per reduce-scatter) and adds them atomically, once per (edge, chunk); atomic_free's
// owner of an edge sums the whole batch in registers (x feature-major too) and stores once.
//
// Kernels, with the host's grid (`threads=`) and threadgroup (`group_size=`); R SIMD-groups per group. The tiled
// stages' names are the CPU and CUDA kernels' too (docs/architecture.md, "Where the contract lives"), and
// forward_operands is the CUDA forward's forward_operands_kernel:
//   forward_operands_T        (32*(tiles(in)+ceil(E/1024)), R), (32, R)   x feature-major; weight[perm]
//   fused_atomic_operands_T   (32*(tiles(out)+ceil(E/1024)), R), (32, R)  grad_out feature-major; grad_w = 0
//   atomic_free_operands_T    (32*(tiles(out)+tiles(in)), R), (32, R)      grad_out and x feature-major
//     (tiles(cols) = ceil(cols/32) * ldb/32: the 32 x 32 tiles of one feature-major copy)
// Every index a kernel reads goes through tsm::checked_index / checked_range (csr_linear_common.h); `errors`
// are the error words of the kernel's pointer array (errors[0]) and index array (errors[1]).
//   spmm_T_pP                 (ceil(rows/R)*32R, ldb/(32P)), (32R, 1)  forward, and atomic_free pass 2: grad_x
//   spmm_window_T_pP          (ceil(rows/(R*J))*32R, ldb/(32P)), (32R, 1)  the same, operand staged (tuned)
//   spmm_sddmm_atomic_T_pP    (ceil(in/R)*32R, ldb/(32P)), (32R, 1)   fused_atomic: grad_x and grad_w
//   sddmm_T_pP                32 * in, 32R                             atomic_free pass 1: grad_w, whole batch

// ---------------------------------------------------------------------------------------------- operands
// Each op prepares its kernels' operands in one dispatch: a 1-D row of threadgroups of (32, R) threads, whose
// first threadgroups each copy one 32 x 32 tile of a batch-major operand to its feature-major, zero-padded copy
// (feature_major_tile), and whose remaining threadgroups do the op's other job: the forward gathers its edge values
// into by-destination order and fused_atomic zero-fills its float32 grad_w, kBlockElems elements a threadgroup;
// atomic_free copies its second operand feature-major too. Which job a threadgroup does depends on its index
// alone, so the tile's barrier stays uniform within a threadgroup, and the jobs run side by side.
#if !defined(TSM_TILE_WIDTH) || !defined(TSM_BLOCK_ELEMS) || !defined(TSM_WINDOW_ROWS_P1) || !defined(TSM_WINDOW_ROWS_P4)
#error "compile through torch_sparse_metal.backends.mps.load_source, which defines this family's constants"
#endif
constant constexpr uint kTileWidth = TSM_TILE_WIDTH;
constant constexpr uint kTileStride = kTileWidth + 1;
constant constexpr uint kBlockElems = TSM_BLOCK_ELEMS;

// Tiles of a [batch, cols] operand copied to [cols, ldb]: ceil(cols / 32) along the features times ldb / 32 along
// the (padded) batch.
inline uint feature_major_tiles(uint cols, ulong ldb) {
  return (cols + kTileWidth - 1) / kTileWidth * uint(ldb / kTileWidth);
}

// Tile t of out[c, n] = in[n, c] for n < batch, 0 for batch <= n < ldb (t runs along the features first). The tile
// goes through threadgroup memory (rows padded to 33: the transposed read does not hit one bank 32 times), so the
// read of `in` and the write of `out` are both contiguous across a SIMD-group (one SIMD-group = one row of the
// group, 32 lanes wide). Every thread of the threadgroup must call it (a barrier).
template <typename T>
inline void feature_major_tile(device T* out, device const T* in, uint batch, uint cols, ulong ldb, uint t,
                               threadgroup T* tile, uint2 lid, uint rows) {
  const uint col_tiles = (cols + kTileWidth - 1) / kTileWidth;
  const uint c0 = t % col_tiles * kTileWidth, n0 = t / col_tiles * kTileWidth;
  for (uint y = lid.y; y < kTileWidth; y += rows) {
    const uint n = n0 + y, c = c0 + lid.x;
    tile[y * kTileStride + lid.x] = (n < batch && c < cols) ? in[ulong(n) * cols + c] : T(0);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint y = lid.y; y < kTileWidth; y += rows) {
    const uint c = c0 + y;
    if (c < cols) {
      out[ulong(c) * ldb + n0 + lid.x] = tile[lid.x * kTileStride + y];
    }
  }
}

// The forward's operands: x feature-major (the first feature_major_tiles(cols, ldb) threadgroups), and
// w_by_dst[i] = weight[perm[i]] (the rest, kBlockElems edges each): the edge values in by-destination order, once
// per call rather than one indirection per (edge, chunk) inside spmm. A bad perm entry is clamped and recorded in
// `error` (perm's error word).
template <typename T>
[[kernel]] void forward_operands(
    device T* xt [[buffer(0)]],
    device T* w_by_dst [[buffer(1)]],
    device const T* x [[buffer(2)]],
    device const T* weight [[buffer(3)]],
    device const int* perm [[buffer(4)]],
    device atomic_uint* error [[buffer(5)]],
    constant long& batch [[buffer(6)]],
    constant long& cols [[buffer(7)]],
    constant long& ldb [[buffer(8)]],
    constant long& nnz [[buffer(9)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint2 lid [[thread_position_in_threadgroup]],
    uint2 size [[threads_per_threadgroup]]) {
  threadgroup T tile[kTileWidth * kTileStride];
  const uint tiles = feature_major_tiles(uint(cols), ulong(ldb));
  if (group.x < tiles) {
    feature_major_tile(xt, x, uint(batch), uint(cols), ulong(ldb), group.x, tile, lid, size.y);
    return;
  }
  const uint n = uint(nnz), i0 = (group.x - tiles) * kBlockElems;
  uint seen = 0;
  for (uint i = i0 + lid.y * size.x + lid.x; i < min(i0 + kBlockElems, n); i += size.x * size.y) {
    w_by_dst[i] = weight[tsm::checked_index(perm[i], n, seen)];
  }
  tsm::report(seen >= n, error);
}

// fused_atomic's operands: grad_out feature-major (the first feature_major_tiles(cols, ldb) threadgroups), and the
// float32 grad_w its atomics add into, zero-filled (the rest, kBlockElems elements each).
template <typename T>
[[kernel]] void fused_atomic_operands(
    device T* gt [[buffer(0)]],
    device float* grad_w [[buffer(1)]],
    device const T* grad_out [[buffer(2)]],
    constant long& batch [[buffer(3)]],
    constant long& cols [[buffer(4)]],
    constant long& ldb [[buffer(5)]],
    constant long& nnz [[buffer(6)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint2 lid [[thread_position_in_threadgroup]],
    uint2 size [[threads_per_threadgroup]]) {
  threadgroup T tile[kTileWidth * kTileStride];
  const uint tiles = feature_major_tiles(uint(cols), ulong(ldb));
  if (group.x < tiles) {
    feature_major_tile(gt, grad_out, uint(batch), uint(cols), ulong(ldb), group.x, tile, lid, size.y);
    return;
  }
  const uint n = uint(nnz), i0 = (group.x - tiles) * kBlockElems;
  for (uint i = i0 + lid.y * size.x + lid.x; i < min(i0 + kBlockElems, n); i += size.x * size.y) {
    grad_w[i] = 0.0f;
  }
}

// atomic_free's operands: grad_out and x feature-major with the same ldb (sddmm reads both), grad_out's tiles
// first (feature_major_tiles(out_features, ldb) threadgroups), then x's.
template <typename T>
[[kernel]] void atomic_free_operands(
    device T* gt [[buffer(0)]],
    device T* xt [[buffer(1)]],
    device const T* grad_out [[buffer(2)]],
    device const T* x [[buffer(3)]],
    constant long& batch [[buffer(4)]],
    constant long& out_features [[buffer(5)]],
    constant long& in_features [[buffer(6)]],
    constant long& ldb [[buffer(7)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint2 lid [[thread_position_in_threadgroup]],
    uint2 size [[threads_per_threadgroup]]) {
  threadgroup T tile[kTileWidth * kTileStride];
  const uint n_out = uint(out_features), n_in = uint(in_features);
  const uint out_tiles = feature_major_tiles(n_out, ulong(ldb));
  if (group.x < out_tiles) {
    feature_major_tile(gt, grad_out, uint(batch), n_out, ulong(ldb), group.x, tile, lid, size.y);
  } else {
    feature_major_tile(xt, x, uint(batch), n_in, ulong(ldb), group.x - out_tiles, tile, lid, size.y);
  }
}

// -------------------------------------------------------------- spmm: the forward, and atomic_free pass 2
// out[n, r] = sum_{k in ptr[r] .. ptr[r+1]} val[k] * bt[col[k], n]   for n < batch   ([batch, nrows], written once)
//
// The forward: rows = outputs (col_ptr, src_by_dst, edge values gathered by perm), bt = x feature-major.
// atomic_free pass 2: rows = sources (row_ptr, dst, weight), bt = grad_out feature-major; out = grad_x.
// Four edges are in flight per SIMD-group: their index and value loads are the same address in every lane
// (one broadcast each), their gathered segments independent loads.
template <typename T, int P>
[[kernel]] void spmm(
    device T* out [[buffer(0)]],
    device const T* val [[buffer(1)]],
    device const T* bt [[buffer(2)]],
    device const int* ptr [[buffer(3)]],
    device const int* col [[buffer(4)]],
    device atomic_uint* errors [[buffer(5)]],
    constant long& batch [[buffer(6)]],
    constant long& nrows [[buffer(7)]],
    constant long& ncols [[buffer(8)]],
    constant long& nnz [[buffer(9)]],
    constant long& ldb [[buffer(10)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint simd [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint rows [[simdgroups_per_threadgroup]]) {
  threadgroup float tile[tsm::kMaxRows * (tsm::kSimdWidth * P + 1)];
  const uint n_rows = uint(nrows), n_cols = uint(ncols), n_batch = uint(batch);
  const uint r0 = group.x * rows, r = r0 + simd, n0 = group.y * (tsm::kSimdWidth * P);
  const ulong ld = ulong(ldb);
  device const T* seg = bt + n0 + lane * P;
  float acc[P];
  for (int q = 0; q < P; ++q) {
    acc[q] = 0.0f;
  }
  bool bad_ptr = false;
  uint seen_col = 0;
  if (r < n_rows) {
    const tsm::EdgeRange range = tsm::checked_range(ptr, r, n_rows, uint(nnz), bad_ptr);
    const int end = range.end;
    int k = range.begin;
    for (; k + 4 <= end; k += 4) {
      float g[4][P];
      for (int u = 0; u < 4; ++u) {
        tsm::load_lanes<T, P>(seg + ulong(tsm::checked_index(col[k + u], n_cols, seen_col)) * ld, g[u]);
      }
      for (int u = 0; u < 4; ++u) {
        const float w = float(val[k + u]);
        for (int q = 0; q < P; ++q) {
          acc[q] += w * g[u][q];
        }
      }
    }
    for (; k < end; ++k) {
      float g[P];
      tsm::load_lanes<T, P>(seg + ulong(tsm::checked_index(col[k], n_cols, seen_col)) * ld, g);
      const float w = float(val[k]);
      for (int q = 0; q < P; ++q) {
        acc[q] += w * g[q];
      }
    }
  }
  tsm::store_block<T, P>(out, tile, acc, n_rows, n_batch, r0, n0, rows, simd, lane, tid);
  tsm::report(bad_ptr, &errors[0]);
  tsm::report(seen_col >= n_cols, &errors[1]);
}

// ------------------------------------------------ spmm_window: spmm with the gathered operand staged
// The product of spmm, with the same arguments, grid rows and error words (a tuned variant of it, backends/mps.py).
// A threadgroup owns a window of rows * J consecutive rows (J: the host's WINDOW_ROWS[P], TSM_WINDOW_ROWS_P<P>) and one chunk of
// 32 * P batch columns; SIMD-group `simd` owns rows r0 + j * rows + simd, j < J, and keeps their sums in registers.
// The gathered operand bt is staged panel by panel (F features of the chunk, tsm::kPanelBytes of threadgroup
// memory), so that a staged value serves every edge of the window in its column (rows * J * density of them on
// average) instead of each edge reading it from device memory.
//
// Each row walks its edges by cursor: lane l holds the column and value of edge base + l of the row (one coalesced
// load of 32 indices and 32 values), and edge base + pos is broadcast to the SIMD-group while its column is below
// the panel's end. Columns ascend within a row, so a row's edges of a panel follow each other; an edge whose
// column lies below the panel (a row not in ascending order) is read from device memory instead, so any order
// gives the right sum. The panel's memory then holds store_block's tile.
template <typename T, int P>
[[kernel]] void spmm_window(
    device T* out [[buffer(0)]],
    device const T* val [[buffer(1)]],
    device const T* bt [[buffer(2)]],
    device const int* ptr [[buffer(3)]],
    device const int* col [[buffer(4)]],
    device atomic_uint* errors [[buffer(5)]],
    constant long& batch [[buffer(6)]],
    constant long& nrows [[buffer(7)]],
    constant long& ncols [[buffer(8)]],
    constant long& nnz [[buffer(9)]],
    constant long& ldb [[buffer(10)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint simd [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint rows [[simdgroups_per_threadgroup]]) {
  constexpr uint J = P == 1 ? TSM_WINDOW_ROWS_P1 : TSM_WINDOW_ROWS_P4;
  constexpr uint S = tsm::kSimdWidth * P;
  constexpr uint V = S / 4;
  static_assert(tsm::kMaxRows * (tsm::kSimdWidth * P + 1) * sizeof(float) <= tsm::kPanelBytes,
                "store_block's tile must fit in the panel");
  // Declared as floats, the panel's memory is also store_block's tile (one element type: the float view of
  // threadgroup memory is what the tile's lanes write, value by value); read and written as vec4<T>, so declared
  // 16-byte aligned (alignas(16), not left to where the compiler places it).
  alignas(16) threadgroup float panel[tsm::kPanelBytes / sizeof(float)];
  threadgroup tsm::vec4<T>* staged = (threadgroup tsm::vec4<T>*)panel;
  const uint F = tsm::kPanelBytes / (S * sizeof(T));  // features per panel
  const uint n_rows = uint(nrows), n_cols = uint(ncols), n_batch = uint(batch), edges = uint(nnz);
  const uint r0 = group.x * rows * J, n0 = group.y * S;
  const ulong ld = ulong(ldb);
  device const T* seg = bt + n0 + lane * P;
  bool bad_ptr = false;
  uint seen_col = 0;
  float acc[J][P];
  int base[J], end[J];  // a row's next chunk of 32 edges, and its end
  uint c[J], pos[J];    // this lane's edge of the chunk: column (n_cols past the row's end) and value; the cursor
  float w[J];
  for (uint j = 0; j < J; ++j) {
    for (int q = 0; q < P; ++q) {
      acc[j][q] = 0.0f;
    }
    const uint r = r0 + j * rows + simd;
    const tsm::EdgeRange range = r < n_rows ? tsm::checked_range(ptr, r, n_rows, edges, bad_ptr) : tsm::EdgeRange{0, 0};
    base[j] = range.begin;
    end[j] = range.end;
    pos[j] = tsm::kSimdWidth;  // the first chunk is loaded at the first panel
  }
  for (uint f0 = 0; f0 < n_cols; f0 += F) {
    const uint f1 = min(f0 + F, n_cols);
    for (uint i = tid; i < (f1 - f0) * V; i += rows * tsm::kSimdWidth) {
      staged[i] = *((device const vec<T, 4>*)(bt + ulong(f0 + i / V) * ld + n0 + (i % V) * 4));
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint j = 0; j < J; ++j) {
      for (;;) {
        if (pos[j] == tsm::kSimdWidth) {  // the chunk is used up: the next 32 edges of the row
          const int k = base[j] + int(lane);
          const bool edge = k < end[j];
          c[j] = edge ? tsm::checked_index(col[k], n_cols, seen_col) : n_cols;
          w[j] = edge ? float(val[k]) : 0.0f;
          base[j] += int(tsm::kSimdWidth);
          pos[j] = 0;
        }
        const uint f = simd_broadcast(c[j], ushort(pos[j]));
        if (f >= f1) {
          break;  // the row's next edge lies in a later panel (or the row is done)
        }
        const float wk = simd_broadcast(w[j], ushort(pos[j]));
        float g[P];
        if (f >= f0) {
          tsm::load_staged<T, P>(staged, (f - f0) * S + lane * P, g);
        } else {
          tsm::load_lanes<T, P>(seg + ulong(f) * ld, g);
        }
        for (int q = 0; q < P; ++q) {
          acc[j][q] += wk * g[q];
        }
        ++pos[j];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the panel is restaged (or becomes the tile)
  }
  for (uint j = 0; j < J && r0 + j * rows < n_rows; ++j) {  // the same for every thread: barriers stay uniform
    tsm::store_block<T, P>(out, panel, acc[j], n_rows, n_batch, r0 + j * rows, n0, rows, simd, lane, tid);
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the tile's reads are done before the next rows' writes
  }
  tsm::report(bad_ptr, &errors[0]);
  tsm::report(seen_col >= n_cols, &errors[1]);
}

// ----------------------------------------------------- spmm_sddmm_atomic: backward, strategy fused_atomic
// grad_x[n, s] = sum_{e in row s} weight[e] * gt[dst[e], n]          (SpMM over grad_out, owned, written once)
// grad_w[e]   += sum_{n in chunk} x[n, s] * gt[dst[e], n]            (one atomic per edge and chunk)
//
// One dispatch; rows are sources (row_ptr, dst), gt is grad_out feature-major. Each gathered segment of gt
// serves both sums. A lane's part of an edge's weight gradient covers its P batch columns. Edges go in groups
// of 16 (four loads in flight at a time); one reduce-scatter of the 16 parts (tsm::reduce_scatter16) leaves
// lane u with the u-th edge's sum, and 16 lanes add theirs at once: 32 * P contributions per atomic, 16 atomics
// per instruction. grad_w must be zero-filled by the host.
template <typename T, int P>
[[kernel]] void spmm_sddmm_atomic(
    device T* grad_x [[buffer(0)]],
    device atomic<float>* grad_w [[buffer(1)]],
    device const T* weight [[buffer(2)]],
    device const T* gt [[buffer(3)]],
    device const T* x [[buffer(4)]],
    device const int* row_ptr [[buffer(5)]],
    device const int* dst [[buffer(6)]],
    device atomic_uint* errors [[buffer(7)]],
    constant long& batch [[buffer(8)]],
    constant long& in_features [[buffer(9)]],
    constant long& out_features [[buffer(10)]],
    constant long& nnz [[buffer(11)]],
    constant long& ldb [[buffer(12)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint simd [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint rows [[simdgroups_per_threadgroup]]) {
  threadgroup float tile[tsm::kMaxRows * (tsm::kSimdWidth * P + 1)];
  const uint n_in = uint(in_features), n_out = uint(out_features), n_batch = uint(batch);
  const uint s0 = group.x * rows, s = s0 + simd, n0 = group.y * (tsm::kSimdWidth * P);
  const ulong ld = ulong(ldb);
  device const T* seg = gt + n0 + lane * P;
  float xs[P], acc[P];
  tsm::load_block<T, P>(xs, tile, x, n_in, n_batch, s0, n0, rows, simd, lane, tid);
  for (int q = 0; q < P; ++q) {
    acc[q] = 0.0f;
  }
  bool bad_ptr = false;
  uint seen_col = 0;
  if (s < n_in) {
    const tsm::EdgeRange range = tsm::checked_range(row_ptr, s, n_in, uint(nnz), bad_ptr);
    const int end = range.end;
    for (int kb = range.begin; kb < end; kb += 16) {
      const int count = min(16, end - kb);
      float part[16];
      for (int u = 0; u < 16; ++u) {
        part[u] = 0.0f;
      }
      for (int u0 = 0; u0 < count; u0 += 4) {
        float g[4][P], w[4];
        for (int u = 0; u < 4; ++u) {  // four loads in flight; past the row's end: zeros
          const bool edge = u0 + u < count;
          w[u] = edge ? float(weight[kb + u0 + u]) : 0.0f;
          if (edge) {
            tsm::load_lanes<T, P>(seg + ulong(tsm::checked_index(dst[kb + u0 + u], n_out, seen_col)) * ld, g[u]);
          } else {
            for (int q = 0; q < P; ++q) {
              g[u][q] = 0.0f;
            }
          }
        }
        for (int u = 0; u < 4; ++u) {
          for (int q = 0; q < P; ++q) {
            acc[q] += w[u] * g[u][q];
            part[u0 + u] += xs[q] * g[u][q];
          }
        }
      }
      const float mine = tsm::reduce_scatter16(part, lane);
      if (lane < uint(count)) {
        tsm::atomic_add(&grad_w[kb + int(lane)], mine);
      }
    }
  }
  tsm::store_block<T, P>(grad_x, tile, acc, n_in, n_batch, s0, n0, rows, simd, lane, tid);
  tsm::report(bad_ptr, &errors[0]);
  tsm::report(seen_col >= n_out, &errors[1]);
}

// ---------------------------------------------------------- sddmm: backward, strategy atomic_free, pass 1
// grad_w[e] = sum_n xt[s, n] * gt[dst[e], n]   for e in row s   (both operands feature-major, zero-padded)
//
// A SIMD-group owns the edges of one source row and takes them four at a time; for each group of four it walks
// the whole batch, chunk by chunk, keeping each lane's partial sums in registers, and reduces once at the end
// (one float4 simd_sum) before lane u stores the u-th sum. The only writer of its edges: no atomics, no
// zero-fill, and a fixed summation order (deterministic). x is read feature-major too, so the row's own
// operand is one contiguous segment per chunk (cached across the edge groups): no threadgroup memory, no
// barriers, and no read-modify-write of grad_w between chunks.
template <typename T, int P>
[[kernel]] void sddmm(
    device T* grad_w [[buffer(0)]],
    device const T* gt [[buffer(1)]],
    device const T* xt [[buffer(2)]],
    device const int* row_ptr [[buffer(3)]],
    device const int* dst [[buffer(4)]],
    device atomic_uint* errors [[buffer(5)]],
    constant long& in_features [[buffer(6)]],
    constant long& out_features [[buffer(7)]],
    constant long& nnz [[buffer(8)]],
    constant long& ldb [[buffer(9)]],
    uint tid [[thread_position_in_grid]],
    uint lane [[thread_index_in_simdgroup]]) {
  const uint s = tid / tsm::kSimdWidth;  // the host dispatches one SIMD-group (32 threads) per row
  if (s >= uint(in_features)) {
    return;
  }
  const ulong ld = ulong(ldb);
  device const T* x_row = xt + ulong(s) * ld + lane * P;
  device const T* seg = gt + lane * P;
  const uint n_out = uint(out_features);
  bool bad_ptr = false;
  uint seen_col = 0;
  const tsm::EdgeRange range = tsm::checked_range(row_ptr, s, uint(in_features), uint(nnz), bad_ptr);
  const int end = range.end;
  for (int k = range.begin; k < end; k += 4) {
    const int in_flight = min(4, end - k);
    ulong offset[4];
    for (int u = 0; u < 4; ++u) {  // past the row's end: repeat its last edge
      offset[u] = ulong(tsm::checked_index(dst[k + min(u, in_flight - 1)], n_out, seen_col)) * ld;
    }
    float4 part = float4(0.0f);
    for (ulong n0 = 0; n0 < ld; n0 += tsm::kSimdWidth * P) {
      float xs[P];
      tsm::load_lanes<T, P>(x_row + n0, xs);
      for (int u = 0; u < 4; ++u) {
        float g[P];
        tsm::load_lanes<T, P>(seg + offset[u] + n0, g);
        for (int q = 0; q < P; ++q) {
          part[u] += xs[q] * g[q];
        }
      }
    }
    const float mine = tsm::lane_component(simd_sum(part), lane);
    if (lane < uint(in_flight)) {
      grad_w[k + int(lane)] = T(mine);
    }
  }
  tsm::report(bad_ptr, &errors[0]);
  tsm::report(seen_col >= n_out, &errors[1]);
}

// ----------------------------------------------------------------------------------------- instantiations
// `<stage>_<T>` and `<stage>_<T>_p<P>`, the stage being the template's name; the host builds the same names from
// its tables (backends/mps.py).
#define TSM_INSTANTIATE_PLAIN(stage, T) TSM_INSTANTIATE(#stage "_" #T, stage, T)
#define TSM_INSTANTIATE_TILED(stage, T, P) TSM_INSTANTIATE(#stage "_" #T "_p" #P, stage, T, P)

#define TSM_INSTANTIATE_STAGES(T, P)             \
  TSM_INSTANTIATE_TILED(spmm, T, P)              \
  TSM_INSTANTIATE_TILED(spmm_window, T, P)       \
  TSM_INSTANTIATE_TILED(spmm_sddmm_atomic, T, P) \
  TSM_INSTANTIATE_TILED(sddmm, T, P)

#define TSM_INSTANTIATE_CSR_LINEAR(T)             \
  TSM_INSTANTIATE_PLAIN(forward_operands, T)      \
  TSM_INSTANTIATE_PLAIN(fused_atomic_operands, T) \
  TSM_INSTANTIATE_PLAIN(atomic_free_operands, T)  \
  TSM_INSTANTIATE_STAGES(T, 1)                    \
  TSM_INSTANTIATE_STAGES(T, 4)

// Every Metal type of the contract's dtypes, each behind the Metal language it needs (defined by the host's loader,
// backends/metal.py: shader_defines).
TSM_FOR_EACH_METAL_TYPE(TSM_INSTANTIATE_CSR_LINEAR)
