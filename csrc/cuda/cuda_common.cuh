// What the CUDA files of the csr_linear ops share (csr_linear_cuda.cu: the ops; unstructured_csr_linear_cuda.cu and
// vector_csr_linear_cuda.cu: the layouts): the device value types, widening and narrowing between storage and
// accumulate types, the index clamp, the warp reduce-scatter, the device error words (one store per device, read by
// take_index_errors; an inline function's static locals are one object across translation units, so the ops and
// every layout use the same words), and every layout's entry points.
#pragma once

#include <ATen/ATen.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstring>
#include <mutex>
#include <type_traits>
#include <vector>

#include "../contract.h"

namespace torch_sparse_metal {

// The device types of c10's 16-bit value types (same layout), for the arithmetic of cuda_fp16.h / cuda_bf16.h.
template <typename T>
struct DeviceType {
  using type = T;
};
template <>
struct DeviceType<c10::Half> {
  using type = __half;
};
template <>
struct DeviceType<c10::BFloat16> {
  using type = __nv_bfloat16;
};

// Storage type T to accumulate type Acc and back (round to nearest even); the 16-bit types through their intrinsics.
template <typename Acc, typename T>
__device__ __forceinline__ Acc widen(T v) {
  if constexpr (std::is_same_v<T, __half>) return __half2float(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
  else return static_cast<Acc>(v);
}
template <typename T, typename Acc>
__device__ __forceinline__ T narrow(Acc v) {
  if constexpr (std::is_same_v<T, __half>) return __float2half_rn(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
  else return static_cast<T>(v);
}

// P consecutive values, read with the widest aligned vector loads the width allows (callers keep the address
// aligned to P * sizeof(T)). Kept as T until used: half the registers of the widened values for 16-bit T.
template <typename T, int P>
__device__ __forceinline__ void load_vec(const T* p, T (&raw)[P]) {
  constexpr int kBytes = P * int(sizeof(T));
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      const float4 q = reinterpret_cast<const float4*>(p)[i];
      memcpy(reinterpret_cast<char*>(raw) + 16 * i, &q, 16);
    }
  } else if constexpr (kBytes % 8 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 8; ++i) {
      const float2 q = reinterpret_cast<const float2*>(p)[i];
      memcpy(reinterpret_cast<char*>(raw) + 8 * i, &q, 8);
    }
  } else {
#pragma unroll
    for (int i = 0; i < P; ++i) raw[i] = p[i];
  }
}

// v clamped into [0, limit) (compared unsigned, so negatives clamp too): a bad index cannot reach outside its
// tensor. `seen` keeps the largest value met; the kernel compares it with the limit once, at its end, and sets
// the error word then (two min/max per index, and no device store inside the edge loop, where it could alias
// the index loads and serialise them).
__device__ __forceinline__ int checked_index(int v, int limit, unsigned& seen) {
  seen = max(seen, static_cast<unsigned>(v));
  return min(static_cast<unsigned>(v), static_cast<unsigned>(limit - 1));
}

// v[u] is this lane's share of value u (G values, G a power of two <= 32); afterwards v[0] is the warp's total
// of value lane % G. Offsets W >= G add the partner's share of every value; offsets below G halve: a lane keeps
// the half of its values whose bit W matches its own lane bit and adds its partner's share of them. G values cost
// G * log2(32 / G) + G - 1 shuffles (31 for G = 16, 5 for G = 1). A template per step, not a loop: with a loop
// nvcc kept v in local memory.
template <int G, int W = 16, typename Acc>
__device__ __forceinline__ void warp_reduce_scatter(Acc (&v)[G], int lane) {
  if constexpr (W >= G) {
#pragma unroll
    for (int i = 0; i < G; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], W);
  } else {
    const bool upper = lane & W;
#pragma unroll
    for (int i = 0; i < W; ++i) {
      const Acc send = upper ? v[i] : v[i + W];
      const Acc keep = upper ? v[i + W] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, W);
    }
  }
  if constexpr (W > 1) warp_reduce_scatter<G, W / 2>(v, lane);
}

// The error words of a device (zeros on first use), one int per index array; they live as long as the process.
// Returned by value (a handle to the same storage): a reference into the vector would dangle when another
// device's first use resizes it.
inline at::Tensor error_words(const at::Device& device) {
  static std::mutex mutex;
  static std::vector<at::Tensor> words;
  const std::lock_guard<std::mutex> lock(mutex);
  const size_t i = static_cast<size_t>(device.index());
  if (words.size() <= i) words.resize(i + 1);
  if (!words[i].defined())
    words[i] = at::zeros({static_cast<int64_t>(IndexArray::count)}, at::TensorOptions(device).dtype(at::kInt));
  return words[i];
}

inline int* error_word(const at::Device& device, IndexArray array) {
  return error_words(device).mutable_data_ptr<int>() + static_cast<int>(array);
}

// A tensor's data as the device type (c10's 16-bit types as cuda_fp16.h / cuda_bf16.h types, same layout).
template <typename T>
const T* device_ptr(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.const_data_ptr());
}
template <typename T>
T* device_ptr(at::Tensor& t) {
  return reinterpret_cast<T*>(t.mutable_data_ptr());
}

// A backward call after the ops' checks: its operands (x, weight and grad_out contiguous), index arrays, and outputs
// grad_x [batch, in_features] and grad_w (weight's shape, the accumulate type; zero-filled where the strategy adds
// into it, contract.h), which the layout's strategy writes.
struct BackwardCall {
  at::Tensor grad_out, x, weight;
  const at::Tensor &row_ptr, &dst, &col_ptr, &src_by_dst, &perm;
  at::Tensor grad_x, grad_w;
};

// Layout L's forward and backward (contract.h's layout table), called by the ops (csr_linear_cuda.cu) with their
// checks passed and at least one row, column and connection: y [batch, out_features] written, and the backward of a
// strategy. Declared for every layout from the table; each is defined in the layout's own file,
// <layout>_csr_linear_cuda.cu.
template <Layout L>
void layout_forward_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& col_ptr,
                         const at::Tensor& src_by_dst, const at::Tensor& perm, at::Tensor& y);
template <Layout L>
void layout_backward_cuda(BackwardCall& call, Strategy which);

#define TSM_DECLARE_LAYOUT(name, ...)                                                                          \
  template <>                                                                                                  \
  void layout_forward_cuda<Layout::name>(const at::Tensor&, const at::Tensor&, const at::Tensor&,              \
                                         const at::Tensor&, const at::Tensor&, at::Tensor&);                   \
  template <>                                                                                                  \
  void layout_backward_cuda<Layout::name>(BackwardCall&, Strategy);
TSM_FOR_EACH_LAYOUT(TSM_DECLARE_LAYOUT)
#undef TSM_DECLARE_LAYOUT

}  // namespace torch_sparse_metal
