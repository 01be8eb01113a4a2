"""The MSL-on-CPU executor itself: it must behave like Metal where our kernels depend on it, and fail loudly
where a kernel would be wrong on a GPU (missing barriers, divergent collectives).

The tests of behaviour that every target shares (barriers, SIMD-group functions, atomics, partial groups,
argument binding) also run against the CUDA translation (``tsm_dev.msl.cuda``) where an NVIDIA GPU and nvcc
exist; on every machine with nvcc the translation of these kernels must compile."""

from __future__ import annotations

import struct

import pytest
import torch

from torch_sparse_metal.backends import mps
from tsm_dev.msl import EXECUTED, MslCompileError, MslError, compile_shader
from tsm_dev.msl import cuda as cuda_translation
from tsm_dev.msl.bindings import SCALAR_CASTS, scalar_bytes
from tsm_dev.msl.executor import OVERSIZED_GROUP_ERROR
from tsm_dev.msl.source import METAL_LANGUAGE_VERSIONS

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

// The group size a dispatch asked for and the size of the first group, written by the grid's first thread.
kernel void group_of(device uint* out [[buffer(0)]], uint3 pos [[thread_position_in_grid]],
                     uint3 requested [[dispatch_threads_per_threadgroup]], uint3 size [[threads_per_threadgroup]]) {
  if (pos.x == 0 && pos.y == 0 && pos.z == 0) {
    out[0] = requested.x; out[1] = requested.y; out[2] = requested.z;
    out[3] = size.x; out[4] = size.y; out[5] = size.z;
  }
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


def test_tensor_offsets_bind_like_metal(target):
    lib, dev = target
    base = torch.zeros(10, device=dev)
    lib.fill_float(base[4:], 2.0, threads=3)  # storage + byte offset, no shape check
    assert base.tolist() == [0, 0, 0, 0, 2, 2, 2, 0, 0, 0]


@pytest.mark.parametrize("kwargs,match", [
    ({"threads": 0}, "empty grid"),
    ({"threads": (8, 8), "group_size": (8, 0)}, "non-empty"),
    ({"threads": (8, 8), "group_size": 8}, "same number of dimensions"),
    ({"threads": (8, 8), "group_size": [8]}, "same number of dimensions"),
    ({"threads": [1, 1, 1, 1]}, "1 to 3"),
    ({"threads": []}, "1 to 3"),
    ({"threads": -1}, "non-negative"),
])
def test_bad_dispatch_raises(target, kwargs, match):
    """torch raises RuntimeError for each (TORCH_CHECKs of torch/csrc/mps/Module.cpp and
    MetalKernelFunction::dispatch); MslError is one. An empty grid or group is Metal's validation error, which
    the executor raises where a GPU would silently run nothing."""
    lib, dev = target
    with pytest.raises(MslError, match=match):
        lib.fill_float(torch.zeros(8, device=dev), 1.0, **kwargs)


# ---------------------------------------------------------------------------- as torch.mps.compile_shader
# Each test follows torch/csrc/mps/Module.cpp (the Python binding: argument kinds, casts, threads and
# group_size) or MetalKernelFunction / MetalShaderLibrary in aten/src/ATen/native/mps/OperationUtils.mm
# (defaults, limits, errors), as of torch 2.13-2.15.


def test_missing_kernel_raises_torchs_runtime_error(target):
    """MetalShaderLibrary::getLibraryPipelineState: TORCH_CHECK(func, "Failed to create function state object
    for: ", fname), a RuntimeError from the library's __getattr__, so getattr with a default and hasattr do not
    swallow it (the host code must catch it: test_metal_backend.py)."""
    lib, _ = target
    with pytest.raises(RuntimeError, match="^Failed to create function state object for: no_such_kernel$"):
        lib.no_such_kernel  # noqa: B018
    with pytest.raises(RuntimeError, match="Failed to create function state object"):
        getattr(lib, "no_such_kernel", None)
    with pytest.raises(RuntimeError, match="Failed to create function state object"):
        hasattr(lib, "no_such_kernel")
    assert not hasattr(lib, "__deepcopy__")  # Python's protocol lookups still see AttributeError


def test_compile_failure_is_a_syntax_error():
    """MetalShaderLibrary::compileLibrary throws c10::SyntaxError (Python's SyntaxError) for a compile failure."""
    bad = "kernel void k(device float* o [[buffer(0)]], uint i [[thread_position_in_grid]]) { o[i] = nope; }"
    with pytest.raises(SyntaxError, match="nope"):
        compile_shader(bad, "bad.metal")
    with pytest.raises(MslCompileError):
        compile_shader("kernel void k(device float* o [[buffer(0)]], uint i [[thread_position_in_grid]]) {",
                       "unbalanced.metal")


def test_bool_binds_as_int64(target):
    """Module.cpp binds any py::int_ as int64_t, and a Python bool is one: 8 bytes, not 1 (a ``constant bool&``
    parameter would read the first byte of them)."""
    lib, dev = target
    out = torch.zeros(5, dtype=torch.int64, device=dev)
    lib.scalars(out, True, False, 0.25, [True, 2, 3], [False, 1], threads=1, arg_casts={2: "int32", 5: "int32"})
    assert out.tolist() == [1, 0, 1, 6, 1]
    assert scalar_bytes(0, True, None) == (1).to_bytes(8, "little")


def test_lists_bind_by_their_first_element(target):
    """OptionalArgCaster::setValue: an empty list or tuple raises; the first element decides: a list of ints is
    cast to std::vector<int64_t> (a float in it fails pybind's cast), a list of floats to std::vector<float> (ints
    in it convert); arg_casts then converts every element (a float to int32 truncates toward zero)."""
    lib, dev = target
    out = torch.zeros(5, dtype=torch.int64, device=dev)
    lib.scalars(out, 1, 2, 0.5, (1, 2, 3), [2.9, 1], threads=1, arg_casts={2: "int32", 5: "int32"})
    assert out.tolist() == [1, 2, 2, 6, 3]
    for bad, match in (([], "Empty list/tuple"), ((), "Empty list/tuple"), ([1, 2.5, 3], "list of ints"),
                       (["a"], "Unexpected argument types")):
        with pytest.raises(RuntimeError, match=match):
            lib.scalars(out, 1, 2, 0.5, bad, [3, 4], threads=1, arg_casts={2: "int32", 5: "int32"})
    assert scalar_bytes(0, [2.5, 1], None) == torch.tensor([2.5, 1.0]).numpy().tobytes()
    with pytest.raises(RuntimeError, match="Unsupported argument type"):
        scalar_bytes(0, None, None)


def test_arg_casts_names_and_forms(target):
    """Module.cpp accepts exactly fp16, bf16, int32, int16, int8 and uint8 ("Unsupported cast instruction"
    otherwise), given as {index: name} or as one name for every scalar argument; tensors ignore casts."""
    lib, dev = target
    assert set(SCALAR_CASTS) == {"fp16", "bf16", "int32", "int16", "int8", "uint8"}
    out_i = torch.zeros(5, dtype=torch.int32, device=dev)
    lib.fill_int(out_i, -7, arg_casts="int32")
    assert out_i.tolist() == [-7] * 5
    for name in ("int64", "float32", "float", "half", "bfloat16", "bool"):
        with pytest.raises(RuntimeError, match="Unsupported cast instruction"):
            lib.fill_int(out_i, 3, arg_casts={1: name})
    with pytest.raises(RuntimeError, match="Unexpected caster arg type"):
        lib.fill_int(out_i, 3, arg_casts=[(1, "int32")])
    as_bytes = {cast: scalar_bytes(0, 100, cast) for cast in SCALAR_CASTS}
    assert as_bytes == {"fp16": torch.tensor([100.0]).half().view(torch.int16).numpy().tobytes(),
                        "bf16": torch.tensor([100.0]).bfloat16().view(torch.int16).numpy().tobytes(),
                        "int32": (100).to_bytes(4, "little"), "int16": (100).to_bytes(2, "little"),
                        "int8": bytes([100]), "uint8": bytes([100])}


def test_fp16_cast_rounds_through_float32():
    """setValue casts a Python float to float first (``arg.cast<float>()``), then static_casts it: a double
    halfway between two halves after rounding to float32 rounds like the float32 value, not like the double."""
    x = 1.0 + 2.0**-11 + 2.0**-30  # float32: exactly 1 + 2**-11, a tie that rounds to even (1.0)
    assert struct.unpack("<e", struct.pack("<e", x))[0] > 1.0  # rounded once from the double: up
    assert scalar_bytes(0, x, "fp16") == struct.pack("<e", 1.0)


@pytest.mark.parametrize("kwargs", [{"threads": 300, "group_size": [100]}, {"threads": (300,), "group_size": 100},
                                    {"threads": [300], "group_size": (100,)}])
def test_one_dimensional_threads_and_group_in_any_form(target, kwargs):
    """optional_vec_from_pyobject makes an int a vector of one, so threads=n with group_size=[g] (or the other
    way round) is a 1-D dispatch; only the lengths must agree."""
    lib, dev = target
    x = torch.randn(300)
    out = torch.full((3,), float("nan"), device=dev)
    lib.reduce_with_barrier(out, x.to(dev), **kwargs)
    torch.testing.assert_close(out.cpu(), x.view(3, 100).sum(1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [45, 2000, [45], (45, 3), (2000, 2), (5, 2, 3)])
def test_default_group_size(target, threads):
    """MetalKernelFunction::dispatch: a 1-D grid's group is min(length, maxTotalThreadsPerThreadgroup); a 2-D or
    3-D grid's is (maxTotalThreadsPerThreadgroup, 1, 1), wider than the grid where it is narrow."""
    lib, dev = target
    grid = (threads,) if isinstance(threads, int) else tuple(threads)
    out = torch.zeros(6, dtype=torch.int32, device=dev)
    lib.group_of(out, threads=threads)
    limit = lib.group_of.max_threads_per_threadgroup
    width = min(grid[0], limit) if len(grid) == 1 else limit
    assert out.tolist() == [width, 1, 1, min(width, grid[0]), 1, 1]


def test_oversized_group_error_follows_torch():
    """MetalKernelFunction::dispatch checks the group against the pipeline's maxTotalThreadsPerThreadgroup with
    TORCH_CHECK_VALUE from torch 2.13 on (ValueError), with TORCH_CHECK before (RuntimeError)."""
    release = tuple(int(p) for p in torch.__version__.split(".")[:2])
    assert OVERSIZED_GROUP_ERROR is (ValueError if release >= (2, 13) else MslError)
    lib = compile_shader(SOURCE, "executor_test.metal")
    for kwargs in ({"threads": 2048, "group_size": 2048}, {"threads": (64, 64), "group_size": (64, 32)}):
        with pytest.raises(OVERSIZED_GROUP_ERROR, match="Threadgroup size exceeds 1024 limit") as info:
            lib.fill_float(torch.zeros(8), 1.0, **kwargs)
        assert isinstance(info.value, RuntimeError) == (release < (2, 13))


def test_pipelines_report_their_own_thread_limit():
    """getMaxThreadsPerThreadgroup is the pipeline's maxTotalThreadsPerThreadgroup, which a GPU may set below 1024
    (register use): the executor's pipelines report the limit they are given, default to it and refuse more."""
    lib = compile_shader(SOURCE, "executor_test.metal", max_threads_per_threadgroup=96)
    fn = lib.fill_float
    assert fn.max_threads_per_threadgroup == 96
    assert compile_shader(SOURCE, "executor_test.metal").fill_float.max_threads_per_threadgroup == 1024
    out = torch.zeros(200)
    fn(out, 2.0)  # default group: min(200, 96)
    assert torch.all(out == 2.0)
    with pytest.raises(OVERSIZED_GROUP_ERROR, match="exceeds 96 limit"):
        fn(out, 1.0, threads=200, group_size=128)


@pytest.mark.parametrize("metal_version", METAL_LANGUAGE_VERSIONS)
def test_each_metal_version_compiles_and_runs(metal_version):
    """The test kernels at every ``__METAL_VERSION__`` the supported torch releases compile at on a supported
    macOS (source.METAL_LANGUAGE_RULES); each instantiates bfloat (Metal 3.1)."""
    lib = compile_shader(SOURCE, "executor_test.metal", metal_version=metal_version)
    for dtype, name in ((torch.float32, "float"), (torch.float16, "half"), (torch.bfloat16, "bfloat")):
        out = torch.zeros(9, dtype=dtype)
        getattr(lib, f"fill_{name}")(out, 1.5, arg_casts={1: {"half": "fp16", "bfloat": "bf16"}[name]}
                                     if name != "float" else None)
        assert torch.all(out == 1.5)


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
