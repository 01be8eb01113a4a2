// Metal kernels of torch_sparse_metal::vector_csr_linear (forward) and vector_csr_linear_backward (both strategies).
//
// The loader (torch_sparse_metal/backends/mps_vector_csr_linear.py) prepends shaders/csr_linear_common.h; every
// kernel is a template over the value type T and the vector length V (8, 16, 32: contract.VECTOR_BLOCKS),
// instantiated at the end of this file as `<stage>_v<V>_<T>` by one macro.
//
// The op. A connection is a vector j of V consecutive outputs of one group g = dst[j] that share one input
// s = src[j]: y[n, g*V + l] = sum_j weight[j, l] * x[n, src[j]]. Per group, that is a dense product: with the group's
// vectors at by-group positions k = col_ptr[g] .. col_ptr[g+1] (ids perm[k], sources src_by_dst[k]),
//   Y_g [batch x V] = X[:, S_g] [batch x k_g] . W_g [k_g x V]          (forward)
//   G_g [k_g x V]   = X[:, S_g]^T [k_g x batch] . gY_g [batch x V]      (grad_w, gY_g = grad_out[:, g*V .. g*V+V))
// so both run on SIMD-group matrices (simdgroup_matrix<T, 8, 8>, summed in simdgroup_float8x8 accumulators), the
// gathered operand X[:, S_g] staged in threadgroup memory eight vectors (or eight batch rows) at a time from a
// feature-major copy of x (xt = x^T [in_features, batch], which the host makes), zero-padded where the group's
// vectors or the batch end. grad_x has one column per source and no shared operand (M = 1): a SIMD walk over the
// source's vectors, each reading V consecutive values of grad_out per batch row.
//
// Operand matrices are of the value type T (half and bfloat 8x8 matrices multiplied into float accumulators, as
// Metal compiles mixed-precision simdgroup_multiply_accumulate); every sum is in float and rounded once to T when
// stored (the contract's accumulate type). The shaders use simdgroup_load / store / multiply_accumulate only, never
// thread_elements(): the distribution of a matrix over the lanes is Metal's business.
//
// Kernels, with the host's grid (`threads=`) and threadgroup (`group_size=`); R SIMD-groups per threadgroup:
//   vector_spmm_vV_T               (32R * groups, ceil(batch / 8R)), (32R, 1)   forward: group g, 8R batch rows
//   vector_sddmm_vV_T              32R * groups, 32R                            atomic_free pass 1: grad_w, group g
//   vector_spmm_t_vV_T             (ceil(in/R) * 32R, ceil(batch / 32)), (32R, 1)  atomic_free pass 2: grad_x
//   vector_spmm_sddmm_atomic_vV_T  (ceil(in/R) * 32R, ceil(batch / 32)), (32R, 1)  fused_atomic: grad_x, grad_w
// fused_atomic sums grad_w with float atomics (one per vector lane and 32 batch rows, into a zeroed float32
// buffer) and owns grad_x; atomic_free owns both: grad_w per group (each vector's row written once, by the
// SIMD-group holding its by-group position), grad_x per source.
//
// Every index a kernel reads goes through tsm::checked_index / checked_range (csr_linear_common.h); `errors` are the
// error words from the kernel's pointer array on (contract INDEX_ARRAYS order): the by-group kernels get
// (col_ptr, src_by_dst, perm), the by-source kernels (row_ptr, dst). A vector id perm[k] out of range is never
// written (clamping it would give its row a second writer).
#include <metal_simdgroup_matrix>

namespace tsm_vector {

// Vectors (or batch rows) staged per step: one 8 x 8 matrix's depth.
constant constexpr uint kStage = 8;
// Batch rows of grad_out (and of x^T) a by-group grad_w step stages: four matrix depths per pair of barriers.
constant constexpr uint kBatchStage = 32;

// Segment reduce-scatter over the V lanes of a segment (V a power of two, lane = segment * V + e): v[0 .. V) are
// a lane's shares of V values; afterwards v[0] of lane e holds the segment's total of value e (tsm::scatter_step,
// log2(V) rounds, V - 1 shuffles).
template <int W>
struct SegmentScatter {
  static inline void run(thread float* v, uint lane) {
    tsm::scatter_step<W>(v, lane);
    SegmentScatter<W / 2>::run(v, lane);
  }
};
template <>
struct SegmentScatter<0> {
  static inline void run(thread float*, uint) {}
};

}  // namespace tsm_vector

// ------------------------------------------------------------------ vector_spmm: the forward, by group
// y[n, g*V + l] = sum_{k in col_ptr[g] .. col_ptr[g+1]} weight[perm[k], l] * x[n, src_by_dst[k]]   (written once)
//
// A threadgroup owns group g = group.x and 8R batch rows n0 .. n0 + 8R; SIMD-group `simd` owns rows
// n0 + 8 simd .. + 8 of them and all V outputs, as V / 8 accumulator matrices Y[8 rows x 8 outputs]. Per step of
// eight vectors, the threadgroup stages their weight rows (ws: 8 x V) and their rows of x^T over the threadgroup's
// batch rows (xs: 8 x 8R), both zero past the group's vectors and the batch; each SIMD-group then loads its
// X[8 rows x 8 vectors] (transposed from xs) once and multiplies it into every accumulator. The result goes through
// threadgroup memory (ys), so that y is written along its rows and only inside the batch.
template <typename T, int V>
[[kernel]] void vector_spmm(
    device T* y [[buffer(0)]],
    device const T* weight [[buffer(1)]],
    device const T* xt [[buffer(2)]],
    device const int* col_ptr [[buffer(3)]],
    device const int* src_by_dst [[buffer(4)]],
    device const int* perm [[buffer(5)]],
    device atomic_uint* errors [[buffer(6)]],
    constant long& batch [[buffer(7)]],
    constant long& in_features [[buffer(8)]],
    constant long& groups [[buffer(9)]],
    constant long& vectors [[buffer(10)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint simd [[simdgroup_index_in_threadgroup]],
    uint rows [[simdgroups_per_threadgroup]]) {
  constexpr uint S = tsm_vector::kStage;
  constexpr uint C = V / 8;
  // (threadgroup sizes name namespace constants and template parameters only: the executor sizes them outside)
  threadgroup T ws[tsm_vector::kStage * V];
  threadgroup T xs[tsm_vector::kStage * 8 * tsm::kMaxRows];
  threadgroup float ys[8 * tsm::kMaxRows * V];
  const uint n_batch = uint(batch), n_in = uint(in_features), n_groups = uint(groups), nv = uint(vectors);
  const uint g = group.x, bt = 8 * rows, n0 = group.y * bt, threads = rows * tsm::kSimdWidth;
  bool bad_ptr = false;
  uint seen_src = 0, seen_perm = 0;
  const tsm::EdgeRange range = tsm::checked_range(col_ptr, g, n_groups, nv, bad_ptr);
  simdgroup_float8x8 acc[C];
  for (int c = 0; c < int(C); ++c) {
    acc[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  for (int k0 = range.begin; k0 < range.end; k0 += int(S)) {
    const uint count = uint(min(int(S), range.end - k0));
    for (uint i = tid; i < S * V; i += threads) {
      const uint kk = i / V;
      T w = T(0);
      if (kk < count) {
        w = weight[ulong(tsm::checked_index(perm[k0 + int(kk)], nv, seen_perm)) * V + i % V];
      }
      ws[i] = w;
    }
    for (uint i = tid; i < S * bt; i += threads) {
      const uint kk = i / bt, n = n0 + i % bt;
      T v = T(0);
      if (kk < count && n < n_batch) {
        v = xt[ulong(tsm::checked_index(src_by_dst[k0 + int(kk)], n_in, seen_src)) * n_batch + n];
      }
      xs[i] = v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    simdgroup_matrix<T, 8, 8> a;  // a(r, kk) = x[n0 + 8 simd + r, src of vector kk] = xs[kk * bt + 8 simd + r]
    simdgroup_load(a, xs + 8 * simd, bt, ulong2(0), true);
    for (int c = 0; c < int(C); ++c) {
      simdgroup_matrix<T, 8, 8> b;  // b(kk, l) = weight[vector kk, 8c + l]
      simdgroup_load(b, ws + 8 * c, V);
      simdgroup_multiply_accumulate(acc[c], a, b, acc[c]);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next step restages ws and xs
  }
  for (int c = 0; c < int(C); ++c) {
    simdgroup_store(acc[c], ys + 8 * simd * V + 8 * c, V);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const ulong n_out = ulong(n_groups) * V;
  for (uint i = tid; i < bt * V; i += threads) {
    const uint n = n0 + i / V;
    if (n < n_batch) {
      y[ulong(n) * n_out + ulong(g) * V + i % V] = T(ys[i]);
    }
  }
  tsm::report(bad_ptr, &errors[0]);
  tsm::report(seen_src >= n_in, &errors[1]);
  tsm::report(seen_perm >= nv, &errors[2]);
}

// ---------------------------------------------------------- vector_sddmm: backward, atomic_free pass 1
// grad_w[perm[k], l] = sum_n x[n, src_by_dst[k]] * grad_out[n, g*V + l]   for k of group g   (written once)
//
// A threadgroup owns group g = group.x; its R SIMD-groups take the group's tiles of eight vectors, tile t0 + simd in
// round t0 (rounds are the same for every SIMD-group, so the barriers are uniform; a SIMD-group without a tile in
// the last round only stages zeros). Per round the batch is walked in steps of kBatchStage rows: the threadgroup
// stages grad_out's block gs [32 rows x V] (shared by every tile of the group), each SIMD-group its tile's rows of
// x^T xs [8 vectors x 32 rows], and each SIMD-group accumulates G[8 vectors x 8 outputs] += X^T[8 x 8] . gY[8 x 8]
// over the block's four depths. The whole batch is summed in the accumulators (a fixed order: deterministic), then
// stored through threadgroup memory, each vector's V values to its row perm[k] of grad_w.
template <typename T, int V>
[[kernel]] void vector_sddmm(
    device T* grad_w [[buffer(0)]],
    device const T* grad_out [[buffer(1)]],
    device const T* xt [[buffer(2)]],
    device const int* col_ptr [[buffer(3)]],
    device const int* src_by_dst [[buffer(4)]],
    device const int* perm [[buffer(5)]],
    device atomic_uint* errors [[buffer(6)]],
    constant long& batch [[buffer(7)]],
    constant long& in_features [[buffer(8)]],
    constant long& groups [[buffer(9)]],
    constant long& vectors [[buffer(10)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint simd [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint rows [[simdgroups_per_threadgroup]]) {
  constexpr uint S = tsm_vector::kStage;
  constexpr uint B = tsm_vector::kBatchStage;
  constexpr uint C = V / 8;
  threadgroup T gs[tsm_vector::kBatchStage * V];
  threadgroup T xs[tsm::kMaxRows * tsm_vector::kStage * tsm_vector::kBatchStage];
  threadgroup float out[tsm::kMaxRows * tsm_vector::kStage * V];
  const uint n_batch = uint(batch), n_in = uint(in_features), n_groups = uint(groups), nv = uint(vectors);
  const uint g = group.x, threads = rows * tsm::kSimdWidth;
  const ulong n_out = ulong(n_groups) * V;
  threadgroup T* my_xs = xs + simd * S * B;
  threadgroup float* my_out = out + simd * S * V;
  bool bad_ptr = false;
  uint seen_src = 0, seen_perm = 0;
  const tsm::EdgeRange range = tsm::checked_range(col_ptr, g, n_groups, nv, bad_ptr);
  const int tiles = (range.end - range.begin + int(S) - 1) / int(S);
  for (int t0 = 0; t0 < tiles; t0 += int(rows)) {
    const int k0 = range.begin + (t0 + int(simd)) * int(S);
    const uint count = uint(clamp(range.end - k0, 0, int(S)));  // this SIMD-group's vectors this round
    simdgroup_float8x8 acc[C];
    for (int c = 0; c < int(C); ++c) {
      acc[c] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
    for (uint b0 = 0; b0 < n_batch; b0 += B) {
      for (uint i = tid; i < B * V; i += threads) {
        const uint n = b0 + i / V;
        gs[i] = n < n_batch ? grad_out[ulong(n) * n_out + ulong(g) * V + i % V] : T(0);
      }
      for (uint i = lane; i < S * B; i += tsm::kSimdWidth) {
        const uint kk = i / B, n = b0 + i % B;
        T v = T(0);
        if (kk < count && n < n_batch) {
          v = xt[ulong(tsm::checked_index(src_by_dst[k0 + int(kk)], n_in, seen_src)) * n_batch + n];
        }
        my_xs[i] = v;
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);
      if (count > 0) {  // the same in every lane of the SIMD-group
        for (uint q = 0; q < B / 8; ++q) {
          simdgroup_matrix<T, 8, 8> a;  // a(kk, m) = x[b0 + 8q + m, src of vector kk]
          simdgroup_load(a, my_xs + 8 * q, B);
          for (int c = 0; c < int(C); ++c) {
            simdgroup_matrix<T, 8, 8> b;  // b(m, l) = grad_out[b0 + 8q + m, g*V + 8c + l]
            simdgroup_load(b, gs + 8 * q * V + 8 * c, V);
            simdgroup_multiply_accumulate(acc[c], a, b, acc[c]);
          }
        }
      }
      threadgroup_barrier(mem_flags::mem_threadgroup);  // the next step restages gs and xs
    }
    for (int c = 0; c < int(C); ++c) {
      simdgroup_store(acc[c], my_out + 8 * c, V);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint i = lane; i < count * V; i += tsm::kSimdWidth) {
      const int j = perm[k0 + int(i / V)];
      seen_perm = max(seen_perm, uint(j));
      if (uint(j) < nv) {
        grad_w[ulong(j) * V + i % V] = T(my_out[i]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);  // the next round stores into `out` again
  }
  tsm::report(bad_ptr, &errors[0]);
  tsm::report(seen_src >= n_in, &errors[1]);
  tsm::report(seen_perm >= nv, &errors[2]);
}

// ------------------------------------------------------- vector_spmm_t: backward, atomic_free pass 2
// grad_x[n, s] = sum_{j in row_ptr[s] .. row_ptr[s+1]} sum_l weight[j, l] * grad_out[n, dst[j]*V + l]   (written once)
//
// A SIMD-group owns source s = s0 + simd and 32 batch rows n0 .. n0 + 32. Its lanes form 32 / V segments of V lanes
// (lane = sub * V + e): per vector, lane e of segment sub reads output e of the vector's group in rows
// n0 + t * (32 / V) + sub, t < V (one contiguous run of V values per row: a coalesced read of 32 / V rows per step),
// and keeps V partial sums in registers. A segment reduce-scatter then leaves the total of row n0 + e * (32 / V) + sub
// in lane sub * V + e, one shuffle puts row n0 + l in lane l, and tsm::store_block writes the threadgroup's R sources
// along the rows of grad_x. Every thread reaches the reductions and the store (SIMD-group functions, barriers).
template <typename T, int V>
[[kernel]] void vector_spmm_t(
    device T* grad_x [[buffer(0)]],
    device const T* weight [[buffer(1)]],
    device const T* grad_out [[buffer(2)]],
    device const int* row_ptr [[buffer(3)]],
    device const int* dst [[buffer(4)]],
    device atomic_uint* errors [[buffer(5)]],
    constant long& batch [[buffer(6)]],
    constant long& in_features [[buffer(7)]],
    constant long& groups [[buffer(8)]],
    constant long& vectors [[buffer(9)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint simd [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint rows [[simdgroups_per_threadgroup]]) {
  constexpr uint G = tsm::kSimdWidth / V;
  threadgroup float tile[tsm::kMaxRows * (tsm::kSimdWidth + 1)];
  const uint n_batch = uint(batch), n_in = uint(in_features), n_groups = uint(groups), nv = uint(vectors);
  const uint s0 = group.x * rows, s = s0 + simd, n0 = group.y * tsm::kSimdWidth;
  const uint sub = lane / V, e = lane % V;
  const ulong n_out = ulong(n_groups) * V;
  bool bad_ptr = false;
  uint seen_dst = 0;
  float acc[V];
  for (int t = 0; t < V; ++t) {
    acc[t] = 0.0f;
  }
  if (s < n_in) {
    const tsm::EdgeRange range = tsm::checked_range(row_ptr, s, n_in, nv, bad_ptr);
    for (int j = range.begin; j < range.end; ++j) {
      const float w = float(weight[ulong(j) * V + e]);
      device const T* column = grad_out + ulong(tsm::checked_index(dst[j], n_groups, seen_dst)) * V + e;
      for (int t = 0; t < V; ++t) {
        const uint n = n0 + uint(t) * G + sub;
        if (n < n_batch) {
          acc[t] += w * float(column[ulong(n) * n_out]);
        }
      }
    }
  }
  tsm_vector::SegmentScatter<V / 2>::run(acc, lane);
  float mine = simd_shuffle(acc[0], ushort((lane % G) * V + lane / G));
  tsm::store_block<T, 1>(grad_x, tile, &mine, n_in, n_batch, s0, n0, rows, simd, lane, tid);
  tsm::report(bad_ptr, &errors[0]);
  tsm::report(seen_dst >= n_groups, &errors[1]);
}

// -------------------------------------------------- vector_spmm_sddmm_atomic: backward, strategy fused_atomic
// grad_x[n, s]  = sum_{j in row s} sum_l weight[j, l] * grad_out[n, dst[j]*V + l]        (owned, written once)
// grad_w[j, l] += sum_{n in the 32 rows} x[n, s] * grad_out[n, dst[j]*V + l]              (one float atomic each)
//
// vector_spmm_t's walk, in one dispatch with the weight gradient: each grad_out value a lane reads serves both
// sums. The rows' x[n, s] come in through tsm::load_block (lane l: row n0 + l) and are shuffled once to the lanes
// that use them; per vector, a lane's weight-gradient part covers its V rows, the 32 / V segments' parts are summed
// with log2(32 / V) shuffles, and segment 0's V lanes add the vector's V values atomically (one instruction of V
// lanes per vector and 32 batch rows). grad_w must be zero-filled (float32) by the host.
template <typename T, int V>
[[kernel]] void vector_spmm_sddmm_atomic(
    device T* grad_x [[buffer(0)]],
    device atomic<float>* grad_w [[buffer(1)]],
    device const T* weight [[buffer(2)]],
    device const T* grad_out [[buffer(3)]],
    device const T* x [[buffer(4)]],
    device const int* row_ptr [[buffer(5)]],
    device const int* dst [[buffer(6)]],
    device atomic_uint* errors [[buffer(7)]],
    constant long& batch [[buffer(8)]],
    constant long& in_features [[buffer(9)]],
    constant long& groups [[buffer(10)]],
    constant long& vectors [[buffer(11)]],
    uint2 group [[threadgroup_position_in_grid]],
    uint tid [[thread_index_in_threadgroup]],
    uint simd [[simdgroup_index_in_threadgroup]],
    uint lane [[thread_index_in_simdgroup]],
    uint rows [[simdgroups_per_threadgroup]]) {
  constexpr uint G = tsm::kSimdWidth / V;
  threadgroup float tile[tsm::kMaxRows * (tsm::kSimdWidth + 1)];
  const uint n_batch = uint(batch), n_in = uint(in_features), n_groups = uint(groups), nv = uint(vectors);
  const uint s0 = group.x * rows, s = s0 + simd, n0 = group.y * tsm::kSimdWidth;
  const uint sub = lane / V, e = lane % V;
  const ulong n_out = ulong(n_groups) * V;
  float xl;
  tsm::load_block<T, 1>(&xl, tile, x, n_in, n_batch, s0, n0, rows, simd, lane, tid);
  float xs[V];  // x[n0 + t * G + sub, s]: zero outside the batch
  for (int t = 0; t < V; ++t) {
    xs[t] = simd_shuffle(xl, ushort(uint(t) * G + sub));
  }
  bool bad_ptr = false;
  uint seen_dst = 0;
  float acc[V];
  for (int t = 0; t < V; ++t) {
    acc[t] = 0.0f;
  }
  if (s < n_in) {
    const tsm::EdgeRange range = tsm::checked_range(row_ptr, s, n_in, nv, bad_ptr);
    for (int j = range.begin; j < range.end; ++j) {
      const float w = float(weight[ulong(j) * V + e]);
      device const T* column = grad_out + ulong(tsm::checked_index(dst[j], n_groups, seen_dst)) * V + e;
      float part = 0.0f;
      for (int t = 0; t < V; ++t) {
        const uint n = n0 + uint(t) * G + sub;
        const float go = n < n_batch ? float(column[ulong(n) * n_out]) : 0.0f;
        acc[t] += w * go;
        part += xs[t] * go;
      }
      for (uint m = V; m < tsm::kSimdWidth; m *= 2) {  // the segments' parts of output e
        part += simd_shuffle_xor(part, ushort(m));
      }
      if (sub == 0) {
        tsm::atomic_add(&grad_w[ulong(j) * V + e], part);
      }
    }
  }
  tsm_vector::SegmentScatter<V / 2>::run(acc, lane);
  float mine = simd_shuffle(acc[0], ushort((lane % G) * V + lane / G));
  tsm::store_block<T, 1>(grad_x, tile, &mine, n_in, n_batch, s0, n0, rows, simd, lane, tid);
  tsm::report(bad_ptr, &errors[0]);
  tsm::report(seen_dst >= n_groups, &errors[1]);
}

// ----------------------------------------------------------------------------------------- instantiations
// `<stage>_v<V>_<T>`, the stage being the template's name; the host builds the same names from its tables
// (backends/mps_vector_csr_linear.py: STAGES x contract.VECTOR_BLOCKS x the Metal dtypes).
#define TSM_INSTANTIATE_VECTOR(stage, T, V) TSM_INSTANTIATE(#stage "_v" #V "_" #T, stage, T, V)
#define TSM_INSTANTIATE_VECTOR_STAGES(T, V)           \
  TSM_INSTANTIATE_VECTOR(vector_spmm, T, V)           \
  TSM_INSTANTIATE_VECTOR(vector_sddmm, T, V)          \
  TSM_INSTANTIATE_VECTOR(vector_spmm_t, T, V)         \
  TSM_INSTANTIATE_VECTOR(vector_spmm_sddmm_atomic, T, V)
#define TSM_INSTANTIATE_VECTOR_CSR_LINEAR(T) \
  TSM_INSTANTIATE_VECTOR_STAGES(T, 8)        \
  TSM_INSTANTIATE_VECTOR_STAGES(T, 16)       \
  TSM_INSTANTIATE_VECTOR_STAGES(T, 32)

// Every Metal type of the contract's dtypes, each behind the Metal language it needs (backends/metal.py).
TSM_FOR_EACH_METAL_TYPE(TSM_INSTANTIATE_VECTOR_CSR_LINEAR)
