import numpy as np
import pytest
import torch
from helpers import parent_batches
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import chi2_contingency
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specla_compile.runtime import acceptance
from specla_compile.runtime.acceptance import (
    draw_uniforms,
    greedy_accept,
    greedy_accept_device,
    sample_accept,
    sample_accept_device,
    warp_probs,
)
from specla_compile.runtime.topology import PAD, ancestor_mask


def brute_greedy(tokens: list[int], parents: list[int], logits: torch.Tensor) -> tuple[list[int], int]:
    cur, path = 0, [0]
    while True:
        best = int(logits[cur].argmax())
        child = next((j for j, p in enumerate(parents) if p == cur and tokens[j] == best), None)
        if child is None:
            return path, best
        cur = child
        path.append(cur)


@settings(max_examples=150, deadline=None)
@given(parent_batches(max_rows=4, max_nodes=12), st.integers(2, 4), st.integers(0, 2**31 - 1))
def test_greedy_matches_brute_force_walk(parents, vocab, seed):
    parents[:, 1:] = torch.where(parents[:, 1:] == -1, 0, parents[:, 1:])  # drafts hang under node 0
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, parents.shape, generator=gen)
    logits = torch.randn(*parents.shape, vocab, generator=gen)
    out = greedy_accept(tokens, parents, logits)
    for b in range(parents.shape[0]):
        path, nxt = brute_greedy(tokens[b].tolist(), parents[b].tolist(), logits[b])
        assert out.num_accepted[b] == len(path)
        assert out.path[b, : len(path)].tolist() == path
        assert (out.path[b, len(path) :] == -1).all()
        assert out.next_token[b] == nxt


def test_greedy_accepts_full_matching_chain():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 5, 11, generator=gen)
    tokens = torch.cat([torch.tensor([[7]]), logits.argmax(-1)[:, :-1]], dim=1)  # each node = target's choice
    out = greedy_accept(tokens, torch.tensor([[-1, 0, 1, 2, 3]]), logits)
    assert out.num_accepted.item() == 5 and out.next_token.item() == logits[0, 4].argmax().item()


def test_bad_inputs_raise():
    parents = torch.tensor([[-1, 0]])
    with pytest.raises(ValueError, match="same shape"):
        greedy_accept(torch.zeros(1, 3, dtype=torch.long), parents, torch.randn(1, 2, 5))
    with pytest.raises(ValueError, match="target_logits"):
        greedy_accept(torch.zeros(1, 2, dtype=torch.long), parents, torch.randn(1, 3, 5))
    with pytest.raises(ValueError, match="draft_probs"):
        sample_accept(torch.zeros(1, 2, dtype=torch.long), parents, torch.rand(1, 2, 5), torch.rand(1, 2, 4))
    for kwargs in ({"temperature": 0.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}):
        with pytest.raises(ValueError):
            warp_probs(torch.randn(2, 5), **kwargs)


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.8), (0.9, 7, 0.6)]
)
def test_warp_probs_matches_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)) * 3
    ref = logits.clone()
    if temperature != 1.0:
        ref = TemperatureLogitsWarper(temperature)(None, ref)
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p:
        ref = TopPLogitsWarper(top_p)(None, ref)
    torch.testing.assert_close(warp_probs(logits, temperature, top_k, top_p), ref.softmax(-1))


# ---- lossless sampling: chi-square two-sample tests -------------------------------------------------

V = 5
TREES = {  # drafts under node 0: a bushy tree, and a chain
    "tree": [-1, 0, 0, 0, 1, 1, 2, 4],
    "chain": [-1, 0, 1, 2],
}


def _table(gen: torch.Generator, depth: int) -> torch.Tensor:
    """Next-token distributions per (depth, last token) ``[depth + 1, V, V]``, bounded away from 0."""
    raw = torch.rand(depth + 1, V, V, generator=gen, dtype=torch.float64) + 0.1
    return raw / raw.sum(-1, keepdim=True)


def _gumbel_top(logq: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """``k`` draws without replacement from ``exp(logq)`` per row, in draw order."""
    gumbel = -torch.log(-torch.log(torch.rand(logq.shape, generator=gen, dtype=torch.float64)))
    return (logq + gumbel).topk(k, dim=-1).indices


def _random_drafts(parents: list[int], target: torch.Tensor, draft: torch.Tensor, rows: int, gen: torch.Generator):
    """Drafts with pending token 0 (one fixed context): each node's children are drawn without
    replacement from the draft at that node. Returns tokens, target_probs, draft_probs."""
    n = len(parents)
    depth = [0] * n
    for j in range(1, n):
        depth[j] = depth[parents[j]] + 1
    tokens = torch.zeros(rows, n, dtype=torch.long)
    target_probs = torch.zeros(rows, n, V, dtype=torch.float64)
    draft_probs = torch.zeros(rows, n, V, dtype=torch.float64)
    for j in range(n):  # topological order: a node's token is drawn before its own children
        target_probs[:, j] = target[depth[j], tokens[:, j]]
        draft_probs[:, j] = draft[depth[j], tokens[:, j]]
        kids = [c for c in range(n) if parents[c] == j]
        if kids:
            tokens[:, kids] = _gumbel_top(draft_probs[:, j].log(), len(kids), gen)
    return tokens, target_probs, draft_probs


def _walk_or_device(tokens, parents, tp, dp, gen, device: bool):
    """:func:`sample_accept` (the walk) or, with ``device``, :func:`sample_accept_device` on uniforms drawn
    from ``gen``."""
    if not device:
        return sample_accept(tokens, parents, tp, dp, gen)
    return sample_accept_device(tokens, parents, tp, dp, draw_uniforms(*tokens.shape, gen))


def _first_two(parents, tokens, tp, dp, gen, use_draft_probs: bool, target: torch.Tensor, device: bool = False) -> torch.Tensor:
    """The first two emitted tokens per row (as ``first * V + second``); rows that emit a single token
    continue with a plain target sample, as the next iteration would."""
    out = _walk_or_device(tokens, torch.tensor([parents]).expand_as(tokens), tp, dp if use_draft_probs else None, gen, device)
    rows = torch.arange(tokens.shape[0])
    emitted = torch.cat(
        [tokens.gather(1, out.path.clamp(min=0))[:, 1:], torch.zeros(len(rows), 1, dtype=torch.long)], 1
    )
    emitted[rows, out.num_accepted - 1] = out.next_token
    first, second = emitted[:, 0], emitted[:, 1]
    single = out.num_accepted == 1
    second[single] = torch.multinomial(target[1, first[single]], 1, generator=gen)[:, 0]
    return first * V + second


def _p_values(tree: str, use_draft_probs: bool, rows: int = 12000, seed: int = 0, device: bool = False) -> tuple[float, float]:
    """Chi-square p-values of (first token, first two tokens) against plain sampling from the target."""
    parents = TREES[tree]
    gen = torch.Generator().manual_seed(seed)
    target, draft = _table(gen, len(parents)), _table(gen, len(parents))
    tokens, tp, dp = _random_drafts(parents, target, draft, rows, gen)
    pairs = _first_two(parents, tokens, tp, dp, gen, use_draft_probs, target, device)
    first = torch.multinomial(target[0, tokens[:, 0]], 1, generator=gen)[:, 0]
    ref = first * V + torch.multinomial(target[1, first], 1, generator=gen)[:, 0]
    p_values = []
    for a, b in ((pairs // V, ref // V), (pairs, ref)):
        table = np.stack([np.bincount(a.numpy(), minlength=V * V), np.bincount(b.numpy(), minlength=V * V)])
        p_values.append(chi2_contingency(table[:, table.sum(0) > 0])[1])
    return p_values[0], p_values[1]


@pytest.mark.parametrize("device", [False, True], ids=["walk", "device"])
@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("use_draft_probs", [True, False])
def test_sampling_is_lossless(tree, use_draft_probs, device):
    p_first, p_pair = _p_values(tree, use_draft_probs, device=device)
    assert p_first > 0.01 and p_pair > 0.01, (p_first, p_pair)


@pytest.mark.parametrize("device", [False, True], ids=["walk", "device"])
@pytest.mark.parametrize("use_draft_probs", [True, False])
def test_accept_always_rule_is_detected(monkeypatch, use_draft_probs, device):
    monkeypatch.setattr(acceptance, "_accept_probability", lambda px, qx: torch.ones_like(px))
    assert min(_p_values("tree", use_draft_probs, device=device)) < 0.01


@pytest.mark.parametrize("device", [False, True], ids=["walk", "device"])
@pytest.mark.parametrize("use_draft_probs", [True, False])
def test_missing_residual_is_detected(monkeypatch, use_draft_probs, device):
    """A residual that keeps rejected siblings (sampled: p - q not taken; deterministic: their mass and tokens not
    removed) changes what is emitted."""
    if use_draft_probs:
        monkeypatch.setattr(acceptance, "_after_rejection", lambda p, q, x: (p, q))
    else:
        monkeypatch.setattr(acceptance, "_removable", lambda px, left: torch.zeros_like(px, dtype=torch.bool))
    assert min(_p_values("tree", use_draft_probs, device=device)) < 0.01


def test_sampling_respects_padding_and_generator():
    gen = torch.Generator().manual_seed(0)
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, PAD, PAD]])
    tokens = torch.randint(0, 7, (2, 4), generator=gen)
    probs = torch.rand(2, 4, 7, generator=gen).softmax(-1)
    a = sample_accept(tokens, parents, probs, generator=torch.Generator().manual_seed(5))
    b = sample_accept(tokens, parents, probs, generator=torch.Generator().manual_seed(5))
    assert torch.equal(a.path, b.path) and torch.equal(a.next_token, b.next_token)
    assert a.num_accepted[1] <= 2 and (a.path[1, 2:] == -1).all()


@settings(max_examples=150, deadline=None)
@given(parent_batches(max_rows=3, max_nodes=12), st.integers(0, 10**6))
def test_device_greedy_acceptance_equals_the_walk(parents, seed):
    """The loop-free acceptance the engine runs inside its CUDA graph picks the same path, count and
    next token as the node-by-node walk, on random trees with duplicate sibling tokens and padding."""
    gen = torch.Generator().manual_seed(seed)
    batch, n = parents.shape
    tokens = torch.randint(0, 3, (batch, n), generator=gen)  # 3 tokens: siblings often share one
    logits = torch.randn(batch, n, 3, generator=gen)
    walk = greedy_accept(tokens, parents, logits)
    device = greedy_accept_device(tokens, parents, logits, ancestor_mask(parents, inclusive=True))
    assert torch.equal(walk.num_accepted, device.num_accepted)
    assert torch.equal(walk.next_token, device.next_token)
    for b, count in enumerate(walk.num_accepted.tolist()):
        assert torch.equal(walk.path[b, :count], device.path[b, :count])


@settings(max_examples=150, deadline=None)
@given(parent_batches(max_rows=3, max_nodes=12), st.booleans(), st.integers(0, 10**6))
def test_device_sampling_equals_the_walk(parents, use_draft_probs, seed):
    """The loop-free rejection sampling the engine runs inside its CUDA graph takes the same path, count and
    next token as the level-by-level walk on the same uniforms, on random trees with duplicate sibling tokens,
    padding, second roots and distributions with zeros (top-k'd targets)."""
    gen = torch.Generator().manual_seed(seed)
    batch, n = parents.shape
    vocab = 4
    tokens = torch.randint(0, vocab, (batch, n), generator=gen)
    target = warp_probs(torch.randn(batch, n, vocab, generator=gen), top_k=2)
    draft = torch.rand(batch, n, vocab, generator=gen).softmax(-1) if use_draft_probs else None
    uniforms = draw_uniforms(batch, n, gen)
    walk = sample_accept(tokens, parents, target, draft, uniforms=uniforms)
    device = sample_accept_device(tokens, parents, target, draft, uniforms)
    assert torch.equal(walk.num_accepted, device.num_accepted)
    assert torch.equal(walk.path, device.path)
    assert torch.equal(walk.next_token, device.next_token)


def test_device_sampling_traces_as_one_graph():
    """Nothing in the device acceptance synchronises with the host or branches on data: Dynamo traces it
    whole (``fullgraph``), as the engine's compiled acceptance needs inside a CUDA graph."""
    gen = torch.Generator().manual_seed(3)
    parents = torch.tensor([[-1, 0, 0, 1, 2, PAD]])
    tokens = torch.randint(0, 6, (1, 6), generator=gen)
    target = torch.rand(1, 6, 6, generator=gen).softmax(-1)
    uniforms = draw_uniforms(1, 6, gen)
    compiled = torch.compile(sample_accept_device, backend="eager", fullgraph=True)
    ours, eager = compiled(tokens, parents, target, None, uniforms), sample_accept_device(tokens, parents, target, None, uniforms)
    assert torch.equal(ours.path, eager.path) and torch.equal(ours.next_token, eager.next_token)


def test_a_residual_token_is_never_one_of_zero_probability():
    """Inverse-CDF sampling at uniforms at and next to 1 still lands on a token the residual can emit."""
    p = torch.tensor([[0.0, 0.3, 0.7, 0.0], [0.5, 0.0, 0.5, 0.0]], dtype=torch.float64)
    for u in (0.0, 0.3, 0.999999, 1.0 - 2**-53, 1.0):
        token = acceptance._sample_token(p, torch.full((2,), u, dtype=torch.float64))
        assert (p.gather(1, token[:, None]) > 0).all(), u


@pytest.mark.parametrize("size", [1, 255, 256, 257, 32000])
def test_blocked_cumulative_sum_is_the_cumulative_sum(size):
    """The vocabulary's cumulative sums as two short scans (the form inductor on CUDA compiles for a few rows of a
    32,000-token vocabulary) give ``cumsum``'s values, in any leading shape."""
    x = torch.rand(2, 3, size, dtype=torch.float64, generator=torch.Generator().manual_seed(size))
    torch.testing.assert_close(acceptance._cumsum(x), x.cumsum(-1), rtol=1e-12, atol=1e-9)
    assert acceptance._cumsum(x).shape == x.shape


def test_inverse_cdf_token_is_searchsorted_s_and_a_row_without_mass_gets_the_last_token():
    """The inverse CDF's token (a count, which inductor compiles on CUDA) is ``searchsorted``'s on the cumulative sums
    at random uniforms, zero-probability tokens in the rows; a NaN row and an all-zero row get token V - 1."""
    gen = torch.Generator().manual_seed(41)
    p = torch.rand(64, 300, dtype=torch.float64, generator=gen) * (torch.rand(64, 300, generator=gen) < 0.7)
    u = torch.rand(64, dtype=torch.float64, generator=gen)
    cdf = p.cumsum(-1)
    expected = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    expected = torch.minimum(expected, 299 - (p > 0).flip(-1).to(torch.uint8).argmax(-1))
    assert torch.equal(acceptance._sample_token(p, u), expected)
    empty = torch.stack([torch.full((300,), float("nan"), dtype=torch.float64), torch.zeros(300, dtype=torch.float64)])
    assert acceptance._sample_token(empty, torch.tensor([0.5, 0.5], dtype=torch.float64)).tolist() == [299, 299]
