import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specla_compile.runtime.config import SpecConfig
from specla_compile.runtime.drafters import NgramDrafter
from specla_compile.runtime.drafting import DraftRequest
from specla_compile.runtime.topology import PAD, path_to, validate_parents


def brute_continuations(seq: list[int], max_ngram: int, length: int) -> list[list[int]]:
    """Every continuation after an earlier copy of a suffix, longest suffix first, then latest copy first."""
    out = []
    for size in range(min(max_ngram, len(seq) - 1), 0, -1):
        suffix = seq[-size:]
        for start in range(len(seq) - size - 1, -1, -1):
            if seq[start : start + size] == suffix:
                out.append(seq[start + size : start + size + length])
    return out


def paths(draft, b: int) -> list[list[int]]:
    n = int((draft.parents[b] != PAD).sum())
    return [draft.tokens[b, path_to(draft.parents[b], j)[1:]].tolist() for j in range(1, n)]


def test_chain_follows_the_latest_longest_match():
    seq = torch.tensor([5, 1, 2, 3, 9, 9, 1, 2, 3, 4, 7, 8, 6, 2, 3])
    draft = NgramDrafter(max_ngram=3).propose(DraftRequest([0], [seq]), SpecConfig(mode="chain", depth=3))
    # "2 3" last occurred before "4 7 8" ("6 2 3" never did, so the 2-gram wins).
    assert draft.tokens[0].tolist() == [3, 4, 7, 8] and draft.parents[0].tolist() == [-1, 0, 1, 2]


def test_no_match_drafts_only_the_pending_token():
    seqs = [torch.tensor([1, 2, 3, 4]), torch.tensor([7, 3, 5, 3])]
    draft = NgramDrafter().propose(DraftRequest([0, 3], seqs), SpecConfig(mode="tree", depth=3, tree_top_k=3, budget=8))
    assert draft.parents[0].tolist() == [-1, PAD, PAD] and draft.tokens[:, 0].tolist() == [4, 3]
    assert paths(draft, 1) == [[5], [5, 3]]  # the continuation runs up to the end of the history


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=40),
    st.integers(1, 4),
    st.integers(1, 3),
    st.integers(1, 10),
    st.sampled_from(["chain", "tree"]),
    st.integers(1, 3),
)
def test_drafts_are_valid_tries_of_the_best_matches(seq, depth, top_k, budget, mode, max_ngram):
    config = SpecConfig(mode=mode, depth=depth, tree_top_k=top_k, budget=budget)
    draft = NgramDrafter(max_ngram=max_ngram).propose(DraftRequest([0], [torch.tensor(seq)]), config)
    parents = validate_parents(draft.parents)
    real = int((parents[0] != PAD).sum())
    assert draft.tokens[0, 0] == seq[-1] and (parents[0, 1:real] >= 0).all()
    assert real - 1 <= (depth if mode == "chain" else budget)
    found = paths(draft, 0)
    assert len({tuple(p) for p in found}) == len(found), "siblings never repeat a token"
    conts = brute_continuations(seq, max_ngram, depth)
    assert all(any(c[: len(p)] == p for c in conts) for p in found), "every node lies on a real continuation"
    if mode == "chain":
        assert found == ([conts[0][:i] for i in range(1, len(conts[0]) + 1)] if conts else [])
    elif conts and budget >= depth:
        best = conts[0]
        assert [best[:i] for i in range(1, len(best) + 1)] == found[: len(best)], "the best match comes first"
    leaves = {tuple(p) for p in found} - {tuple(p[:-1]) for p in found}
    assert len(leaves) <= (1 if mode == "chain" else top_k)


def test_rows_and_bad_arguments():
    with pytest.raises(ValueError, match="min_ngram"):
        NgramDrafter(max_ngram=2, min_ngram=3)
    with pytest.raises(ValueError, match="no rows"):
        NgramDrafter().propose(DraftRequest([], []), SpecConfig())
    NgramDrafter().check_vocab(12345)  # copies tokens from the history: any vocabulary
