import pytest
import torch
from hypothesis import given, settings
from helpers import parent_batches, parent_rows

from specla_compile.tree import ancestor_mask_device
from specla_compile.runtime.topology import (
    PAD,
    ROOT,
    ancestor_mask,
    bucket_size,
    chain_decomposition,
    depth,
    num_real_nodes,
    pad_parents,
    parents_from_tree_mask,
    path_to,
    validate_parents,
)


def brute_ancestors(row: list[int], j: int) -> set[int]:
    out = set()
    while row[j] >= 0:
        j = row[j]
        out.add(j)
    return out


@pytest.mark.parametrize(
    "parents, message",
    [
        ([[-1, 0, 1]], None),
        ([[-1, 1]], "must be < j"),
        ([[-1, 0, 2]], "must be < j"),
        ([[0, 0]], "node 0"),
        ([[-1, -3]], "below -2"),
        ([[-1, PAD, 0]], "tail"),
        ([[PAD, PAD]], "node 0"),
    ],
)
def test_validate_values(parents, message):
    t = torch.tensor(parents)
    if message is None:
        assert validate_parents(t).dtype == torch.int64
    else:
        with pytest.raises(ValueError, match=message):
            validate_parents(t)


def test_validate_dtype_and_shape():
    with pytest.raises(ValueError, match="int32 or int64"):
        validate_parents(torch.tensor([[-1.0, 0.0]]))
    with pytest.raises(ValueError, match="shape"):
        validate_parents(torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="shape"):
        validate_parents(torch.zeros(2, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="torch.Tensor"):
        validate_parents([[-1, 0]])


@settings(max_examples=60, deadline=None)
@given(parent_batches())
def test_depth_masks_paths_match_brute_force(parents):
    validate_parents(parents)
    d, strict, incl = depth(parents), ancestor_mask(parents), ancestor_mask(parents, inclusive=True)
    for b, row in enumerate(parents.tolist()):
        for j, p in enumerate(row):
            anc = set() if p == PAD else brute_ancestors(row, j)
            assert set(strict[b, j].nonzero().flatten().tolist()) == anc
            assert set(incl[b, j].nonzero().flatten().tolist()) == anc | {j}
            assert d[b, j] == len(anc)
            if p != PAD:
                path = path_to(parents[b], j)
                assert path[-1] == j and set(path[:-1]) == anc and path == sorted(path)
                assert row[path[0]] == ROOT


@settings(max_examples=60, deadline=None)
@given(parent_batches())
def test_tree_mask_roundtrip(parents):
    # EAGLE-style masks: padding nodes see only themselves, i.e. they are roots
    as_roots = torch.where(parents == PAD, ROOT, parents)
    mask = ancestor_mask(as_roots, inclusive=True).float()
    assert torch.equal(parents_from_tree_mask(mask), as_roots)
    assert torch.equal(parents_from_tree_mask(mask[:, None]), as_roots)


def test_tree_mask_errors():
    with pytest.raises(ValueError, match="diagonal"):
        parents_from_tree_mask(torch.tensor([[1, 0], [1, 0]]))
    with pytest.raises(ValueError, match="lower triangular"):
        parents_from_tree_mask(torch.tensor([[1, 1], [1, 1]]))
    # node 2 sees node 0 but not its parent 1's ancestor chain consistently: sees 1 but not 0
    with pytest.raises(ValueError, match="not the ancestor mask"):
        parents_from_tree_mask(torch.tensor([[1, 0, 0], [1, 1, 0], [0, 1, 1]]))
    with pytest.raises(ValueError, match="tree mask must be"):
        parents_from_tree_mask(torch.ones(2, 3))


def test_padding():
    parents = torch.tensor([[-1, 0, 0]])
    padded = pad_parents(parents, 5)
    assert padded.tolist() == [[-1, 0, 0, PAD, PAD]]
    assert num_real_nodes(padded).tolist() == [3]
    assert bucket_size(17) == 32 and bucket_size(16) == 16 and bucket_size(3, 4) == 4
    with pytest.raises(ValueError, match="cannot pad"):
        pad_parents(parents, 2)
    with pytest.raises(ValueError, match="not a real node"):
        path_to(padded[0], 4)


@settings(max_examples=80, deadline=None)
@given(parent_rows(max_nodes=24))
def test_chain_decomposition_properties(row):
    parents = torch.tensor(row)
    dec = chain_decomposition(parents)
    covered = [n for chain in dec.chains for n in chain]
    assert sorted(covered) == list(range(len(row)))  # every node in exactly one chain
    subtree = [1] * len(row)
    for j in reversed(range(len(row))):
        if row[j] >= 0:
            subtree[row[j]] += subtree[j]
    chain_of = {n: c for c, chain in enumerate(dec.chains) for n in chain}
    for c, chain in enumerate(dec.chains):
        assert dec.boundary[c] == row[chain[0]]
        for a, b in zip(chain, chain[1:]):
            assert row[b] == a
            siblings = [j for j, p in enumerate(row) if p == a]
            assert subtree[b] == max(subtree[s] for s in siblings)  # heavy child
        expected_level = 0 if dec.boundary[c] == ROOT else dec.level[chain_of[dec.boundary[c]]] + 1
        assert dec.level[c] == expected_level
    # light edges only: on any root-to-node path the number of chain switches is logarithmic
    for j in range(len(row)):
        switches = dec.level[chain_of[j]]
        assert 2**switches <= len(row)
    assert sorted(c for lvl in dec.ready_levels for c in lvl) == list(range(len(dec.chains)))
    assert dec.boundary_nodes == sorted({row[chain[0]] for chain in dec.chains} - {ROOT})
    tensors = dec.to_tensors()
    assert tensors["nodes"].shape == (len(dec.chains), max(map(len, dec.chains)))
    assert tensors["length"].tolist() == [len(c) for c in dec.chains]


def test_chain_decomposition_examples():
    chain = chain_decomposition(torch.tensor([-1, 0, 1, 2]))
    assert chain.chains == ((0, 1, 2, 3),) and chain.boundary == (ROOT,) and chain.boundary_nodes == []
    # 0 -> {1 -> {3, 4}, 2}: node 1 has the bigger subtree
    tree = chain_decomposition(torch.tensor([-1, 0, 0, 1, 1]))
    assert tree.chains == ((0, 1, 3), (2,), (4,))
    assert tree.boundary == (ROOT, 0, 1) and tree.level == (0, 1, 1)
    assert tree.ready_levels == [[0], [1, 2]]
    with pytest.raises(ValueError, match="one row"):
        chain_decomposition(torch.tensor([[-1, 0]]))


@settings(max_examples=100, deadline=None)
@given(parent_batches(max_rows=3, max_nodes=20))
def test_device_ancestor_mask_equals_the_node_by_node_one(parents):
    """Both device routes, the products and the walk up the parents (given the trees' height), give the mask."""
    expected = ancestor_mask(parents, inclusive=True)
    height = int(depth(parents).max()) + 1
    assert torch.equal(ancestor_mask_device(parents), expected)
    assert torch.equal(ancestor_mask_device(parents, height=height), expected)
    if height > 1:  # (one step short misses the deepest nodes' root)
        assert not torch.equal(ancestor_mask_device(parents, height=height - 1), expected)
