// CPU kernels for the csr_linear ops.
//
// Layout: activations are repacked once per call from [batch, features] into batch tiles of kTile
// columns, feature-major inside a tile (see Tiled; the packing is inside every timing we report). Every
// edge then touches two contiguous kTile-wide vectors, which vectorise, and one tile's slab stays in L2
// while all edges of a block are processed, where whole batch rows would spill to L3.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../csr_linear_checks.h"

namespace torch_sparse_metal {
namespace {

// 128 bytes of a batch row per tile: 32 floats or 16 doubles, a few vector registers of accumulators.
template <typename T>
constexpr int kTile = 128 / sizeof(T);

// Relaxed atomic floating-point add by compare-and-swap on the bit pattern (C++17 has no atomic float add).
template <typename T>
inline void atomic_add(T* address, T value) {
  using Bits = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  static_assert(sizeof(T) == sizeof(Bits), "atomic_add supports float and double");
  auto* bits = reinterpret_cast<Bits*>(address);
  Bits expected = __atomic_load_n(bits, __ATOMIC_RELAXED);
  Bits desired;
  do {
    T current;
    std::memcpy(&current, &expected, sizeof(T));
    current += value;
    std::memcpy(&desired, &current, sizeof(T));
  } while (!__atomic_compare_exchange_n(bits, &expected, desired, /*weak=*/true, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED));
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Batch-tiled, feature-major activations: tile t of feature f is kTile contiguous values at
// data + (t * features + f) * kTile. Each tile's slab is contiguous, so its rows do not alias in cache the
// way rows of a plain [features, batch] transpose with a power-of-two batch do; the tail tile is
// zero-padded, so every kernel loop has a compile-time width.
template <typename T>
struct Tiled {
  T* data;
  int64_t features;
  T* row(int64_t t, int64_t f) const { return data + (t * features + f) * kTile<T>; }
};

template <typename T>
at::Tensor tiled_empty(int64_t tiles, int64_t features, const at::Tensor& like) {
  return empty_output({tiles, features, kTile<T>}, like.options());
}

// Packing moves kFeatureBlock features of kTile batch rows at a time: whole cache lines in and out, where
// a feature-at-a-time loop would stride through kTile rows and evict its own lines.
constexpr int64_t kFeatureBlock = 16;

// [batch, features] row-major -> Tiled (zero-padded tail).
template <typename T>
Tiled<T> pack(const at::Tensor& m, at::Tensor& storage) {
  const at::Tensor src = m.contiguous();
  const int64_t batch = src.size(0), features = src.size(1), tiles = storage.size(0);
  const T* in = src.data_ptr<T>();
  Tiled<T> out{storage.data_ptr<T>(), features};
  const int64_t fblocks = ceil_div(features, kFeatureBlock);
  at::parallel_for(0, tiles * fblocks, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t t = task / fblocks, f0 = (task % fblocks) * kFeatureBlock;
      const int64_t f1 = std::min(features, f0 + kFeatureBlock);
      const int lanes = int(std::min<int64_t>(kTile<T>, batch - t * kTile<T>));
      for (int i = 0; i < lanes; ++i) {
        const T* r = in + (t * kTile<T> + i) * features;
        for (int64_t f = f0; f < f1; ++f) out.row(t, f)[i] = r[f];
      }
      for (int64_t f = f0; f < f1; ++f) std::fill(out.row(t, f) + lanes, out.row(t, f) + kTile<T>, T(0));
    }
  });
  return out;
}

// Tiled -> [batch, features] row-major.
template <typename T>
at::Tensor unpack(const Tiled<T>& m, int64_t batch, const at::Tensor& like) {
  at::Tensor out = empty_output({batch, m.features}, like.options());
  T* o = out.data_ptr<T>();
  const int64_t fblocks = ceil_div(m.features, kFeatureBlock);
  at::parallel_for(0, ceil_div(batch, kTile<T>) * fblocks, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t t = task / fblocks, f0 = (task % fblocks) * kFeatureBlock;
      const int64_t f1 = std::min(m.features, f0 + kFeatureBlock);
      const int lanes = int(std::min<int64_t>(kTile<T>, batch - t * kTile<T>));
      for (int i = 0; i < lanes; ++i) {
        T* r = o + (t * kTile<T> + i) * m.features;
        for (int64_t f = f0; f < f1; ++f) r[f] = m.row(t, f)[i];
      }
    }
  });
  return out;
}

// out = sum_k coef(k) * row(k) over a CSR segment, accumulated in registers: the gather of one output
// (forward) or of one source's input gradient (backward).
template <typename T, typename Coef, typename Row>
inline void gather_rows(T* __restrict out, int64_t begin, int64_t end, Coef coef, Row row) {
  T acc[kTile<T>] = {};
  for (int64_t k = begin; k < end; ++k) {
    const T c = coef(k);
    const T* __restrict r = row(k);
#pragma omp simd
    for (int i = 0; i < kTile<T>; ++i) acc[i] += c * r[i];
  }
  for (int i = 0; i < kTile<T>; ++i) out[i] = acc[i];
}

template <typename T>
inline T dot(const T* __restrict a, const T* __restrict b) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int i = 0; i < kTile<T>; ++i) acc += a[i] * b[i];
  return acc;
}

// Blocks of rows so that there are about 4 tasks per thread per batch chunk.
inline int64_t rows_per_block(int64_t rows, int64_t chunks) {
  const int64_t blocks = std::max<int64_t>(1, ceil_div(4 * at::get_num_threads(), chunks));
  return std::max<int64_t>(1, ceil_div(rows, blocks));
}

at::Tensor csr_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& row_ptr,
                          const at::Tensor& dst, const at::Tensor& src, const at::Tensor& col_ptr,
                          const at::Tensor& src_by_dst, const at::Tensor& perm, c10::string_view /*backward*/) {
  check_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  const int64_t batch = x.size(0), out_features = col_ptr.numel() - 1;
  const int32_t* cp = col_ptr.data_ptr<int32_t>();
  const int32_t* sb = src_by_dst.data_ptr<int32_t>();
  const int32_t* pm = perm.data_ptr<int32_t>();
  at::Tensor y;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "csr_linear_cpu", [&] {
    using T = scalar_t;
    const int64_t tiles = ceil_div(batch, kTile<T>);
    at::Tensor xs_storage = tiled_empty<T>(tiles, x.size(1), x), ys_storage = tiled_empty<T>(tiles, out_features, x);
    const Tiled<T> xs = pack<T>(x, xs_storage), ys{ys_storage.data_ptr<T>(), out_features};
    const T* w = weight.data_ptr<T>();
    const int64_t block = rows_per_block(out_features, std::max<int64_t>(tiles, 1));
    const int64_t blocks = ceil_div(out_features, block);
    // Gather by destination: a task owns (output block, batch tile), so no two tasks write one element.
    at::parallel_for(0, tiles * blocks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t task = lo; task < hi; ++task) {
        const int64_t t = task / blocks, o0 = (task % blocks) * block, o1 = std::min(out_features, o0 + block);
        for (int64_t o = o0; o < o1; ++o) {
          gather_rows(ys.row(t, o), cp[o], cp[o + 1], [&](int64_t k) { return w[pm[k]]; },
                      [&](int64_t k) { return xs.row(t, sb[k]); });
        }
      }
    });
    y = unpack(ys, batch, x);
  });
  return y;
}

// One pass. A task owns (source block, batch chunk): it writes its slice of grad_x alone, sums each edge's
// weight gradient over its chunk in a private buffer, then adds that into grad_w atomically, because the
// tasks of the other batch chunks add into the same edges at the same time.
template <typename T>
void backward_fused_atomic(const Tiled<T>& g, const Tiled<T>& xs, const T* w, const int32_t* rp, const int32_t* dst,
                           const Tiled<T>& gx, T* gw, int64_t in_features, int64_t tiles) {
  if (tiles == 0) return;  // empty batch: grad_w stays zero
  const int64_t chunks = std::min<int64_t>(tiles, at::get_num_threads());
  const int64_t chunk = ceil_div(tiles, chunks);
  const int64_t block = rows_per_block(in_features, chunks);
  const int64_t blocks = ceil_div(in_features, block);
  at::parallel_for(0, chunks * blocks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<T> partial;
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t c = task / blocks, s0 = (task % blocks) * block, s1 = std::min(in_features, s0 + block);
      const int64_t e0 = rp[s0];
      partial.assign(rp[s1] - e0, T(0));
      for (int64_t t = c * chunk; t < std::min(tiles, (c + 1) * chunk); ++t) {
        for (int64_t s = s0; s < s1; ++s) {
          const T* xrow = xs.row(t, s);
          for (int32_t e = rp[s]; e < rp[s + 1]; ++e) partial[e - e0] += dot(g.row(t, dst[e]), xrow);
          gather_rows(gx.row(t, s), rp[s], rp[s + 1], [&](int64_t e) { return w[e]; },
                      [&](int64_t e) { return g.row(t, dst[e]); });
        }
      }
      for (size_t i = 0; i < partial.size(); ++i) atomic_add(gw + e0 + i, partial[i]);
    }
  });
}

// Two passes with exclusive ownership and no atomics. Pass 1: a task owns a source block, hence its edges,
// and writes their weight gradients once. Pass 2: a task owns (source block, batch tile) of grad_x.
template <typename T>
void backward_atomic_free(const Tiled<T>& g, const Tiled<T>& xs, const T* w, const int32_t* rp, const int32_t* dst,
                          const Tiled<T>& gx, T* gw, int64_t in_features, int64_t tiles) {
  const int64_t block = rows_per_block(in_features, 1);
  const int64_t blocks = ceil_div(in_features, block);
  at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) {
      const int64_t s0 = b * block, s1 = std::min(in_features, s0 + block);
      std::fill(gw + rp[s0], gw + rp[s1], T(0));
      for (int64_t t = 0; t < tiles; ++t) {
        for (int64_t s = s0; s < s1; ++s) {
          const T* xrow = xs.row(t, s);
          for (int32_t e = rp[s]; e < rp[s + 1]; ++e) gw[e] += dot(g.row(t, dst[e]), xrow);
        }
      }
    }
  });
  const int64_t tblock = rows_per_block(in_features, std::max<int64_t>(tiles, 1));
  const int64_t tblocks = ceil_div(in_features, tblock);
  at::parallel_for(0, tiles * tblocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t t = task / tblocks, s0 = (task % tblocks) * tblock, s1 = std::min(in_features, s0 + tblock);
      for (int64_t s = s0; s < s1; ++s) {
        gather_rows(gx.row(t, s), rp[s], rp[s + 1], [&](int64_t e) { return w[e]; },
                    [&](int64_t e) { return g.row(t, dst[e]); });
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> csr_linear_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                                           const at::Tensor& weight, const at::Tensor& row_ptr,
                                                           const at::Tensor& dst, const at::Tensor& src,
                                                           c10::string_view strategy) {
  check_backward(grad_out, x, weight, row_ptr, dst, src);
  const Strategy which = parse_strategy(strategy);
  const int64_t batch = x.size(0), in_features = x.size(1);
  // fused_atomic adds into grad_w, so it starts at zero; atomic_free zeroes its own blocks.
  at::Tensor gw = which == Strategy::FusedAtomic ? at::zeros_like(weight)
                                                      : empty_output(weight.sizes(), weight.options());
  at::Tensor grad_x;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "csr_linear_backward_cpu", [&] {
    using T = scalar_t;
    const int64_t tiles = ceil_div(batch, kTile<T>);
    at::Tensor xs_storage = tiled_empty<T>(tiles, in_features, x);
    at::Tensor g_storage = tiled_empty<T>(tiles, grad_out.size(1), x);
    at::Tensor gx_storage = tiled_empty<T>(tiles, in_features, x);
    const Tiled<T> xs = pack<T>(x, xs_storage), g = pack<T>(grad_out, g_storage);
    const Tiled<T> gx{gx_storage.data_ptr<T>(), in_features};
    auto run = which == Strategy::FusedAtomic ? backward_fused_atomic<T> : backward_atomic_free<T>;
    run(g, xs, weight.data_ptr<T>(), row_ptr.data_ptr<int32_t>(), dst.data_ptr<int32_t>(), gx, gw.data_ptr<T>(),
        in_features, tiles);
    grad_x = unpack(gx, batch, x);
  });
  return {grad_x, gw};
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_sparse_metal, CPU, m) {
  m.impl("csr_linear", &csr_linear_cpu);
  m.impl("csr_linear_backward", &csr_linear_backward_cpu);
}

}  // namespace torch_sparse_metal
