// Single-thread timing of the CPU kernel sets without torch, for A/B comparisons of kernel changes on a noisy
// machine: each kernel runs many short times and the minimum is reported (neighbours steal whole slices). Every
// set this build has and this CPU runs (AVX2 on x86-64 with GCC, NEON on arm64) is timed beside the baseline set
// in the same run, in float32 and float64; its speed-up over the baseline is printed, and its outputs are
// compared with the baseline's (largest difference relative to the largest baseline value).
//
// The same command on x86-64 Linux (g++), arm64 Linux (g++, e.g. Graviton) and a Mac (Apple's clang++), from the
// repository root (the compile is one line):
//   c++ -O3 -std=c++17 -fopenmp-simd -I csrc/cpu -o /tmp/kbench benchmarks/cpu_kernel_microbench.cpp
//       csrc/cpu/csr_linear_kernels_*.cpp
//   /tmp/kbench 1024 1024 0.05 256
// Arguments: in_features out_features density batch [repetitions, default 300].
#include <algorithm>
#include <chrono>
#include <cmath>
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

// The kernel sets to time: the baseline first, then each wider one this build has and this CPU runs.
template <typename T>
std::vector<const KernelTable<T>*> kernel_sets() {
  std::vector<const KernelTable<T>*> sets{&generic_kernels<T>()};
#ifdef TORCH_SPARSE_METAL_HAVE_AVX2_KERNELS
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) sets.push_back(&avx2_kernels<T>());
#endif
#ifdef TORCH_SPARSE_METAL_HAVE_NEON_KERNELS
  sets.push_back(&neon_kernels<T>());
#endif
  return sets;
}

// A random CSR topology by source (row_ptr, dst) with its by-destination view (col_ptr, src_by_dst).
struct Topology {
  std::vector<int32_t> row_ptr{0}, dst, col_ptr, src_by_dst;
  Topology(int64_t in, int64_t out, double density, std::mt19937& rng) : col_ptr(out + 1, 0) {
    std::uniform_real_distribution<double> u(0, 1);
    for (int64_t s = 0; s < in; ++s) {
      for (int64_t o = 0; o < out; ++o) {
        if (u(rng) < density) dst.push_back(int32_t(o));
      }
      row_ptr.push_back(int32_t(dst.size()));
    }
    for (int32_t d : dst) ++col_ptr[d + 1];
    for (int64_t o = 0; o < out; ++o) col_ptr[o + 1] += col_ptr[o];
    src_by_dst.resize(dst.size());
    std::vector<int32_t> fill(col_ptr.begin(), col_ptr.end() - 1);
    for (int64_t s = 0; s < in; ++s) {
      for (int32_t e = row_ptr[s]; e < row_ptr[s + 1]; ++e) src_by_dst[fill[dst[e]]++] = int32_t(s);
    }
  }
};

// What one set computed: the tiled forward and grad_x, and grad_w of both backward strategies.
template <typename T>
struct Outputs {
  std::vector<T> y, grad_x, dw_fused, dw_free;
};

// max |a - b| / max(1, max |b|) over every output.
template <typename T>
double relative_difference(const Outputs<T>& a, const Outputs<T>& b) {
  double diff = 0, scale = 1;
  for (auto field : {&Outputs<T>::y, &Outputs<T>::grad_x, &Outputs<T>::dw_fused, &Outputs<T>::dw_free}) {
    for (size_t i = 0; i < (b.*field).size(); ++i) {
      diff = std::max(diff, std::fabs(double((a.*field)[i]) - double((b.*field)[i])));
      scale = std::max(scale, std::fabs(double((b.*field)[i])));
    }
  }
  return diff / scale;
}

template <typename T>
void run(const char* type, const Topology& topo, int64_t in, int64_t out, double density, int64_t batch, int reps) {
  const int64_t tiles = (batch + kTile<T> - 1) / kTile<T>, edges = int64_t(topo.dst.size());
  std::mt19937 rng(1);
  std::uniform_real_distribution<T> u(-1, 1);
  std::vector<T> w(edges), xm(batch * in), gm(batch * out), xt(tiles * in * kTile<T>), gt(tiles * out * kTile<T>);
  for (auto* v : {&w, &xm, &gm}) {
    for (T& f : *v) f = u(rng);
  }
  const Tiled<T> X{xt.data(), in}, G{gt.data(), out};
  Outputs<T> baseline;
  double baseline_ms[6] = {};
  const std::vector<const KernelTable<T>*> sets = kernel_sets<T>();
  for (size_t set = 0; set < sets.size(); ++set) {
    const KernelTable<T>& k = *sets[set];
    Outputs<T> o{std::vector<T>(tiles * out * kTile<T>), std::vector<T>(tiles * in * kTile<T>),
                 std::vector<T>(edges), std::vector<T>(edges)};
    std::vector<T> xback(batch * in);
    const Tiled<T> Y{o.y.data(), out}, GX{o.grad_x.data(), in};
    const Problem<T> bwd{{topo.row_ptr.data(), topo.dst.data(), w.data()}, G, X, GX};
    const Problem<T> fwd{{topo.col_ptr.data(), topo.src_by_dst.data(), w.data()}, X, {}, Y};
    double ms[6];
    ms[0] = min_ms([&] { for (int64_t t = 0; t < tiles; ++t) k.pack(xm.data(), in, batch, X, t, 0, in); }, reps);
    for (int64_t t = 0; t < tiles; ++t) k.pack(gm.data(), out, batch, G, t, 0, out);
    ms[1] = min_ms([&] { for (int64_t t = 0; t < tiles; ++t) k.unpack(X, t, 0, in, xback.data(), in, batch); }, reps);
    if (xback != xm) std::printf("%s %s: unpack(pack(x)) != x\n", k.name, type);
    // The stages as the ops call them: spmm over outputs (forward), spmm_sddmm_atomic (fused_atomic), sddmm and
    // spmm over sources (atomic_free passes 1 and 2).
    ms[2] = min_ms([&] { for (int64_t t = 0; t < tiles; ++t) k.spmm(fwd, t, 0, out); }, reps);
    ms[3] = min_ms([&] {
      std::fill(o.dw_fused.begin(), o.dw_fused.end(), T(0));
      k.spmm_sddmm_atomic(bwd, 0, tiles, 0, in, o.dw_fused.data());
    }, reps);
    ms[4] = min_ms([&] { k.sddmm(bwd, tiles, 0, in, o.dw_free.data()); }, reps);
    ms[5] = min_ms([&] { for (int64_t t = 0; t < tiles; ++t) k.spmm(bwd, t, 0, in); }, reps);
    std::printf("%-7s %-7s %lldx%lld d=%.3g B=%lld E=%lld  pack %.3f unpack %.3f spmm(fwd) %.3f "
                "spmm_sddmm_atomic %.3f sddmm %.3f spmm(grad_x) %.3f ms\n",
                k.name, type, (long long)in, (long long)out, density, (long long)batch, (long long)edges, ms[0],
                ms[1], ms[2], ms[3], ms[4], ms[5]);
    if (set == 0) {
      baseline = o;
      std::copy(ms, ms + 6, baseline_ms);
    } else {
      std::printf("%-7s %-7s speed-up over generic: pack %.2fx unpack %.2fx spmm(fwd) %.2fx spmm_sddmm_atomic "
                  "%.2fx sddmm %.2fx spmm(grad_x) %.2fx; outputs differ by %.2g (relative)\n",
                  k.name, type, baseline_ms[0] / ms[0], baseline_ms[1] / ms[1], baseline_ms[2] / ms[2],
                  baseline_ms[3] / ms[3], baseline_ms[4] / ms[4], baseline_ms[5] / ms[5],
                  relative_difference(o, baseline));
    }
  }
}

int main(int argc, char** argv) {
  const int64_t in = argc > 1 ? atol(argv[1]) : 1024, out = argc > 2 ? atol(argv[2]) : 1024;
  const double density = argc > 3 ? atof(argv[3]) : 0.05;
  const int64_t batch = argc > 4 ? atol(argv[4]) : 256;
  std::mt19937 rng(0);
  const Topology topo(in, out, density, rng);
  const int reps = argc > 5 ? atoi(argv[5]) : 300;
  run<float>("float32", topo, in, out, density, batch, reps);
  run<double>("float64", topo, in, out, density, batch, reps);
}
