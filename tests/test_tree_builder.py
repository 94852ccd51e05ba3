import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specla_compile.runtime.config import SpecConfig
from specla_compile.runtime.topology import PAD, path_to, validate_parents
from specla_compile.runtime.tree_builder import Frontier, build_draft, draft_from_paths


def path_logits(path: tuple[int, ...], vocab: int, seed: int) -> torch.Tensor:
    """Deterministic pseudo-random next-token logits of a token path."""
    gen = torch.Generator().manual_seed(hash((seed, path)) % 2**31)
    return torch.randn(vocab, generator=gen, dtype=torch.float64) * 2


class PathLM:
    """A step function that tracks each frontier slot's token path the way a cached drafter would:
    by reordering slots with ``parent_slots``."""

    def __init__(self, vocab: int, seed: int):
        self.vocab, self.seed, self.paths = vocab, seed, None
        self.calls: list[Frontier] = []

    def __call__(self, frontier: Frontier) -> torch.Tensor:
        self.calls.append(frontier)
        if frontier.depth == 0:
            assert frontier.parent_slots is None and frontier.tokens.shape[1] == 1
            self.paths = [[(t,)] for t in frontier.tokens[:, 0].tolist()]
        else:
            assert frontier.parent_slots.shape == frontier.tokens.shape
            self.paths = [
                [row[s] + (t,) for s, t in zip(slots, toks)]
                for row, slots, toks in zip(self.paths, frontier.parent_slots.tolist(), frontier.tokens.tolist())
            ]
        return torch.stack([torch.stack([path_logits(p, self.vocab, self.seed) for p in row]) for row in self.paths])


def oracle_tree(pending: int, vocab: int, seed: int, config: SpecConfig) -> set[tuple[int, ...]]:
    """Brute-force beam rollout and selection; returns the kept nodes as token paths after the pending token."""
    lp = lambda path: torch.log_softmax(path_logits((pending, *path), vocab, seed), -1)  # noqa: E731
    scores: dict[tuple[int, ...], float] = {}
    beam = [()]
    for _ in range(config.depth):
        level = {}
        for path in beam:
            top = lp(path).topk(min(config.tree_top_k, vocab))
            for value, tok in zip(top.values.tolist(), top.indices.tolist()):
                level[path + (tok,)] = scores.get(path, 0.0) + value
        scores.update(level)
        beam = sorted(level, key=level.get, reverse=True)[: config.tree_top_k]
    best = {}
    for path, s in scores.items():
        best[len(path)] = max(best.get(len(path), -math.inf), s)
    kept = {p for p, s in scores.items() if s >= best[len(p)] - config.tau}
    kept |= {p[:i] for p in kept for i in range(1, len(p))}
    return set(sorted(kept, key=lambda p: (-scores[p], len(p)))[: config.budget])


def draft_paths(tokens: torch.Tensor, parents: torch.Tensor) -> set[tuple[int, ...]]:
    n = int((parents != PAD).sum())
    return {tuple(tokens[path_to(parents, j)[1:]].tolist()) for j in range(1, n)}


configs = st.builds(
    SpecConfig,
    mode=st.just("tree"),
    depth=st.integers(1, 4),
    tree_top_k=st.integers(1, 3),
    budget=st.integers(1, 14),
    tau=st.sampled_from([0.0, 0.5, 2.0, math.inf]),
)


@settings(max_examples=60, deadline=None)
@given(configs, st.integers(1, 3), st.integers(2, 12), st.integers(0, 10**6))
def test_tree_matches_brute_force_selection(config, rows, vocab, seed):
    pending = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(seed))
    lm = PathLM(vocab, seed)
    draft = build_draft(lm, pending, config)
    parents = validate_parents(draft.parents)
    assert draft.probs is None and draft.tokens.shape == parents.shape
    assert len(lm.calls) == config.depth
    assert [c.depth for c in lm.calls] == list(range(config.depth)) and lm.calls[0].tokens.shape[1] == 1
    assert all(c.tokens.shape[1] <= config.tree_top_k for c in lm.calls), "the beam is at most tree_top_k wide"
    for b in range(rows):
        real = int((parents[b] != PAD).sum())
        assert draft.tokens[b, 0] == pending[b] and real - 1 <= config.budget
        assert (parents[b, 1:real] >= 0).all(), "every draft node hangs under the pending token"
        paths = draft_paths(draft.tokens[b], parents[b])
        assert len(paths) == real - 1, "no duplicate siblings"
        assert paths == oracle_tree(int(pending[b]), vocab, seed, config)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3), st.integers(2, 30), st.integers(0, 10**6))
def test_chain_is_greedy_chain_of_step(depth, rows, vocab, seed):
    pending = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(seed))
    draft = build_draft(PathLM(vocab, seed), pending, SpecConfig(mode="chain", depth=depth))
    assert draft.parents.tolist() == [list(range(-1, depth))] * rows
    assert draft.chain is True  # (the engine takes the chain bucket without reading the parents back)
    for b in range(rows):
        path = (int(pending[b]),)
        for _ in range(depth):
            path += (int(path_logits(path, vocab, seed).argmax()),)
        assert draft.tokens[b].tolist() == list(path)


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 4), st.integers(2, 3), st.integers(0, 10**6))
def test_tau_zero_keeps_only_best_paths(depth, top_k, seed):
    vocab = 9
    config = SpecConfig(mode="tree", depth=depth, tree_top_k=top_k, budget=64, tau=0.0)
    pending = torch.tensor([seed % vocab])
    pruned = build_draft(PathLM(vocab, seed), pending, config)
    full = build_draft(
        PathLM(vocab, seed), pending, SpecConfig(mode="tree", depth=depth, tree_top_k=top_k, budget=64, tau=math.inf)
    )
    paths = draft_paths(pruned.tokens[0], pruned.parents[0])
    everything = draft_paths(full.tokens[0], full.parents[0])
    assert len(everything) == top_k + (depth - 1) * top_k**2

    def score(p: tuple[int, ...]) -> float:
        context = (int(pending),)
        return sum(float(torch.log_softmax(path_logits(context + p[:i], vocab, seed), -1)[p[i]]) for i in range(len(p)))

    best = {d: max((p for p in everything if len(p) == d), key=score) for d in range(1, depth + 1)}
    assert paths == {b[:i] for b in best.values() for i in range(1, len(b) + 1)}
    # a tree-mode draft says it is a tree even when pruned to one path: it keeps the tree bucket
    assert pruned.chain is False and full.chain is False


def test_rows_are_independent():
    config = SpecConfig(mode="tree", depth=3, tree_top_k=2, budget=5, tau=1.0)
    pending = torch.tensor([3, 5, 1])
    batched = build_draft(PathLM(12, 7), pending, config)
    for b in range(3):
        single = build_draft(PathLM(12, 7), pending[b : b + 1], config)
        n = single.parents.shape[1]
        assert torch.equal(batched.parents[b, :n], single.parents[0]) and (batched.parents[b, n:] == PAD).all()
        assert torch.equal(batched.tokens[b, :n], single.tokens[0])


def test_step_shape_and_pending_errors():
    with pytest.raises(ValueError, match=r"\[R, W, V\]"):
        build_draft(lambda f: torch.randn(f.tokens.shape[0], 7), torch.tensor([1]), SpecConfig())
    with pytest.raises(ValueError, match="pending"):
        build_draft(PathLM(5, 0), torch.tensor([[1]]), SpecConfig())


def test_draft_from_paths_pads_rows():
    draft = draft_from_paths(torch.tensor([4, 2]), [[(7, 0), (8, 1), (9, 0)], []])
    assert draft.parents.tolist() == [[-1, 0, 1, 0], [-1, PAD, PAD, PAD]]
    assert draft.tokens[0].tolist() == [4, 7, 8, 9] and draft.tokens[1, 0] == 2
    validate_parents(draft.parents)


class DraftVocabLM(PathLM):
    """PathLM scoring only the token ids in ``vocab`` (a draft vocabulary): column j is token vocab[j]."""

    def __init__(self, vocab: int, seed: int, ids: torch.Tensor):
        super().__init__(vocab, seed)
        self.vocab_ids = ids

    @property
    def draft_vocab(self) -> torch.Tensor:  # (what the builder reads)
        return self.vocab_ids

    def __call__(self, frontier: Frontier) -> torch.Tensor:
        return super().__call__(frontier)[..., self.vocab_ids]


class MaskedLM(PathLM):
    """PathLM over the whole vocabulary with every token outside ``ids`` at -inf."""

    def __init__(self, vocab: int, seed: int, ids: torch.Tensor):
        super().__init__(vocab, seed)
        self.outside = torch.ones(vocab, dtype=torch.bool)
        self.outside[ids] = False

    def __call__(self, frontier: Frontier) -> torch.Tensor:
        return super().__call__(frontier).masked_fill(self.outside, float("-inf"))


@pytest.mark.parametrize("config", [SpecConfig(mode="chain", depth=5),
                                    SpecConfig(mode="tree", depth=4, tree_top_k=3, budget=9, tau=2.0),
                                    SpecConfig(mode="tree", depth=3, tree_top_k=4, budget=12)])
@pytest.mark.parametrize("fixed_size", [False, True])
def test_a_draft_vocabulary_drafts_what_masking_the_other_tokens_drafts(config, fixed_size):
    """A step that scores only a draft vocabulary (unsorted ids, a step object with ``draft_vocab``) gives the
    draft that the whole vocabulary gives with every other token at -inf: the builder maps score columns
    back to token ids at every level, and its log-probabilities normalise over the same tokens."""
    vocab = 50
    ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[:17]
    pending = torch.tensor([int(ids[0]), 3, int(ids[5])])
    draft = build_draft(DraftVocabLM(vocab, 4, ids), pending, config, fixed_size)
    expected = build_draft(MaskedLM(vocab, 4, ids), pending, config, fixed_size)
    assert torch.equal(draft.tokens, expected.tokens) and torch.equal(draft.parents, expected.parents)
    assert set(draft.tokens[:, 1:][draft.parents[:, 1:] != PAD].tolist()) <= set(ids.tolist())


def test_beam_pick_is_a_stable_top_k():
    """The beam's pick among a level's candidates: the k best, best first, ties to the lower index (as a
    stable descending sort), -inf and NaN last; random rows with many ties against that sort."""
    from specla_compile.runtime.tree_builder import _best

    scores = torch.tensor([[1.0, 3.0, 3.0, float("-inf"), 2.0], [float("-inf")] * 4 + [0.0]])
    assert _best(scores, 3).tolist() == [[1, 2, 4], [4, 0, 1]]
    assert _best(torch.tensor([[float("nan"), float("nan"), 1.0, 2.0]]), 3).tolist() == [[3, 2, 0]]  # NaN as -inf
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 5, (50, 16), generator=gen).float()
    expected = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :4]
    assert torch.equal(_best(scores, 4), expected)
