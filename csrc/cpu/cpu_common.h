// What the CPU op families share (csr_linear_cpu.cpp, vector_csr_linear_cpu.cpp): the atomic add of a task's
// partial weight gradients and the integer ceiling division of their task splits.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace torch_sparse_metal {
namespace cpu {

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

}  // namespace cpu
}  // namespace torch_sparse_metal
