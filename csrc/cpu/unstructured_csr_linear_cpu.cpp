// The unstructured layout (weight [E]) of the CPU backend of the csr_linear ops: its task decomposition over
// threads and its layout_forward_cpu / layout_backward_cpu, called by the ops in csr_linear_cpu.cpp. Activations
// are repacked once per call from [batch, features] into batch tiles, feature-major inside a tile (see Tiled in
// csr_linear_kernels.h; the packing is inside every timing we report). The per-task kernels are in
// csr_linear_kernels_impl.inc, compiled per instruction set.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

#include "../csr_linear_checks.h"
#include "cpu_common.h"
#include "csr_linear_kernels.h"

namespace torch_sparse_metal::cpu {
namespace {

using cpu::kTile;
using cpu::Tiled;

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

// y in the accumulate type T: the SpMM over outputs, a task owning (output block, batch tile).
template <typename T>
at::Tensor tiled_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& col_ptr,
                         const at::Tensor& src_by_dst, const at::Tensor& perm) {
  const at::ScalarType acc = c10::CppTypeToScalarType<T>::value;
  const int64_t batch = x.size(0), out_features = col_ptr.numel() - 1;
  const int64_t tiles = ceil_div(batch, kTile<T>);
  at::Tensor xs_storage, ys_storage = tiled_output<T>(tiles, out_features, x.options());
  const Tiled<T> xs = pack<T>(x.to(acc), tiles, xs_storage), ys{ys_storage.data_ptr<T>(), out_features};
  // One gather of the weights into by-destination order, instead of a random read per edge and tile.
  const at::Tensor w_by_dst = weight.index_select(0, perm).to(acc);
  const cpu::Problem<T> p{{col_ptr.data_ptr<int32_t>(), src_by_dst.data_ptr<int32_t>(), w_by_dst.data_ptr<T>()},
                          xs, {}, ys};
  const auto& k = cpu::kernels<T>();
  for_each_tile_and_block(tiles, out_features, [&](int64_t t, int64_t o0, int64_t o1) { k.spmm(p, t, o0, o1); });
  return unpack<T>(ys_storage, batch);
}

// The backward over batch tiles: x and grad_out packed once, grad_x written tiled by its owners.
template <typename T>
class TiledBackward {
 public:
  TiledBackward(const BackwardArgs& a, T* gw)
      : gw_(gw), batch_(a.x.size(0)), in_features_(a.x.size(1)), tiles_(ceil_div(batch_, kTile<T>)) {
    const at::ScalarType acc = c10::CppTypeToScalarType<T>::value;
    w_ = a.weight.to(acc).contiguous();  // the kernels read raw memory: a view is copied
    gx_storage_ = tiled_output<T>(tiles_, in_features_, a.x.options());
    const Tiled<T> xs = pack<T>(a.x.to(acc), tiles_, xs_storage_);
    const Tiled<T> g = pack<T>(a.grad_out.to(acc), tiles_, g_storage_);
    p_ = {{a.row_ptr.data_ptr<int32_t>(), a.dst.data_ptr<int32_t>(), w_.data_ptr<T>()}, g, xs,
          {gx_storage_.data_ptr<T>(), in_features_}};
  }

  // One pass. A task owns (source block, batch chunk): it writes its slice of grad_x alone, sums each edge's weight
  // gradient over its chunk in a private buffer, then adds that into grad_w atomically, because the tasks of the
  // other batch chunks add into the same edges at the same time.
  void fused_atomic() {
    if (tiles_ == 0) return;  // empty batch: grad_w stays zero
    const auto& k = cpu::kernels<T>();
    const int64_t chunks = std::min<int64_t>(tiles_, at::get_num_threads());
    const int64_t chunk = ceil_div(tiles_, chunks);
    const int64_t block = rows_per_block(in_features_, chunks);
    const int64_t blocks = ceil_div(in_features_, block);
    at::parallel_for(0, chunks * blocks, 1, [&](int64_t lo, int64_t hi) {
      std::vector<T> partial;
      for (int64_t task = lo; task < hi; ++task) {
        const int64_t c = task / blocks, s0 = (task % blocks) * block, s1 = std::min(in_features_, s0 + block);
        const int64_t e0 = p_.rows.ptr[s0];
        partial.assign(p_.rows.ptr[s1] - e0, T(0));
        k.spmm_sddmm_atomic(p_, c * chunk, std::min(tiles_, (c + 1) * chunk), s0, s1, partial.data());
        for (size_t i = 0; i < partial.size(); ++i) atomic_add(gw_ + e0 + i, partial[i]);
      }
    });
  }

  // Two passes with exclusive ownership and no atomics. Pass 1 (the SDDMM): a task owns a source block, hence its
  // edges, and writes their weight gradients once. Pass 2 (the SpMM over sources): a task owns (source block, batch
  // tile) of grad_x.
  void atomic_free() {
    const auto& k = cpu::kernels<T>();
    const int64_t block = rows_per_block(in_features_, 1);
    const int64_t blocks = ceil_div(in_features_, block);
    at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t b = lo; b < hi; ++b) k.sddmm(p_, tiles_, b * block, std::min(in_features_, (b + 1) * block), gw_);
    });
    for_each_tile_and_block(tiles_, in_features_, [&](int64_t t, int64_t s0, int64_t s1) { k.spmm(p_, t, s0, s1); });
  }

  at::Tensor grad_x() const { return unpack<T>(gx_storage_, batch_); }

 private:
  T* gw_;
  int64_t batch_, in_features_, tiles_;
  at::Tensor w_, xs_storage_, g_storage_, gx_storage_;
  cpu::Problem<T> p_;
};

}  // namespace

TSM_DEFINE_CPU_LAYOUT(Unstructured, tiled_forward, TiledBackward)

}  // namespace torch_sparse_metal::cpu
