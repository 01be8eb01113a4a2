// Single-thread timing of the CPU kernels without torch, for A/B comparisons of kernel changes on a noisy
// machine: each kernel runs many short times and the minimum is reported (neighbours steal whole slices).
// g++ -O3 -std=c++17 -fopenmp-simd -I csrc/cpu -o /tmp/kbench benchmarks/cpu_kernel_microbench.cpp \
//     csrc/cpu/csr_linear_kernels_avx2.cpp csrc/cpu/csr_linear_kernels_generic.cpp && /tmp/kbench 1024 1024 0.05 256
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "csr_linear_kernels.h"

using namespace torch_sparse_metal::cpu;

template <typename F>
double min_ms(F&& f, int reps) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto a = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
  }
  return best;
}

int main(int argc, char** argv) {
  const int64_t in = argc > 1 ? atol(argv[1]) : 1024, out = argc > 2 ? atol(argv[2]) : 1024;
  const double density = argc > 3 ? atof(argv[3]) : 0.05;
  const int64_t batch = argc > 4 ? atol(argv[4]) : 256, tiles = (batch + 15) / 16;
  std::mt19937 rng(0);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<int32_t> row_ptr{0}, dst, col_ptr(out + 1, 0), src_by_dst;
  for (int64_t s = 0; s < in; ++s) {
    for (int64_t o = 0; o < out; ++o) {
      if (std::uniform_real_distribution<double>(0, 1)(rng) < density) dst.push_back(int32_t(o));
    }
    row_ptr.push_back(int32_t(dst.size()));
  }
  const int64_t edges = int64_t(dst.size());
  for (int32_t d : dst) ++col_ptr[d + 1];
  for (int64_t o = 0; o < out; ++o) col_ptr[o + 1] += col_ptr[o];
  src_by_dst.resize(edges);
  std::vector<int32_t> fill(col_ptr.begin(), col_ptr.end() - 1);
  for (int64_t s = 0; s < in; ++s) {
    for (int32_t e = row_ptr[s]; e < row_ptr[s + 1]; ++e) src_by_dst[fill[dst[e]]++] = int32_t(s);
  }
  std::vector<float> w(edges), xm(batch * in), gm(batch * out), xt(tiles * in * 16), gt(tiles * out * 16),
      ot(tiles * std::max(in, out) * 16), dw(edges);
  for (auto* v : {&w, &xm, &gm}) for (float& f : *v) f = u(rng);
  const Tiled<float> X{xt.data(), in}, G{gt.data(), out}, OI{ot.data(), in}, OO{ot.data(), out};
  const int reps = 300;
  for (const char* name : {"generic", "avx2"}) {
    const KernelTable<float>& k = name[0] == 'g' ? generic_kernels<float>() : avx2_kernels<float>();
    const Problem<float> bwd{{row_ptr.data(), dst.data(), w.data()}, G, X, OI};
    const Problem<float> fwd{{col_ptr.data(), src_by_dst.data(), w.data()}, X, {}, OO};
    const double pack = min_ms([&] { for (int64_t t = 0; t < tiles; ++t) k.pack(xm.data(), in, batch, X, t, 0, in); }, reps);
    for (int64_t t = 0; t < tiles; ++t) k.pack(gm.data(), out, batch, G, t, 0, out);
    const double unpack = min_ms([&] { for (int64_t t = 0; t < tiles; ++t) k.unpack(X, t, 0, in, xm.data(), in, batch); }, reps);
    // The stages as the ops call them: spmm over outputs (forward), spmm_sddmm_atomic (fused_atomic), sddmm and
    // spmm over sources (atomic_free passes 1 and 2).
    const double forward = min_ms([&] { for (int64_t t = 0; t < tiles; ++t) k.spmm(fwd, t, 0, out); }, reps);
    const double fused = min_ms([&] {
      std::fill(dw.begin(), dw.end(), 0.f);
      k.spmm_sddmm_atomic(bwd, 0, tiles, 0, in, dw.data());
    }, reps);
    const double gw = min_ms([&] { k.sddmm(bwd, tiles, 0, in, dw.data()); }, reps);
    const double gx = min_ms([&] { for (int64_t t = 0; t < tiles; ++t) k.spmm(bwd, t, 0, in); }, reps);
    std::printf("%-8s %lldx%lld d=%.3g B=%lld E=%lld  pack %.3f unpack %.3f spmm(fwd) %.3f spmm_sddmm_atomic %.3f "
                "sddmm %.3f spmm(grad_x) %.3f ms\n",
                name, (long long)in, (long long)out, density, (long long)batch, (long long)edges, pack, unpack, forward, fused,
                gw, gx);
  }
}
