// Metal kernels of torch_sparse_metal::csr_linear (forward) and csr_linear_backward (both strategies).
//
// The loader (torch_sparse_metal/backends/mps.py) prepends shaders/csr_linear_common.h; every kernel is a
// template over the value type T, instantiated at the end of this file as `<stage>_<T>` by one macro.
//
// Layout: activations x, y, grad_out, grad_x are [N, features] row-major (batch-major), as in the op
// contract. Seed 000 found that on Apple GPUs the memory access pattern, not the atomics, decides the speed
// of the backward pass, so every kernel below maps the fastest-varying thread coordinate (adjacent lanes of
// a SIMD-group) onto the fastest-varying memory coordinate of the buffer it streams: the feature index of
// one batch row. Each kernel says which layout it reads and why.
//
// Threads per kernel (the host's grid and group sizes, `threads=` / `group_size=`):
//   csr_linear_forward_T              2-D grid (out_features, N): one thread per output element y[n, o]
//   csr_linear_backward_fused_atomic_T 2-D grid (in_features, N): one thread per (source, batch element)
//   csr_linear_grad_w_T                1-D grid E: one thread per edge (atomic_free pass 1)
//   csr_linear_grad_x_T                2-D grid (in_features, N): one thread per grad_x[n, s] (atomic_free pass 2)
// Accumulation is in float for every T.

// ------------------------------------------------------------------------------------------------ forward
// y[n, o] = sum_{k in col_ptr[o] .. col_ptr[o+1]} weight[perm[k]] * x[n, src_by_dst[k]]
//
// Gather by destination: each thread owns one y[n, o] and writes it once, so no atomics and no zero-fill.
// Lanes of a SIMD-group take adjacent outputs o of the same batch row n (grid x = o): the store of y[n, o]
// is one contiguous 32-float segment per SIMD-group, and every gathered x[n, src] falls inside the one row
// x[n, :] (in_features floats, a few KB that stay in cache) that the whole SIMD-group shares. The threadgroup
// is (32, k): its k SIMD-groups take k batch rows of the same 32 outputs, so they walk identical index lists
// (col_ptr, perm, src_by_dst), which then come from cache after the first.
template <typename T>
kernel void csr_linear_forward(
    device T* y [[buffer(0)]],
    device const T* x [[buffer(1)]],
    device const T* weight [[buffer(2)]],
    device const int* col_ptr [[buffer(3)]],
    device const int* src_by_dst [[buffer(4)]],
    device const int* perm [[buffer(5)]],
    constant long& batch [[buffer(6)]],
    constant long& in_features [[buffer(7)]],
    constant long& out_features [[buffer(8)]],
    uint2 tid [[thread_position_in_grid]]) {
  const uint o = tid.x;
  const uint n = tid.y;
  const uint n_out = uint(out_features);
  if (o >= n_out || n >= uint(batch)) {
    return;
  }
  device const T* x_row = x + ulong(n) * ulong(in_features);
  const int end = col_ptr[o + 1];
  float acc = 0.0f;
  for (int k = col_ptr[o]; k < end; ++k) {
    acc += float(weight[perm[k]]) * float(x_row[src_by_dst[k]]);
  }
  y[ulong(n) * ulong(n_out) + o] = T(acc);
}

// ------------------------------------------------------------------------- backward, strategy fused_atomic
// grad_x[n, s] = sum_{e in row s} weight[e] * grad_out[n, dst[e]]     (owned by this thread, plain store)
// grad_w[e]   += grad_out[n, dst[e]] * x[n, s]   for every e in row s (shared across n, atomic add)
//
// One dispatch, one thread per (source s, batch element n). Lanes of a SIMD-group take adjacent sources of
// the same batch row (grid x = s): the read of x[n, s] and the store of grad_x[n, s] are contiguous across
// the SIMD-group, and every grad_out[n, dst[e]] read falls inside the one row grad_out[n, :] shared by the
// SIMD-group. grad_w must be zero-filled by the host before this kernel runs.
//
// Lanes of one SIMD-group hold different sources, hence different edges, so there is nothing to combine with
// simd_sum before the atomic: the threads that share an edge are the ones of other batch rows, in other
// SIMD-groups. (Putting the batch on the lanes would let simd_sum fold 32 contributions into one atomic but
// would turn every x / grad_x access into a stride-in_features scatter: the pattern seed 000 measured as the
// expensive one.) Contention per edge is at most N adds spread over the dispatch.
template <typename T>
kernel void csr_linear_backward_fused_atomic(
    device T* grad_x [[buffer(0)]],
    device atomic_float* grad_w [[buffer(1)]],
    device const T* grad_out [[buffer(2)]],
    device const T* x [[buffer(3)]],
    device const T* weight [[buffer(4)]],
    device const int* row_ptr [[buffer(5)]],
    device const int* dst [[buffer(6)]],
    constant long& batch [[buffer(7)]],
    constant long& in_features [[buffer(8)]],
    constant long& out_features [[buffer(9)]],
    uint2 tid [[thread_position_in_grid]]) {
  const uint s = tid.x;
  const uint n = tid.y;
  const uint n_in = uint(in_features);
  if (s >= n_in || n >= uint(batch)) {
    return;
  }
  const ulong xi = ulong(n) * ulong(n_in) + s;
  device const T* g_row = grad_out + ulong(n) * ulong(out_features);
  const float xs = float(x[xi]);
  const int end = row_ptr[s + 1];
  float gx = 0.0f;
  for (int e = row_ptr[s]; e < end; ++e) {
    const float g = float(g_row[dst[e]]);
    gx += float(weight[e]) * g;
    tsm::atomic_add(&grad_w[e], g * xs);
  }
  grad_x[xi] = T(gx);
}

// ------------------------------------------------------------------ backward, strategy atomic_free, pass 1
// grad_w[e] = sum_n grad_out[n, dst[e]] * x[n, src[e]]
//
// One thread per edge, looping over the batch; it owns grad_w[e] (plain store, no zero-fill needed, and
// N == 0 writes zeros). Lanes of a SIMD-group take adjacent edges: edges are sorted by (src, dst), so at a
// given n the lanes read grad_out[n, dst[e]] at ascending columns of one row and mostly the same x[n, src],
// and the store of grad_w is contiguous. The batch loop itself strides by a row per iteration: this is the
// batch-strided pattern of seed 000, inherent to the strategy, kept row-major so that at least the lanes of
// one iteration stay within one row.
template <typename T>
kernel void csr_linear_grad_w(
    device T* grad_w [[buffer(0)]],
    device const T* grad_out [[buffer(1)]],
    device const T* x [[buffer(2)]],
    device const int* dst [[buffer(3)]],
    device const int* src [[buffer(4)]],
    constant long& batch [[buffer(5)]],
    constant long& in_features [[buffer(6)]],
    constant long& out_features [[buffer(7)]],
    constant long& nnz [[buffer(8)]],
    uint e [[thread_position_in_grid]]) {
  if (e >= uint(nnz)) {
    return;
  }
  const uint n_batch = uint(batch);
  const ulong n_in = ulong(in_features);
  const ulong n_out = ulong(out_features);
  device const T* g_col = grad_out + dst[e];
  device const T* x_col = x + src[e];
  float acc = 0.0f;
  for (uint n = 0; n < n_batch; ++n) {
    acc += float(g_col[ulong(n) * n_out]) * float(x_col[ulong(n) * n_in]);
  }
  grad_w[e] = T(acc);
}

// ------------------------------------------------------------------ backward, strategy atomic_free, pass 2
// grad_x[n, s] = sum_{e in row s} weight[e] * grad_out[n, dst[e]]
//
// Exclusive ownership of grad_x[n, s], one thread each; same mapping as the fused kernel (lanes take
// adjacent sources of one batch row, so the grad_x store is contiguous and grad_out reads stay in one row).
template <typename T>
kernel void csr_linear_grad_x(
    device T* grad_x [[buffer(0)]],
    device const T* grad_out [[buffer(1)]],
    device const T* weight [[buffer(2)]],
    device const int* row_ptr [[buffer(3)]],
    device const int* dst [[buffer(4)]],
    constant long& batch [[buffer(5)]],
    constant long& in_features [[buffer(6)]],
    constant long& out_features [[buffer(7)]],
    uint2 tid [[thread_position_in_grid]]) {
  const uint s = tid.x;
  const uint n = tid.y;
  const uint n_in = uint(in_features);
  if (s >= n_in || n >= uint(batch)) {
    return;
  }
  device const T* g_row = grad_out + ulong(n) * ulong(out_features);
  const int end = row_ptr[s + 1];
  float gx = 0.0f;
  for (int e = row_ptr[s]; e < end; ++e) {
    gx += float(weight[e]) * float(g_row[dst[e]]);
  }
  grad_x[ulong(n) * ulong(n_in) + s] = T(gx);
}

// ---------------------------------------------------------------------------------------- instantiations
// One macro per value type; the host builds the names as f"{stage}_{dtype}" (backends/mps.py).
#define TSM_INSTANTIATE_CSR_LINEAR(T)                                                                         \
  template [[host_name("csr_linear_forward_" #T)]] kernel void csr_linear_forward<T>(                         \
      device T * y [[buffer(0)]], device const T* x [[buffer(1)]], device const T* weight [[buffer(2)]],      \
      device const int* col_ptr [[buffer(3)]], device const int* src_by_dst [[buffer(4)]],                    \
      device const int* perm [[buffer(5)]], constant long& batch [[buffer(6)]],                               \
      constant long& in_features [[buffer(7)]], constant long& out_features [[buffer(8)]],                    \
      uint2 tid [[thread_position_in_grid]]);                                                                 \
  template [[host_name("csr_linear_backward_fused_atomic_" #T)]] kernel void                                  \
  csr_linear_backward_fused_atomic<T>(                                                                        \
      device T * grad_x [[buffer(0)]], device atomic_float * grad_w [[buffer(1)]],                            \
      device const T* grad_out [[buffer(2)]], device const T* x [[buffer(3)]],                                \
      device const T* weight [[buffer(4)]], device const int* row_ptr [[buffer(5)]],                          \
      device const int* dst [[buffer(6)]], constant long& batch [[buffer(7)]],                                \
      constant long& in_features [[buffer(8)]], constant long& out_features [[buffer(9)]],                    \
      uint2 tid [[thread_position_in_grid]]);                                                                 \
  template [[host_name("csr_linear_grad_w_" #T)]] kernel void csr_linear_grad_w<T>(                           \
      device T * grad_w [[buffer(0)]], device const T* grad_out [[buffer(1)]], device const T* x [[buffer(2)]], \
      device const int* dst [[buffer(3)]], device const int* src [[buffer(4)]],                               \
      constant long& batch [[buffer(5)]], constant long& in_features [[buffer(6)]],                           \
      constant long& out_features [[buffer(7)]], constant long& nnz [[buffer(8)]],                            \
      uint e [[thread_position_in_grid]]);                                                                    \
  template [[host_name("csr_linear_grad_x_" #T)]] kernel void csr_linear_grad_x<T>(                           \
      device T * grad_x [[buffer(0)]], device const T* grad_out [[buffer(1)]],                                \
      device const T* weight [[buffer(2)]], device const int* row_ptr [[buffer(3)]],                          \
      device const int* dst [[buffer(4)]], constant long& batch [[buffer(5)]],                                \
      constant long& in_features [[buffer(6)]], constant long& out_features [[buffer(7)]],                    \
      uint2 tid [[thread_position_in_grid]]);

TSM_INSTANTIATE_CSR_LINEAR(float)
