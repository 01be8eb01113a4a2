"""The executor's traffic model (tsm_dev/msl/traffic.py): hand-written kernels whose coalescing, atomics and
threadgroup memory are known, counted by hand; then the shipped kernels at one small size, where the bytes a
kernel must write are known from its outputs."""

from __future__ import annotations

import json

import pytest
import torch

from torch_sparse_metal import CSRTopology
from torch_sparse_metal.backends.mps import MetalCsrLinear
from torch_sparse_metal_tools import selfcheck
from tsm_dev import selfcheck as dev_selfcheck
from tsm_dev import traffic_model
from tsm_dev.msl import compile_shader
from tsm_dev.msl.traffic import occupancy, record

SOURCE = r"""
#include <metal_stdlib>
using namespace metal;

kernel void strided(device float* out [[buffer(0)]], device const float* in [[buffer(1)]],
                    constant long& stride [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  out[i] = in[ulong(i) * ulong(stride)];
}

kernel void vector4(device float* out [[buffer(0)]], device const float4* in [[buffer(1)]],
                    uint i [[thread_position_in_grid]]) {
  const float4 v = in[i];
  out[i] = v.x + v.y + v.z + v.w;
}

kernel void atomics(device atomic_float* sum [[buffer(0)]], device atomic_uint* count [[buffer(1)]],
                    constant long& spread [[buffer(2)]], uint i [[thread_position_in_grid]]) {
  atomic_fetch_add_explicit(&sum[i % uint(spread)], 1.0f, memory_order_relaxed);
  atomic_fetch_add_explicit(&count[0], 1u, memory_order_relaxed);
}

kernel void reverse(device float* out [[buffer(0)]], device const float* in [[buffer(1)]],
                    constant long& step [[buffer(2)]],
                    uint i [[thread_position_in_grid]], uint lid [[thread_index_in_threadgroup]],
                    uint n [[threads_per_threadgroup]]) {
  threadgroup float t[64 * 2];
  t[lid * uint(step)] = in[i];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = t[(n - 1 - lid) * uint(step)];
}

kernel void big_tile(device float* out [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  threadgroup float t[4096];
  t[i] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[i] = t[i];
}
"""


@pytest.fixture(scope="module")
def lib():
    return compile_shader(SOURCE)


@pytest.mark.parametrize("stride,segments", [
    (1, (4, 2, 1)),      # 32 floats = 128 contiguous bytes
    (8, (32, 16, 8)),    # 32-byte stride: a sector per lane, two lanes per 64 bytes, four per 128
    (32, (32, 32, 32)),  # 128-byte stride: every lane its own segment of any size
    (0, (1, 1, 1)),      # every lane the same address: a broadcast
])
def test_load_segments(lib, stride, segments):
    src = torch.arange(32 * 32, dtype=torch.float32)
    out = torch.zeros(32)
    t = lib.strided(out, src, stride, threads=32, group_size=32, traffic=True)
    ld = t.device["load"]
    assert (ld.instructions, ld.lanes, ld.bytes) == (1, 32, 128)
    assert (ld.seg32, ld.seg64, ld.seg128) == segments
    st = t.device["store"]
    assert (st.instructions, st.seg32, st.seg64, st.seg128) == (1, 4, 2, 1)
    assert t.buffers[0].footprint_bytes == 128 and t.buffers[1].footprint_bytes == 32 * segments[0]
    assert t.constant.instructions == 1 and t.buffers[2].scalar  # the `constant long&`: no device traffic


def test_two_simdgroups_are_two_instructions(lib):
    t = lib.strided(torch.zeros(64), torch.zeros(64), 1, threads=64, group_size=64, traffic=True)
    assert (t.device["load"].instructions, t.device["load"].seg32, t.simdgroups, t.groups) == (2, 8, 2, 1)


def test_view_offset_shifts_segments(lib):
    """Segments count from the storage's start, as on a GPU buffer: a view 4 bytes in straddles one more."""
    base = torch.zeros(40)
    t = lib.strided(torch.zeros(32), base[1:33], 1, threads=32, group_size=32, traffic=True)
    assert (t.device["load"].seg32, t.device["load"].seg128) == (5, 2)


def test_vector_load_is_one_instruction(lib):
    t = lib.vector4(torch.zeros(32), torch.zeros(32 * 4), threads=32, group_size=32, traffic=True)
    ld = t.device["load"]
    assert (ld.instructions, ld.lanes, ld.bytes, ld.seg32, ld.seg128) == (1, 32, 512, 16, 4)


def test_atomics_to_one_address(lib):
    """32 lanes add to one float: one instruction, all 32 lanes share their address; the uint counter too."""
    s, c = torch.zeros(1), torch.zeros(1, dtype=torch.int32)
    t = lib.atomics(s, c, 1, threads=32, group_size=32, traffic=True)
    at = t.device["atomic"]
    assert (at.instructions, at.lanes, at.seg32) == (2, 64, 2)
    assert (t.atomic_simd_same, t.atomic_group_same, t.atomic_addresses, t.atomic_shared_addresses) == (64, 0, 2, 0)
    assert s.item() == 32 and c.item() == 32


def test_atomics_across_simdgroups_and_threadgroups(lib):
    """16 addresses, each hit by two lanes of each of 2 SIMD-groups, in 2 threadgroups of 64."""
    s, c = torch.zeros(16), torch.zeros(1, dtype=torch.int32)
    t = lib.atomics(s, c, 16, threads=128, group_size=64, traffic=True)
    assert t.device["atomic"].lanes == 256 and t.device["atomic"].instructions == 8
    assert t.atomic_simd_same == 256                 # every lane shares its address within its SIMD-group
    assert t.atomic_group_same == 256                # ... and with the other SIMD-group of its threadgroup
    assert t.atomic_addresses == 2 * 17 and t.atomic_shared_addresses == 17  # both threadgroups hit all 17
    assert s.tolist() == [8.0] * 16


def test_no_contention(lib):
    t = lib.atomics(torch.zeros(32), torch.zeros(1, dtype=torch.int32), 32, threads=32, group_size=32,
                    traffic=True)
    assert t.atomic_simd_same == 32  # only the counter's 32 lanes; the 32 floats each have one
    assert t.buffers[0].sectors["atomic"] == 4


@pytest.mark.parametrize("step,wavefronts", [(1, 1), (2, 2)])
def test_threadgroup_memory(lib, step, wavefronts):
    """64 threads store and load a threadgroup array: 2 instructions each; a stride of 2 words puts two lanes in
    each bank used (2 wavefronts); one barrier; 512 bytes of threadgroup memory."""
    t = lib.reverse(torch.zeros(64), torch.zeros(64), step, threads=64, group_size=64, traffic=True)
    tg = t.threadgroup
    assert (tg["store"].instructions, tg["load"].instructions, tg["store"].bytes) == (2, 2, 256)
    assert tg["store"].wavefronts == tg["load"].wavefronts == 2 * wavefronts
    assert (t.barriers, t.max_barriers, t.threadgroup_memory) == (1, 1, 512)
    assert t.device["load"].instructions == 2  # threadgroup accesses are not device traffic
    assert t.occupancy() == {"groups": 16, "simdgroups": 32, "limited_by": "threads", "groups_by_memory": 64,
                             "groups_by_threads": 16}


def test_occupancy_by_threadgroup_memory(lib):
    t = lib.big_tile(torch.zeros(64), threads=64, group_size=32, traffic=True)
    assert t.threadgroup_memory == 16384 and t.barriers == 2 and t.max_barriers == 1
    assert occupancy(32, 16384)["groups"] == 2 and t.occupancy()["limited_by"] == "threadgroup memory"


def test_off_by_default_and_record(lib):
    assert lib.strided(torch.zeros(32), torch.zeros(32), 1, threads=32, group_size=32) is None
    with record() as dispatches:
        lib.strided(torch.zeros(32), torch.zeros(32), 1, threads=32, group_size=32)
        lib.vector4(torch.zeros(32), torch.zeros(128), threads=32, group_size=32)
    assert [d.kernel for d in dispatches] == ["strided", "vector4"]
    assert lib.strided(torch.zeros(32), torch.zeros(32), 1, threads=32, group_size=32) is None


# ------------------------------------------------------------------------------------- shipped kernels
@pytest.mark.parametrize("p", [1, 4])
def test_shipped_kernels(p):
    """A 70 -> 50 layer, batch 33: every output element is written once (bytes stored = its size); fused_atomic
    adds once per edge and batch chunk (P = 1: two chunks of 32, from two threadgroups), atomic_free never."""
    g = torch.Generator().manual_seed(0)
    topo = CSRTopology.random(70, 50, 0.2, generator=g)
    x, go, w = torch.randn(33, 70, generator=g), torch.randn(33, 50, generator=g), torch.randn(topo.nnz, generator=g)
    metal = MetalCsrLinear(compile_shader, device_type="cpu", values_per_lane=p)
    chunks = 2 if p == 1 else 1
    with record() as fwd:
        metal.forward(x, w, *topo.kernel_args())
    spmm = next(d for d in fwd if d.kernel.startswith("spmm"))
    assert spmm.kernel == f"spmm_float_p{p}"
    assert spmm.buffers[0].bytes["store"] == 33 * 50 * 4 and spmm.buffers[0].footprint_bytes >= 33 * 50 * 4
    assert spmm.device["atomic"].lanes == 0 and spmm.max_barriers == 1
    with record() as fused:
        metal.backward(go, x, w, *topo.kernel_args(), "fused_atomic")
    k = next(d for d in fused if d.kernel.startswith("spmm_sddmm_atomic"))
    assert k.buffers[0].bytes["store"] == 33 * 70 * 4
    assert k.device["atomic"].lanes == chunks * topo.nnz and k.buffers[1].bytes["atomic"] == chunks * topo.nnz * 4
    assert k.atomic_simd_same == 0 and k.atomic_group_same == 0
    assert k.atomic_shared_addresses == (topo.nnz if chunks == 2 else 0)
    assert k.max_barriers == 3  # load_block's two, store_block's one
    with record() as free:
        metal.backward(go, x, w, *topo.kernel_args(), "atomic_free")
    assert [d.kernel for d in free][-2:] == [f"sddmm_float_p{p}", f"spmm_float_p{p}"]
    assert all(d.device["atomic"].lanes == 0 for d in free)
    assert free[-2].buffers[0].bytes["store"] == topo.nnz * 4 and free[-1].buffers[0].bytes["store"] == 33 * 70 * 4


def test_selfcheck_model_tables(tmp_path, capsys):
    path = tmp_path / "model.json"
    assert selfcheck.traffic_model([150], path, features=40, batch=33, executor=dev_selfcheck.executor()) == 0
    out = capsys.readouterr().out
    assert "spmm_sddmm_atomic_half_p4" in out and "sddmm_float_p1" in out and "fewest: P=" in out
    report = json.loads(path.read_text())
    assert report["verdict"] == "MODELLED"
    assert {(r["dtype"], r["p"]) for r in report["model"]} == {("float32", 1), ("float32", 4), ("float16", 1),
                                                              ("float16", 4)}


def test_selfcheck_model_flag(monkeypatch):
    seen = {}
    monkeypatch.setattr(selfcheck, "traffic_model",
                        lambda edges, path, executor: seen.update(edges=edges, executor=executor) or 0)
    assert dev_selfcheck.main(["--model", "--model-edges", "100", "200"]) == 0 and seen["edges"] == [100, 200]
    assert seen["executor"].model_rows is traffic_model.model_rows


# ------------------------------------------------------------------------ the row-window SpMM against the direct one
def _stage(stages, op, stage, p):
    return next(s for s in stages if s["op"] == op and s["stage"] == stage and s["p"] == p)


def test_window_moves_fewer_device_bytes_and_its_panels_show_in_threadgroup_memory():
    """300 features, 20% dense, batch 40: a window of 128 rows (P = 1) or 64 (P = 4) puts 25.6 or 12.8 edges on a
    staged value, so the SpMM's device bytes fall several times; the staged panels and the per-edge reads move to
    threadgroup memory. The SpMM writes the same output bytes either way; the stages without the SpMM are equal."""
    rows = traffic_model.model_rows([18_000], [torch.float32], [1, 4], features=300, batch=40,
                                    ops=["forward", "atomic_free"])
    stages = traffic_model.stage_rows(rows)
    for p in (1, 4):
        spmm = _stage(stages, "forward", "spmm", p)
        assert spmm["direct_moved_bytes"] > 3 * spmm["window_moved_bytes"], spmm
        assert spmm["window_tg_bytes"] > 4 * spmm["direct_tg_bytes"], spmm
        for op, stage in (("forward", "forward_operands"), ("atomic_free", "atomic_free_operands"),
                          ("atomic_free", "sddmm")):
            s = _stage(stages, op, stage, p)
            assert s["direct_moved_bytes"] == s["window_moved_bytes"] and s["direct_tg_bytes"] == s["window_tg_bytes"]
    kernels = {(r["spmm"], r["kernel"]) for r in rows if r["kernel"].startswith("spmm")}
    assert kernels == {("direct", "spmm_float_p1"), ("direct", "spmm_float_p4"), ("window", "spmm_window_float_p1"),
                       ("window", "spmm_window_float_p4")}
    out = traffic_model.format_stages(stages)
    assert out[0].startswith("| case |") and any("| forward | spmm |" in line for line in out)
    summary = traffic_model.format_summary(rows)
    assert len(summary) == 2 + 2 and all(line.count("|") == 8 for line in summary)  # a line per P


@pytest.mark.parametrize("p", [1, 4])
def test_scaled_counts_equal_a_measured_larger_batch(p):
    """The extrapolation behind the 4096² table: every kernel repeats its accesses per batch chunk except for its
    per-edge buffers (the weight gather and the zero fill of the operands kernels, sddmm's index arrays and output),
    so counts at batch 128 scaled to 384 equal the counts measured at 384, and so do the footprints; a batch that
    is not whole chunks is refused."""
    small = traffic_model.model_rows([900], [torch.float16], [p], features=96, batch=128)
    large = traffic_model.model_rows([900], [torch.float16], [p], features=96, batch=384)
    keys = ("moved_bytes", "tg_bytes", "ld_instr", "st_instr", "atomic_instr", "tg_wavefronts", "footprint")
    got = [{k: r[k] for k in keys} for r in traffic_model.scaled(small, 384)]
    assert got == [{k: r[k] for k in keys} for r in large]
    with pytest.raises(ValueError, match="multiples of 128"):
        traffic_model.scaled(small, 200)
