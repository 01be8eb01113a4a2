// CPU backend of the csr_linear ops: ATen glue, layout packing and the task decomposition over threads.
// The per-task kernels are in csr_linear_kernels_impl.inc, compiled per instruction set.
//
// Layout: activations are repacked once per call from [batch, features] into batch tiles, feature-major
// inside a tile (see Tiled in csr_linear_kernels.h; the packing is inside every timing we report).
//
// Precision: the kernels compute in the accumulate type of contract.h (float32 for float16 and bfloat16).
// 16-bit operands are widened once at the boundary (ATen's vectorised conversions, F16C / AVX-512 where the
// CPU has them), and results are rounded once to the storage type.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../csr_linear_checks.h"
#include "cpu_common.h"
#include "csr_linear_kernels.h"

namespace torch_sparse_metal {
namespace {

using cpu::kTile;
using cpu::Tiled;

using cpu::atomic_add;
using cpu::ceil_div;

// Tiled storage a kernel writes (poisoned under TORCH_SPARSE_METAL_POISON=1, see empty_output).
template <typename T>
at::Tensor tiled_output(int64_t tiles, int64_t features, const at::TensorOptions& options) {
  return empty_output({tiles, features, kTile<T>}, options.dtype(c10::CppTypeToScalarType<T>::value));
}

// Runs body(t, f0, f1) over every (batch tile, block of 256 features) in parallel: the layout conversions.
template <typename Body>
void for_each_tile_block(int64_t tiles, int64_t features, const Body& body) {
  constexpr int64_t kFeatures = 256;  // a multiple of the AVX2 kernels' 8-feature transposes
  const int64_t blocks = ceil_div(features, kFeatures);
  at::parallel_for(0, tiles * blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t f0 = (task % blocks) * kFeatures;
      body(task / blocks, f0, std::min(features, f0 + kFeatures));
    }
  });
}

// [batch, features] row-major -> Tiled, the tail tile zero-padded.
template <typename T>
Tiled<T> pack(const at::Tensor& m, int64_t tiles, at::Tensor& storage) {
  const at::Tensor rows = m.contiguous();
  const int64_t batch = rows.size(0), features = rows.size(1);
  storage = tiled_output<T>(tiles, features, rows.options());
  const Tiled<T> out{storage.data_ptr<T>(), features};
  const T* src = rows.data_ptr<T>();
  const auto& k = cpu::kernels<T>();
  for_each_tile_block(tiles, features, [&](int64_t t, int64_t f0, int64_t f1) {
    k.pack(src, features, batch, out, t, f0, f1);
  });
  return out;
}

// Tiled -> [batch, features] row-major.
template <typename T>
at::Tensor unpack(const at::Tensor& storage, int64_t batch) {
  const int64_t tiles = storage.size(0), features = storage.size(1);
  at::Tensor m = empty_output({batch, features}, storage.options());
  const Tiled<T> in{storage.data_ptr<T>(), features};
  T* dst = m.data_ptr<T>();
  const auto& k = cpu::kernels<T>();
  for_each_tile_block(tiles, features, [&](int64_t t, int64_t f0, int64_t f1) {
    k.unpack(in, t, f0, f1, dst, features, batch);
  });
  return m;
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
  check_topology_cpu(weight.numel(), x.size(1), out_features, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  const int32_t* cp = col_ptr.data_ptr<int32_t>();
  const int32_t* sb = src_by_dst.data_ptr<int32_t>();
  at::Tensor y;
  dispatch_value_type(x.scalar_type(), "csr_linear_cpu", [&](auto types) {
    using T = typename decltype(types)::Acc;  // the kernels' type
    const at::ScalarType acc = c10::CppTypeToScalarType<T>::value;
    const int64_t tiles = ceil_div(batch, kTile<T>);
    at::Tensor xs_storage, ys_storage = tiled_output<T>(tiles, out_features, x.options());
    const Tiled<T> xs = pack<T>(x.to(acc), tiles, xs_storage), ys{ys_storage.data_ptr<T>(), out_features};
    // One gather of the weights into by-destination order, instead of a random read per edge and tile.
    const at::Tensor w_by_dst = weight.index_select(0, perm).to(acc);
    const cpu::Problem<T> p{{cp, sb, w_by_dst.data_ptr<T>()}, xs, {}, ys};
    const auto& k = cpu::kernels<T>();
    const int64_t block = rows_per_block(out_features, std::max<int64_t>(tiles, 1));
    const int64_t blocks = ceil_div(out_features, block);
    // The SpMM over outputs: a task owns (output block, batch tile), so no two tasks write one element.
    at::parallel_for(0, tiles * blocks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t task = lo; task < hi; ++task) {
        const int64_t o0 = (task % blocks) * block;
        k.spmm(p, task / blocks, o0, std::min(out_features, o0 + block));
      }
    });
    y = unpack<T>(ys_storage, batch).to(x.scalar_type());
  });
  return y;
}

// One pass. A task owns (source block, batch chunk): it writes its slice of grad_x alone, sums each edge's
// weight gradient over its chunk in a private buffer, then adds that into grad_w atomically, because the
// tasks of the other batch chunks add into the same edges at the same time.
template <typename T>
void backward_fused_atomic(const cpu::Problem<T>& p, T* gw, int64_t in_features, int64_t tiles) {
  if (tiles == 0) return;  // empty batch: grad_w stays zero
  const auto& k = cpu::kernels<T>();
  const int64_t chunks = std::min<int64_t>(tiles, at::get_num_threads());
  const int64_t chunk = ceil_div(tiles, chunks);
  const int64_t block = rows_per_block(in_features, chunks);
  const int64_t blocks = ceil_div(in_features, block);
  at::parallel_for(0, chunks * blocks, 1, [&](int64_t lo, int64_t hi) {
    std::vector<T> partial;
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t c = task / blocks, s0 = (task % blocks) * block, s1 = std::min(in_features, s0 + block);
      const int64_t e0 = p.rows.ptr[s0];
      partial.assign(p.rows.ptr[s1] - e0, T(0));
      k.spmm_sddmm_atomic(p, c * chunk, std::min(tiles, (c + 1) * chunk), s0, s1, partial.data());
      for (size_t i = 0; i < partial.size(); ++i) atomic_add(gw + e0 + i, partial[i]);
    }
  });
}

// Two passes with exclusive ownership and no atomics. Pass 1 (the SDDMM): a task owns a source block, hence its
// edges, and writes their weight gradients once. Pass 2 (the SpMM over sources): a task owns (source block, batch
// tile) of grad_x.
template <typename T>
void backward_atomic_free(const cpu::Problem<T>& p, T* gw, int64_t in_features, int64_t tiles) {
  const auto& k = cpu::kernels<T>();
  const int64_t block = rows_per_block(in_features, 1);
  const int64_t blocks = ceil_div(in_features, block);
  at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t b = lo; b < hi; ++b) k.sddmm(p, tiles, b * block, std::min(in_features, (b + 1) * block), gw);
  });
  const int64_t tblock = rows_per_block(in_features, std::max<int64_t>(tiles, 1));
  const int64_t tblocks = ceil_div(in_features, tblock);
  at::parallel_for(0, tiles * tblocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t task = lo; task < hi; ++task) {
      const int64_t s0 = (task % tblocks) * tblock;
      k.spmm(p, task / tblocks, s0, std::min(in_features, s0 + tblock));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> csr_linear_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x,
                                                           const at::Tensor& weight, const at::Tensor& row_ptr,
                                                           const at::Tensor& dst, const at::Tensor& src,
                                                           const at::Tensor& col_ptr, const at::Tensor& src_by_dst,
                                                           const at::Tensor& perm, c10::string_view strategy) {
  check_backward(grad_out, x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  // out_features: col_ptr's (check_backward made grad_out's width equal to it)
  check_topology_cpu(weight.numel(), x.size(1), col_ptr.numel() - 1, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  const Strategy which = parse_strategy(strategy);
  const int64_t batch = x.size(0), in_features = x.size(1);
  at::Tensor grad_x, gw;
  dispatch_value_type(x.scalar_type(), "csr_linear_backward_cpu", [&](auto types) {
    using T = typename decltype(types)::Acc;  // the kernels' type
    const at::ScalarType acc = c10::CppTypeToScalarType<T>::value;
    // fused_atomic adds into grad_w, so it starts at zero; atomic_free zeroes its own blocks.
    gw = which == Strategy::FusedAtomic ? at::zeros(weight.sizes(), weight.options().dtype(acc))
                                        : empty_output(weight.sizes(), weight.options().dtype(acc));
    const int64_t tiles = ceil_div(batch, kTile<T>);
    const at::Tensor w = weight.to(acc).contiguous();  // the kernels read raw memory: a view is copied
    at::Tensor xs_storage, g_storage, gx_storage = tiled_output<T>(tiles, in_features, x.options());
    const Tiled<T> xs = pack<T>(x.to(acc), tiles, xs_storage), g = pack<T>(grad_out.to(acc), tiles, g_storage);
    const Tiled<T> gx{gx_storage.data_ptr<T>(), in_features};
    const cpu::Problem<T> p{{row_ptr.data_ptr<int32_t>(), dst.data_ptr<int32_t>(), w.data_ptr<T>()}, g, xs, gx};
    switch (which) {
      case Strategy::FusedAtomic:
        backward_fused_atomic<T>(p, gw.data_ptr<T>(), in_features, tiles);
        break;
      case Strategy::AtomicFree:
        backward_atomic_free<T>(p, gw.data_ptr<T>(), in_features, tiles);
        break;
    }
    grad_x = unpack<T>(gx_storage, batch).to(x.scalar_type());
  });
  return {grad_x, gw.to(weight.scalar_type())};
}

// No error words on the CPU: check_topology_cpu raises before a kernel could meet a bad index.
std::vector<int64_t> take_index_errors_cpu(const at::Tensor& /*like*/) {
  return std::vector<int64_t>(static_cast<size_t>(IndexArray::count), 0);
}

}  // namespace

TORCH_LIBRARY_IMPL(torch_sparse_metal, CPU, m) {
  m.impl("csr_linear", &csr_linear_cpu);
  m.impl("csr_linear_backward", &csr_linear_backward_cpu);
  m.impl("take_index_errors", &take_index_errors_cpu);
}

}  // namespace torch_sparse_metal
