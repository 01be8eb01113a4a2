"""CSRTopology: constructors agree with each other, derived indices are right, bad input names the problem."""

import pytest
import torch

from torch_sparse_metal import CSRTopology
from torch_sparse_metal.contract import INT32_MAX


def _dense_mask(topo: CSRTopology) -> torch.Tensor:
    mask = torch.zeros(topo.out_features, topo.in_features, dtype=torch.bool)
    mask[topo.dst.long(), topo.src.long()] = True
    return mask


@pytest.mark.parametrize("shape", [(13, 7), (1, 1), (40, 3), (5, 64)])
@pytest.mark.parametrize("density", [0.0, 0.05, 0.3, 1.0])
def test_random_has_exact_count_and_valid_structure(shape, density):
    in_f, out_f = shape
    topo = CSRTopology.random(in_f, out_f, density, generator=torch.Generator().manual_seed(1))
    assert topo.nnz == round(density * in_f * out_f)
    # CSR invariants: sorted by (src, dst), unique, row_ptr consistent.
    key = topo.src.long() * out_f + topo.dst.long()
    assert torch.all(key[1:] > key[:-1])
    assert torch.equal(torch.bincount(topo.src.long(), minlength=in_f), (topo.row_ptr[1:] - topo.row_ptr[:-1]).long())
    # By-destination view lists the same edges grouped by output.
    perm = topo.perm.long()
    assert torch.equal(topo.dst.long()[perm], torch.repeat_interleave(torch.arange(out_f),
                                                                      (topo.col_ptr[1:] - topo.col_ptr[:-1]).long()))
    assert torch.equal(topo.src_by_dst, topo.src[perm])
    assert all(t.dtype == torch.int32 for t in topo.kernel_args())


def test_random_is_seedable_and_varies():
    a = CSRTopology.random(50, 40, 0.1, generator=torch.Generator().manual_seed(3))
    b = CSRTopology.random(50, 40, 0.1, generator=torch.Generator().manual_seed(3))
    c = CSRTopology.random(50, 40, 0.1, generator=torch.Generator().manual_seed(4))
    assert a.same_as(b) and not a.same_as(c)


def test_random_is_roughly_uniform():
    topo = CSRTopology.random(200, 100, 0.2, generator=torch.Generator().manual_seed(0))
    per_source = (topo.row_ptr[1:] - topo.row_ptr[:-1]).double()
    assert abs(per_source.mean().item() - 20) < 1e-9 and per_source.std().item() < 8


def test_constructors_agree():
    g = torch.Generator().manual_seed(2)
    mask = torch.rand(9, 14, generator=g) < 0.3
    from_mask = CSRTopology.from_mask(mask)
    out_idx, in_idx = mask.nonzero().t()
    shuffle = torch.randperm(out_idx.numel(), generator=g)
    from_edges = CSRTopology.from_edges(in_idx[shuffle], out_idx[shuffle], 14, 9)
    from_csr = CSRTopology.from_csr(from_mask.row_ptr, from_mask.dst, 14, 9)
    assert from_mask.same_as(from_edges) and from_mask.same_as(from_csr)
    assert torch.equal(_dense_mask(from_mask), mask)
    assert torch.equal(from_mask.indices(), torch.stack([from_mask.dst.long(), from_mask.src.long()]))


@pytest.mark.parametrize(
    "src, dst, message",
    [
        ([0, 1, 1], [0, 2, 2], "duplicate edge"),
        ([0, 5], [0, 1], "src index 5 is out of range"),
        ([0, 1], [0, -1], "dst index -1 is out of range"),
        ([0, 1], [0], "same length"),
    ],
)
def test_from_edges_rejects(src, dst, message):
    with pytest.raises(ValueError, match=message):
        CSRTopology.from_edges(torch.tensor(src), torch.tensor(dst), in_features=4, out_features=3)


def test_from_edges_unsorted_without_sort_is_rejected():
    with pytest.raises(ValueError, match="not sorted"):
        CSRTopology.from_edges(torch.tensor([1, 0]), torch.tensor([0, 0]), 2, 2, sort=False)


@pytest.mark.parametrize(
    "row_ptr, dst, message",
    [
        ([0, 1, 3], [0, 1], "ends at 3 but there are 2 edges"),
        ([1, 1, 2], [0, 1], "start at 0"),
        ([0, 2, 1, 2], [0, 1], "in_features \\+ 1"),
        ([0, 2, 2], [1, 0], "not sorted"),
        ([0, 1, 2], [0, 7], "out of range"),
    ],
)
def test_from_csr_rejects_malformed(row_ptr, dst, message):
    with pytest.raises(ValueError, match=message):
        CSRTopology.from_csr(torch.tensor(row_ptr), torch.tensor(dst), in_features=2, out_features=3)


def test_type_and_range_errors():
    with pytest.raises(TypeError, match="integers"):
        CSRTopology.from_edges(torch.tensor([0.0]), torch.tensor([0]), 1, 1)
    with pytest.raises(TypeError, match="bool"):
        CSRTopology.from_mask(torch.ones(2, 2))
    with pytest.raises(ValueError, match="density must be in \\[0, 1\\]"):
        CSRTopology.random(3, 3, 1.5)
    with pytest.raises(ValueError, match="in_features must be >= 0"):
        CSRTopology.random(-1, 3, 0.5)
    with pytest.raises(ValueError, match="int32"):
        CSRTopology.random(INT32_MAX, 1, 0.0)
    with pytest.raises(ValueError, match="int32 index limit"):
        CSRTopology.random(2**20, 2**12, 0.6)  # 2.5e9 edges: refused before anything is allocated


def test_a_partial_vector_is_named_as_such():
    """eye(16) with block 8: input 0's vector over outputs 0-7 holds output 0 only (it does not connect to 0-7)."""
    with pytest.raises(ValueError) as info:
        CSRTopology.from_mask(torch.eye(16, dtype=torch.bool), block=8)
    message = str(info.value)
    assert "input 0 connects to outputs [0] of its vector over outputs 0-7, which is only partially present" in message
    assert "15 more vectors are partial" in message and "CSRTopology.covering(mask, 8)" in message


@pytest.mark.parametrize("block", [8, 16])
def test_the_first_partial_vector_of_a_random_mask_is_named_exactly(block):
    g = torch.Generator().manual_seed(int(torch.randint(1 << 30, (1,))))
    out_f, in_f = 3 * block, 7
    whole = CSRTopology.covering(torch.rand(out_f, in_f, generator=g) < 0.15, block)
    whole[:block, 0] = True  # at least one vector
    mask = whole.clone()
    holes = torch.nonzero(whole.t())[torch.randperm(int(whole.sum()), generator=g)[:2]]  # (input, output) pairs
    mask[holes[:, 1], holes[:, 0]] = False
    # the first partial vector in (input, group) order, from the mask itself
    partial = [(i, o // block) for i, o in sorted(holes.tolist())]
    i, group = min(partial)
    present = [o for o in range(group * block, (group + 1) * block) if mask[o, i]]
    with pytest.raises(ValueError) as info:
        CSRTopology.from_mask(mask, block=block)
    assert (f"input {i} connects to outputs {present} of its vector over outputs {group * block}-"
            f"{group * block + block - 1}, which is only partially present") in str(info.value)
    assert CSRTopology.from_mask(CSRTopology.covering(mask, block), block=block).same_as(
        CSRTopology.from_mask(whole, block=block))  # the suggested covering restores the vectors
