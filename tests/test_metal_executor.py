"""The MSL-on-CPU executor itself: it must behave like Metal where our kernels depend on it, and fail loudly
where a kernel would be wrong on a GPU (missing barriers, divergent collectives).

The tests of behaviour that every target shares (barriers, SIMD-group functions, atomics, partial groups,
argument binding) also run against the CUDA translation (``testing.msl.cuda``) where an NVIDIA GPU and nvcc
exist; on every machine with nvcc the translation of these kernels must compile."""

from __future__ import annotations

import pytest
import torch

from torch_sparse_metal.backends import mps
from tsm_dev.msl import EXECUTED, MslError, compile_shader
from tsm_dev.msl import cuda as cuda_translation

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

// Sum of each group's values through threadgroup memory: a tree reduction with barriers.
kernel void reduce_with_barrier(device float* out [[buffer(0)]], device const float* in [[buffer(1)]],
                                uint gid [[thread_position_in_grid]], uint lid [[thread_position_in_threadgroup]],
                                uint group [[threadgroup_position_in_grid]], uint size [[threads_per_threadgroup]]) {
  threadgroup float partial[256];
  partial[lid] = in[gid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint stride = 128; stride > 0; stride >>= 1) {
    if (lid < stride && lid + stride < size) partial[lid] += partial[lid + stride];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (lid == 0) out[group] = partial[0];
}

// The same without barriers: wrong on a GPU, and a data race here.
kernel void reduce_without_barrier(device float* out [[buffer(0)]], device const float* in [[buffer(1)]],
                                   uint gid [[thread_position_in_grid]],
                                   uint lid [[thread_position_in_threadgroup]],
                                   uint group [[threadgroup_position_in_grid]],
                                   uint size [[threads_per_threadgroup]]) {
  threadgroup float partial[256];
  partial[lid] = in[gid];
  for (uint stride = 128; stride > 0; stride >>= 1) {
    if (lid < stride && lid + stride < size) partial[lid] += partial[lid + stride];
  }
  if (lid == 0) out[group] = partial[0];
}

// Records the order in which lanes run, before and after a barrier.
kernel void lane_order(device int* order [[buffer(0)]], device atomic_int* counter [[buffer(1)]],
                       uint lid [[thread_position_in_threadgroup]], uint size [[threads_per_threadgroup]]) {
  order[atomic_fetch_add_explicit(&counter[0], 1, memory_order_relaxed)] = int(lid);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  order[size + atomic_fetch_add_explicit(&counter[1], 1, memory_order_relaxed)] = int(lid);
}

// Lanes >= `half_` return before the barrier the others wait at: undefined on Metal, an error here.
kernel void partial_barrier(device float* out [[buffer(0)]], constant long& half_ [[buffer(1)]],
                            uint lid [[thread_position_in_threadgroup]]) {
  if (long(lid) >= half_) return;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = 1.0f;
}

// A SIMD-group function inside divergent control flow, the other lanes at a barrier: deadlock.
kernel void divergent_simd(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  if (lid < 16) out[lid] = simd_sum(1.0f);
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

kernel void simd_ops(device float* sums [[buffer(0)]], device float* prefix [[buffer(1)]],
                     device float* xor1 [[buffer(2)]], device float* bcast [[buffer(3)]],
                     device float* maxes [[buffer(4)]], device const float* in [[buffer(5)]],
                     uint gid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]],
                     uint width [[threads_per_simdgroup]]) {
  float v = in[gid];
  sums[gid] = simd_sum(v);
  prefix[gid] = simd_prefix_exclusive_sum(v);
  xor1[gid] = simd_shuffle_xor(v, 1u);
  bcast[gid] = simd_broadcast(v, 3u);
  maxes[gid] = simd_max(v) + float(width) * 0.0f;
}

kernel void atomics(device atomic_int* count [[buffer(0)]], device atomic_float* total [[buffer(1)]],
                    device const float* in [[buffer(2)]], uint gid [[thread_position_in_grid]]) {
  atomic_fetch_add_explicit(count, 1, memory_order_relaxed);
  atomic_fetch_add_explicit(total, in[gid], memory_order_relaxed);
}

// Writes the built-ins of each thread of a 2-D grid; counts visits per element.
kernel void ids_2d(device uint* info [[buffer(0)]], device atomic_uint* visits [[buffer(1)]],
                   constant long& width [[buffer(2)]], uint2 pos [[thread_position_in_grid]],
                   uint2 size [[threads_per_threadgroup]], uint2 requested [[dispatch_threads_per_threadgroup]],
                   uint2 group [[threadgroup_position_in_grid]]) {
  ulong i = ulong(pos.y) * ulong(width) + pos.x;
  atomic_fetch_add_explicit(&visits[i], 1, memory_order_relaxed);  // int literal into atomic_uint, as Metal allows
  info[i * 6 + 0] = size.x;
  info[i * 6 + 1] = size.y;
  info[i * 6 + 2] = requested.x;
  info[i * 6 + 3] = requested.y;
  info[i * 6 + 4] = group.x;
  info[i * 6 + 5] = group.y;
}

kernel void scalars(device long* out [[buffer(0)]], constant long& a [[buffer(1)]], constant int& b [[buffer(2)]],
                    constant float& c [[buffer(3)]], constant long* la [[buffer(4)]], constant int* lb [[buffer(5)]],
                    uint i [[thread_position_in_grid]]) {
  out[0] = a;
  out[1] = long(b);
  out[2] = long(c * 4.0f);
  out[3] = la[0] + la[1] + la[2];
  out[4] = long(lb[0]) + long(lb[1]);
}

template <typename T>
kernel void fill(device T* out [[buffer(0)]], constant T& value [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  out[i] = value;
}
#define INSTANTIATE_FILL(T) template [[host_name("fill_" #T)]] [[kernel]] decltype(fill<T>) fill<T>;
INSTANTIATE_FILL(float)
INSTANTIATE_FILL(int)
INSTANTIATE_FILL(half)
#if __METAL_VERSION__ >= 310
INSTANTIATE_FILL(bfloat)
#endif

// Float math as IEEE 754 has it, which fast math would not keep: (a + b) - a is not b once a + b rounds, and a
// NaN is a NaN.
kernel void ieee_float(device float* diff [[buffer(0)]], device int* nan [[buffer(1)]],
                       device const float* a [[buffer(2)]], device const float* b [[buffer(3)]],
                       uint i [[thread_position_in_grid]]) {
  diff[i] = (a[i] + b[i]) - a[i];
  nan[i] = isnan(a[i]) ? 1 : 0;
}

// float -> T -> float, as the shaders convert: T(float) rounds to nearest even, float(T) is exact.
template <typename T>
kernel void convert(device T* out [[buffer(0)]], device float* back [[buffer(1)]], device const float* in [[buffer(2)]],
                    uint i [[thread_position_in_grid]]) {
  const T v = T(in[i]);
  out[i] = v;
  back[i] = float(v);
}

// Arithmetic in T: each result is rounded to T.
template <typename T>
kernel void arith(device T* sum [[buffer(0)]], device T* diff [[buffer(1)]], device T* prod [[buffer(2)]],
                  device const T* a [[buffer(3)]], device const T* b [[buffer(4)]],
                  uint i [[thread_position_in_grid]]) {
  sum[i] = a[i] + b[i];
  diff[i] = a[i] - b[i];
  prod[i] = a[i] * b[i];
}

// Four values per thread through one vec<T, 4> load and one store (the access of tsm::load_lanes), scaled in float.
template <typename T>
kernel void scale4(device T* out [[buffer(0)]], device const T* in [[buffer(1)]], constant float& s [[buffer(2)]],
                   uint i [[thread_position_in_grid]]) {
  const vec<T, 4> v = ((device const vec<T, 4>*)in)[i];
  vec<T, 4> r;
  r.x = T(float(v.x) * s);
  r.y = T(float(v.y) * s);
  r.z = T(float(v.z) * s);
  r.w = T(float(v.w) * s);
  ((device vec<T, 4>*)out)[i] = r;
}

#define INSTANTIATE_16(T)                                                   \
  template [[host_name("convert_" #T)]] [[kernel]] decltype(convert<T>) convert<T>; \
  template [[host_name("arith_" #T)]] [[kernel]] decltype(arith<T>) arith<T>;       \
  template [[host_name("scale4_" #T)]] [[kernel]] decltype(scale4<T>) scale4<T>;
INSTANTIATE_16(half)
#if __METAL_VERSION__ >= 310  // bfloat is Metal 3.1
INSTANTIATE_16(bfloat)
#endif
"""


@pytest.fixture(scope="module")
def lib():
    return compile_shader(SOURCE, "executor_test.metal")


@pytest.fixture(scope="module", params=["executor", "cuda"])
def target(request):
    """(library, device) of a target that runs Metal kernels: the executor, or the CUDA translation on a GPU."""
    if request.param == "executor":
        return compile_shader(SOURCE, "executor_test.metal"), "cpu"
    if not torch.cuda.is_available() or cuda_translation.nvcc_path() is None:
        pytest.skip("the CUDA translation needs an NVIDIA GPU and nvcc")
    return cuda_translation.compile_shader(SOURCE, "executor_test.metal"), "cuda"


@pytest.mark.skipif(cuda_translation.nvcc_path() is None, reason="nvcc not installed (a CUDA toolkit)")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", ["executor_test.metal", "csr_linear_library.metal"])
def test_cuda_translation_compiles(name, arch):
    """These kernels and the shipped shaders (every value type they instantiate: float, half, bfloat)."""
    source = SOURCE if name == "executor_test.metal" else mps.load_source()
    assert cuda_translation.compile_cubin(cuda_translation.translate(source, name), arch)


def test_kernels_listed_and_attributes(lib):
    names = dir(lib)
    for name in ("reduce_with_barrier", "simd_ops", "fill_float", "fill_int"):
        assert name in names
    k = lib.reduce_with_barrier
    assert k.max_threads_per_threadgroup == 1024
    assert k.thread_execution_width == 32
    assert k.static_thread_group_memory_length == 256 * 4
    assert lib.atomics.static_thread_group_memory_length == 0
    with pytest.raises(AttributeError):
        lib.no_such_kernel  # noqa: B018


@pytest.mark.parametrize("n,group", [(1000, 256), (256, 256), (300, 100), (7, 32)])
def test_barrier_reduction(target, n, group):
    lib, dev = target
    x = torch.randn(n)
    ngroups = -(-n // group)
    out = torch.full((ngroups,), float("nan"), device=dev)
    lib.reduce_with_barrier(out, x.to(dev), threads=n, group_size=group)
    ref = torch.stack([x[g * group:(g + 1) * group].sum() for g in range(ngroups)])
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_missing_barrier_is_reported(lib, seed):
    """Whatever order the lanes run in: a read before the other lane's store reads memory not yet written, a
    read after it races with it."""
    x = torch.rand(256 * 8) + 1.0
    with pytest.raises(MslError, match=r"reduce_without_barrier: .*threadgroup array 'partial' at index \d+"
                                       r"(: data race|, which no thread)"):
        lib.reduce_without_barrier(torch.zeros(8), x, threads=x.numel(), group_size=256, seed=seed)


def test_lane_order_is_shuffled_per_dispatch_and_per_barrier(lib):
    orders = []
    for _ in range(2):
        order = torch.full((128,), -1, dtype=torch.int32)
        lib.lane_order(order, torch.zeros(2, dtype=torch.int32), threads=64, group_size=64)
        assert sorted(order[:64].tolist()) == list(range(64)) == sorted(order[64:].tolist())
        orders.append(order)
    assert not torch.equal(orders[0][:64], orders[1][:64]), "same lane order in two dispatches"
    assert not torch.equal(orders[0][:64], orders[0][64:]), "same lane order before and after a barrier"
    assert orders[0][:64].tolist() != list(range(64))


def test_fixed_seed_reproduces_lane_order(lib):
    a, b = (torch.zeros(128, dtype=torch.int32) for _ in range(2))
    for order in (a, b):
        lib.lane_order(order, torch.zeros(2, dtype=torch.int32), threads=64, group_size=64, seed=1234)
    assert torch.equal(a, b)


def test_barrier_not_reached_by_all_lanes_raises(lib):
    out = torch.zeros(64)
    with pytest.raises(MslError, match="threadgroup_barrier not reached by every lane"):
        lib.partial_barrier(out, 10, threads=64, group_size=64)
    lib.partial_barrier(out, 64, threads=64, group_size=64)  # every lane reaches it: fine, and still usable
    assert out.sum().item() == 64


def test_divergent_collective_is_a_deadlock(lib):
    with pytest.raises(MslError, match="deadlock"):
        lib.divergent_simd(torch.zeros(64), threads=64, group_size=64)


@pytest.mark.parametrize("n,group", [(64, 64), (96, 48), (50, 64)])
def test_simd_functions(target, n, group):
    lib, dev = target
    x = torch.randint(-8, 8, (n,)).float()
    outs = [torch.full((n,), float("nan"), device=dev) for _ in range(5)]
    lib.simd_ops(*outs, x.to(dev), threads=n, group_size=group)
    sums, prefix, xor1, bcast, maxes = (o.cpu() for o in outs)
    for start in range(0, n, group):
        g = x[start:start + group]
        for s0 in range(0, g.numel(), 32):  # SIMD-groups: 32 consecutive lanes of a threadgroup
            sl = slice(start + s0, start + min(s0 + 32, g.numel()))
            v = x[sl]
            assert torch.all(sums[sl] == v.sum())
            assert torch.all(maxes[sl] == v.max())
            assert torch.equal(prefix[sl], torch.cumsum(v, 0) - v)
            assert torch.all(bcast[sl] == (v[3] if v.numel() > 3 else v))
            for lane in range(v.numel()):
                partner = lane ^ 1
                assert xor1[sl][lane] == (v[partner] if partner < v.numel() else v[lane])


def test_atomics_from_many_groups(target):
    lib, dev = target
    n = 50_000
    count = torch.zeros(1, dtype=torch.int32, device=dev)
    total = torch.zeros(1, device=dev)
    lib.atomics(count, total, torch.ones(n, device=dev), threads=n, group_size=128)
    assert count.item() == n
    assert total.item() == n  # exact: integers below 2**24


def test_partial_grid_2d(target):
    lib, dev = target
    width, height, group = 70, 5, (32, 4)
    info = torch.zeros(width * height * 6, dtype=torch.int32, device=dev)
    visits = torch.zeros(width * height, dtype=torch.int32, device=dev)
    lib.ids_2d(info, visits, width, threads=(width, height), group_size=group)
    assert torch.all(visits.cpu() == 1), "every thread of a non-multiple grid runs exactly once"
    info = info.cpu().view(height, width, 6)
    assert info[0, 0].tolist() == [32, 4, 32, 4, 0, 0]
    assert info[4, 69].tolist() == [70 - 64, 5 - 4, 32, 4, 2, 1], "edge groups are partial, as with dispatchThreads"


def test_scalar_binding_int64_int32_float_lists(target):
    lib, dev = target
    out = torch.zeros(5, dtype=torch.int64, device=dev)
    big = 2**40 + 5
    lib.scalars(out, big, 7, 2.5, [1, 2, big], [3, 4], threads=1, arg_casts={2: "int32", 5: "int32"})
    assert out.tolist() == [big, 7, 10, 3 + big, 7]
    out.zero_()
    lib.scalars(out, -3, -9, 0.25, [0, 0, -1], [-5, 1], threads=1, arg_casts={2: "int32", 5: "int32"})
    assert out.tolist() == [-3, -9, 1, -1, -4]


def test_templates_and_default_threads(target):
    lib, dev = target
    out = torch.zeros(37, device=dev)
    lib.fill_float(out, 1.5)  # threads defaults to the first tensor's numel
    assert torch.all(out == 1.5)
    out_i = torch.zeros(5, dtype=torch.int32, device=dev)
    lib.fill_int(out_i, 3, arg_casts={1: "int32"})
    assert out_i.tolist() == [3] * 5


def test_multi_dimensional_grid_default_group(target):
    lib, dev = target
    width, height = 45, 3
    info = torch.zeros(width * height * 6, dtype=torch.int32, device=dev)
    visits = torch.zeros(width * height, dtype=torch.int32, device=dev)
    lib.ids_2d(info, visits, width, threads=(width, height))
    assert torch.all(visits.cpu() == 1)


def test_tensor_offsets_bind_like_metal(target):
    lib, dev = target
    base = torch.zeros(10, device=dev)
    lib.fill_float(base[4:], 2.0, threads=3)  # storage + byte offset, no shape check
    assert base.tolist() == [0, 0, 0, 0, 2, 2, 2, 0, 0, 0]


@pytest.mark.parametrize("kwargs,match", [
    ({"threads": 0}, "empty grid"),
    ({"threads": 2048, "group_size": 2048}, "at most 1024"),
    ({"threads": (8, 8), "group_size": 8}, "rank"),
])
def test_bad_dispatch_raises(target, kwargs, match):
    lib, dev = target
    with pytest.raises(MslError, match=match):
        lib.fill_float(torch.zeros(8, device=dev), 1.0, **kwargs)


# ------------------------------------------------------------------------------ half, bfloat and IEEE float
HALF_TYPES = pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["half", "bfloat"])
MSL_TYPE = {torch.float16: "half", torch.bfloat16: "bfloat"}
ARG_CAST = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit-for-bit equal, except that a NaN matches any NaN (Metal leaves NaN payloads unspecified)."""
    got = got.cpu()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan), "NaN in one result and not in the other"
    as_int = {2: torch.int16, 4: torch.int32}[want.element_size()]
    bad = (got[~nan].view(as_int) != want[~nan].view(as_int)).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} values differ, e.g. {got[~nan][bad[:5]]} for {want[~nan][bad[:5]]}"


def conversion_inputs(dtype: torch.dtype, n: int = 4096) -> torch.Tensor:
    """float32 values (fresh ones each run) that exercise every case of rounding to ``dtype``: random bit patterns
    (every exponent, subnormals, infinities, NaNs), exact ties halfway between neighbours of ``dtype`` (round to
    even decides them), ``dtype``'s subnormal range, and the edge of overflow (65520 is a tie that rounds to inf)."""
    random_bits = torch.randint(-2**31, 2**31, (n,), dtype=torch.int64).to(torch.int32).view(torch.float32)
    largest_finite = torch.finfo(dtype).max
    low_bits = torch.randint(0, int(torch.tensor(largest_finite, dtype=dtype).view(torch.int16)), (n,))
    lower = low_bits.to(torch.int16).view(dtype).float()
    upper = (low_bits + 1).to(torch.int16).view(dtype).float()
    ties = (lower + upper) / 2 * (torch.randint(0, 2, (n,)) * 2 - 1)  # exact in float32
    tiny = torch.finfo(dtype).tiny
    subnormal = (torch.rand(n) - 0.5) * 2 * tiny
    fp16_max, overflow_tie = 65504.0, 65520.0
    near_overflow = fp16_max + torch.rand(n) * 2 * (overflow_tie - fp16_max)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), -float("nan"), overflow_tie,
                             -overflow_tie, torch.finfo(torch.float32).max, tiny / 2, torch.finfo(torch.float32).tiny])
    return torch.cat([random_bits, ties, subnormal, near_overflow, -near_overflow, specials])


def test_float_math_is_ieee(target):
    """No fast math (torch.mps.compile_shader compiles without it): rounding is not reassociated away and a NaN
    is seen."""
    lib, dev = target
    a = torch.randn(1000) * 2.0**30
    b = torch.randn(1000)
    a[::7] = float("nan")
    diff, nan = torch.empty(1000, device=dev), torch.empty(1000, dtype=torch.int32, device=dev)
    lib.ieee_float(diff, nan, a.to(dev), b.to(dev))
    assert_same_bits(diff, (a + b) - a)
    assert torch.equal(nan.cpu().bool(), torch.isnan(a))
    finite = ~torch.isnan(a)
    assert not torch.equal(diff.cpu()[finite], b[finite]), "the inputs must tell IEEE math and fast math apart"


@HALF_TYPES
def test_conversions_round_to_nearest_even(target, dtype):
    """T(float) rounds as torch's own conversion does (to nearest, ties to even), and float(T) is exact."""
    lib, dev = target
    x = conversion_inputs(dtype)
    out = torch.empty(x.numel(), dtype=dtype, device=dev)
    back = torch.empty(x.numel(), device=dev)
    getattr(lib, f"convert_{MSL_TYPE[dtype]}")(out, back, x.to(dev))
    assert_same_bits(out, x.to(dtype))
    assert_same_bits(back, x.to(dtype).float())


@HALF_TYPES
def test_arithmetic_is_correctly_rounded(target, dtype):
    """``a + b``, ``a - b`` and ``a * b`` in T are the exact result rounded to T (IEEE 754, as Metal's)."""
    lib, dev = target
    n = 4096
    a, b = (torch.randint(-2**15, 2**15, (n,), dtype=torch.int16).view(dtype) for _ in range(2))  # any bits
    outs = [torch.empty(n, dtype=dtype, device=dev) for _ in range(3)]
    getattr(lib, f"arith_{MSL_TYPE[dtype]}")(*outs, a.to(dev), b.to(dev))
    for got, op in zip(outs, (torch.add, torch.sub, torch.mul)):
        assert_same_bits(got, op(a.float(), b.float()).to(dtype))  # float holds the exact result to round


@HALF_TYPES
def test_vec4_loads_and_stores(target, dtype):
    """``vec<T, 4>`` is 4 packed values (8 bytes): one load and one store per thread move 4 consecutive ones."""
    lib, dev = target
    n = 4 * 300
    x = (torch.randn(n) * 100).to(dtype)
    s = torch.randn(()).item()  # a float32 value, bound as one
    out = torch.full((n + 4,), float("nan"), dtype=dtype, device=dev)
    getattr(lib, f"scale4_{MSL_TYPE[dtype]}")(out, x.to(dev), s, threads=n // 4)
    assert_same_bits(out[:n], (x.float() * s).to(dtype))
    assert torch.isnan(out[n:].cpu()).all(), "wrote past the last vector"


@HALF_TYPES
def test_scalar_binding_half_bfloat(target, dtype):
    """``arg_casts`` binds a Python float as a half or a bfloat, rounded to nearest even."""
    lib, dev = target
    value = torch.randn(()).item()
    out = torch.zeros(7, dtype=dtype, device=dev)
    getattr(lib, f"fill_{MSL_TYPE[dtype]}")(out, value, arg_casts={1: ARG_CAST[dtype]})
    assert_same_bits(out, torch.full((7,), value).to(dtype))


def test_executed_kernels_are_recorded(lib):
    lib.fill_float(torch.zeros(4), 1.0)
    assert "fill_float" in EXECUTED


@pytest.mark.parametrize("source,match", [
    ("kernel void k(device double* o [[buffer(0)]], uint i [[thread_position_in_grid]]) { o[i] = 1; }",
     "double"),
    ("kernel void k(float* o [[buffer(0)]], uint i [[thread_position_in_grid]]) { o[i] = 1; }",
     "must be a `device` or `constant`"),
    (("kernel void k(device float* o [[buffer(0)]], uint i [[thread_position_in_grid]]) "
     "{ threadgroup float big[9000]; big[i] = 1; o[i] = big[0]; }"), "threadgroup memory"),
    ("#include <c10/metal/atomic.h>\nkernel void k(device float* o [[buffer(0)]]) {}", "c10/metal"),
])
def test_rejected_sources(source, match):
    with pytest.raises(MslError, match=match):
        compile_shader(source)
