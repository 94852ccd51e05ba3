"""Acceptance of a verified draft tree: greedy matching and lossless recursive rejection sampling.

A draft row is ``tokens [N]`` / ``parents [N]`` in the conventions of :mod:`.topology`; node 0 is the
pending token and is always accepted. The accepted path walks down from node 0; the token emitted
after it (the next pending token) comes from the target's distribution at the last accepted node.
Siblings are visited in node-index order, which for sampled drafts must be the order in which they
were drawn (without replacement) from the draft distribution at their parent.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .topology import validate_parents

# Probability mass below this is treated as an exhausted distribution (only reachable through rounding).
_EMPTY_MASS = 1e-12


@dataclass
class Acceptance:
    """Result of accepting one draft per batch row.

    ``path [B, N]``: accepted node indices from node 0 on, padded with -1; ``num_accepted [B]`` (>= 1, but
    0 for a row the engine had stopped before the pass);
    ``next_token [B]``: the token the target emits after the last accepted node (the next pending token).
    ``accepted_before_cut [B]``: where the engine already cut rows at EOS and budget (``num_accepted`` then
    counts the nodes kept), the nodes accepted before that cut; None where nothing was cut.
    """

    path: torch.Tensor
    num_accepted: torch.Tensor
    next_token: torch.Tensor
    accepted_before_cut: torch.Tensor | None = None


def _check_draft(tokens: torch.Tensor, parents: torch.Tensor, dist: torch.Tensor, name: str) -> torch.Tensor:
    parents = validate_parents(parents)
    if tokens.shape != parents.shape:
        raise ValueError(f"tokens {tuple(tokens.shape)} and parents {tuple(parents.shape)} must have the same shape")
    if dist.dim() != 3 or dist.shape[:2] != parents.shape:
        raise ValueError(
            f"{name} must have shape [B, N, V] = [{parents.shape[0]}, {parents.shape[1]}, V], got {tuple(dist.shape)}"
        )
    return parents.to(tokens.device)


def _children_table(parents: torch.Tensor) -> torch.Tensor:
    """``kids [B, N, C]``: the children of every node in index order, padded with -1 (C >= 1)."""
    batch, n = parents.shape
    is_child = parents[:, None, :] == torch.arange(n, device=parents.device)[None, :, None]  # [B, parent, child]
    width = max(int(is_child.sum(-1).max()), 1)
    # Stable sort puts each node's children first, in index order.
    order = torch.sort((~is_child).to(torch.uint8), dim=-1, stable=True).indices[..., :width]
    return torch.where(is_child.gather(-1, order), order, -1)


def greedy_accept(tokens: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor) -> Acceptance:
    """Greedy acceptance: from node 0 move to the first child whose token is the target's argmax at the
    current node; stop when none is. ``tokens, parents [B, N]``, ``target_logits [B, N, V]``."""
    parents = _check_draft(tokens, parents, target_logits, "target_logits")
    batch, n = parents.shape
    rows = torch.arange(batch, device=tokens.device)
    best = target_logits.argmax(-1)  # [B, N]
    # A node "matches" when its token is the target's choice at its parent.
    matches = (parents >= 0) & (tokens == best.gather(1, parents.clamp(min=0)))
    path = torch.full((batch, n), -1, dtype=torch.long, device=tokens.device)
    path[:, 0] = 0
    cur = torch.zeros(batch, dtype=torch.long, device=tokens.device)
    count = torch.ones(batch, dtype=torch.long, device=tokens.device)
    for _ in range(n - 1):
        step = matches & (parents == cur[:, None])
        moved = step.any(-1)
        if not moved.any():
            break
        cur = torch.where(moved, step.to(torch.uint8).argmax(-1), cur)  # first matching child
        path[rows[moved], count[moved]] = cur[moved]
        count += moved.long()
    return Acceptance(path, count, best[rows, cur])


_SCAN_BLOCK = 256  # (see _cumsum)


def _cumsum(x: torch.Tensor) -> torch.Tensor:
    """``x.cumsum(-1)`` as two short scans, within blocks of ``_SCAN_BLOCK`` and over the blocks' sums: one scan over a
    vocabulary of a few rows is what inductor on CUDA splits (``SplitScan``), whose codegen fails in torch 2.11 (a
    16-node sampled pass at the 1.3B shape, H200)."""
    size = x.shape[-1]
    blocks = torch.nn.functional.pad(x, (0, -size % _SCAN_BLOCK)).unflatten(-1, (-1, _SCAN_BLOCK))
    within = blocks.cumsum(-1)
    totals = within[..., -1]
    return (within + (totals.cumsum(-1) - totals)[..., None]).flatten(-2)[..., :size]


def warp_probs(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Sampling distribution of ``logits [..., V]`` after transformers' warpers, in their order:
    temperature, then top-k (ties with the k-th logit are kept), then top-p (the smallest set of most
    likely tokens whose mass reaches ``top_p``; the most likely token is always kept).
    ``top_k`` None/0 and ``top_p`` None/1.0 disable those filters."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 or None disables it), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    scores = logits.float() / temperature
    if top_k:
        kth = scores.topk(min(top_k, scores.shape[-1]), dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, order = scores.sort(dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(-1)
        mass_before = _cumsum(sorted_probs) - sorted_probs
        drop_sorted = mass_before >= top_p  # the token that crosses top_p is still kept
        scores = scores.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return scores.softmax(-1)


def _normalize(dist: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Renormalize rows of ``dist``; rows with no mass left take ``fallback`` (a rounding-only case)."""
    mass = dist.sum(-1, keepdim=True)
    return torch.where(mass > _EMPTY_MASS, dist / mass.clamp(min=_EMPTY_MASS), fallback)


def _accept_probability(px: torch.Tensor, qx: torch.Tensor | None) -> torch.Tensor:
    """Probability of accepting a candidate of residual target probability ``px [B]``: ``px`` itself for a
    deterministic candidate (``qx`` None), ``min(1, px / qx)`` for one drawn from the draft's ``qx [B]``."""
    if qx is None:
        return px
    return (px / qx.clamp(min=_EMPTY_MASS)).clamp(max=1.0)


def _after_rejection(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual target and draft ``[B, V]`` after rejecting a sampled sibling ``x [B]``: p <- norm(max(p - q, 0))
    and q <- q without x."""
    drop = torch.zeros_like(p, dtype=torch.bool).scatter_(-1, x[:, None], True)
    return _normalize((p - q).clamp(min=0.0), p), _normalize(q.masked_fill(drop, 0.0), q)


def _removable(px: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
    """Whether rejecting a deterministic sibling of target mass ``px`` takes its mass from its node's residual, of
    mass ``left``: p <- p without x, unless that leaves no mass (a rounding-only case: the mass stays)."""
    return left - px > _EMPTY_MASS


def _sibling_masses(tokens: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For deterministic drafts, what each node ``j`` weighs when tried: its token's target probability at its
    parent (0 where an earlier sibling holds the same token: when ``j`` is tried that sibling was rejected, and its
    token left the residual) and the parent distribution's own sum, ``[B, N]`` each (0 for roots and padding)."""
    batch, n = parents.shape
    parent = parents.clamp(min=0)
    px = target_probs[torch.arange(batch, device=parents.device)[:, None], parent, tokens].double()
    mass = target_probs.sum(-1, dtype=torch.float64).gather(1, parent)
    earlier = torch.arange(n, device=parents.device)[None, :] < torch.arange(n, device=parents.device)[:, None]  # [j, k]: k < j
    duplicate = ((parents[:, :, None] == parents[:, None, :]) & (tokens[:, :, None] == tokens[:, None, :]) & earlier).any(-1)
    real = parents >= 0
    return torch.where(real & ~duplicate, px, 0.0), torch.where(real, mass, 0.0)


def _residual(target_probs: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
    """The distribution ``[B, V]`` after the walk stopped at ``cur [B]`` (every child of it tried and rejected, or
    none): the target's there without its children's tokens (where that leaves no mass, a rounding-only case, the
    target's there whole)."""
    rows = torch.arange(parents.shape[0], device=parents.device)
    p = target_probs[rows, cur].double()
    children = torch.zeros_like(p, dtype=torch.long).scatter_add_(1, tokens, (parents == cur[:, None]).long())
    left = p.masked_fill(children > 0, 0.0)
    return torch.where(left.sum(-1, keepdim=True) > 0, left, p)


def draw_uniforms(batch: int, nodes: int, generator: torch.Generator | None = None,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """The uniforms one sampled pass consumes, ``[batch, nodes]`` fp64: column ``j >= 1`` decides whether node
    ``j`` is accepted when it is tried, column 0 (node 0 is never tried) draws the token after the path."""
    return torch.rand(batch, nodes, generator=generator, device=device, dtype=torch.float64)


def _sample_token(p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of ``p [B, V]`` (any positive scale) by inverse CDF at ``u [B]`` (a token of zero
    probability never: where rounding puts ``u`` past the last step, the last token of positive probability; a row
    with no mass at all, which only NaN logits make, gets token V - 1)."""
    cdf = _cumsum(p)
    # (searchsorted(right=True) as a sum, V less the steps above u: inductor's searchsorted needs a buffer of known
    # strides, which the blocked sums' view is not, and on CUDA failed to compile on it; NaN is above nothing, as
    # searchsorted places it last)
    token = p.shape[-1] - (cdf > (u * cdf[:, -1])[:, None]).sum(-1)
    last_positive = p.shape[-1] - 1 - (p > 0).flip(-1).to(torch.uint8).argmax(-1)
    return torch.minimum(token, last_positive)


def sample_accept(
    tokens: torch.Tensor,
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    uniforms: torch.Tensor | None = None,
) -> Acceptance:
    """Lossless recursive rejection sampling over each accepted node's children, walked level by level (the
    reference of :func:`sample_accept_device`).

    ``target_probs [B, N, V]`` is the target's sampling distribution at every node (see
    :func:`warp_probs`). ``draft_probs [B, N, V]`` is the distribution each node's children were drawn
    from without replacement, in index order; ``None`` means the children were chosen
    deterministically: a node's residual is then its distribution without the siblings rejected so far, kept as
    the mass they removed (no pass over the vocabulary per sibling). The emitted tokens (accepted path after node
    0, then ``next_token``) are distributed exactly as sampling from the target token by token. ``uniforms [B,
    N]``: what the pass consumes (:func:`draw_uniforms`; default: drawn here with ``generator``).
    """
    parents = _check_draft(tokens, parents, target_probs, "target_probs")
    if draft_probs is not None and draft_probs.shape != target_probs.shape:
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)} must match target_probs {tuple(target_probs.shape)}")
    batch, n = parents.shape
    device = tokens.device
    if uniforms is None:
        uniforms = draw_uniforms(batch, n, generator, device)
    rows = torch.arange(batch, device=device)
    kids = _children_table(parents)
    if draft_probs is None:
        px_of, mass_of = _sibling_masses(tokens, parents, target_probs)
    path = torch.full((batch, n), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    cur = torch.zeros(batch, dtype=torch.long, device=device)
    count = torch.ones(batch, dtype=torch.long, device=device)
    next_token = torch.zeros(batch, dtype=torch.long, device=device)
    walking = torch.ones(batch, dtype=torch.bool, device=device)
    while walking.any():
        if draft_probs is not None:
            p, q = target_probs[rows, cur].double(), draft_probs[rows, cur].double()
        removed = torch.zeros(batch, dtype=torch.float64, device=device)  # (the mass deterministic siblings took)
        moved = torch.zeros(batch, dtype=torch.bool, device=device)
        for rank in range(kids.shape[-1]):
            child = kids[rows, cur, rank]
            trying = walking & ~moved & (child >= 0)
            if not trying.any():
                break
            node = child.clamp(min=0)
            x, u = tokens[rows, node], uniforms[rows, node]
            if draft_probs is None:
                px, left = px_of[rows, node], mass_of[rows, node] - removed
                accept = trying & (u < _accept_probability(px / left, None))
                removed = torch.where(trying & ~accept & _removable(px, left), removed + px, removed)
            else:
                accept = trying & (u < _accept_probability(p.gather(-1, x[:, None])[:, 0], q.gather(-1, x[:, None])[:, 0]))
                p_next, q_next = _after_rejection(p, q, x)
                reject = trying & ~accept
                p, q = torch.where(reject[:, None], p_next, p), torch.where(reject[:, None], q_next, q)
            moved |= accept
            cur = torch.where(accept, child, cur)
        path[rows[moved], count[moved]] = cur[moved]
        count += moved.long()
        done = walking & ~moved  # every child rejected (or none): emit from the residual
        if done.any():
            residual = _residual(target_probs, tokens, parents, cur) if draft_probs is None else p
            next_token[done] = _sample_token(residual[done], uniforms[done, 0])
        walking = moved
    return Acceptance(path, count, next_token)


def sample_accept_device(tokens: torch.Tensor, parents: torch.Tensor, target_probs: torch.Tensor,
                         draft_probs: torch.Tensor | None, uniforms: torch.Tensor) -> Acceptance:
    """:func:`sample_accept` without host synchronisation or data-dependent loops (it runs inside the engine's
    CUDA graph), on the same ``uniforms``: the same path, count and next token. One pass over the nodes in index
    order suffices, since a walk only moves down a topologically ordered tree and tries each node's children in
    index order: node ``j`` is tried exactly when its parent is the walk's current node. Deterministic drafts
    read each node's distribution once, for its sum, and the last node's again, for the token after the path (the
    walk itself is a few ``[B]`` ops a node, which inductor fuses); sampled ones update whole distributions at every
    node. ``parents`` must already be valid (no checks here: they would synchronise)."""
    batch, n = parents.shape
    cur = torch.zeros(batch, dtype=torch.long, device=tokens.device)
    count = torch.ones_like(cur)
    slot = torch.full((batch, n), n, dtype=torch.long, device=tokens.device)  # each node's place on the path (n: off it)
    slot[:, 0] = 0
    if draft_probs is None:  # (every node's weights up front: the walk below is then [B]-sized ops only)
        px_of, mass_of = _sibling_masses(tokens, parents, target_probs)
        removed = torch.zeros(batch, dtype=torch.float64, device=tokens.device)
    else:
        p, q = target_probs[:, 0].double(), draft_probs[:, 0].double()
    for j in range(1, n):
        trying = parents[:, j] == cur
        x = tokens[:, j]
        if draft_probs is None:
            px, left = px_of[:, j], mass_of[:, j] - removed
            accept = trying & (uniforms[:, j] < _accept_probability(px / left, None))
            removed = torch.where(accept, 0.0, torch.where(trying & ~accept & _removable(px, left), removed + px, removed))
        else:
            accept = trying & (uniforms[:, j] < _accept_probability(p.gather(-1, x[:, None])[:, 0], q.gather(-1, x[:, None])[:, 0]))
            reject = trying & ~accept
            p_next, q_next = _after_rejection(p, q, x)
            p = torch.where(accept[:, None], target_probs[:, j].double(), torch.where(reject[:, None], p_next, p))
            q = torch.where(accept[:, None], draft_probs[:, j].double(), torch.where(reject[:, None], q_next, q))
        slot[:, j] = torch.where(accept, count, n)
        count = count + accept.long()
        cur = torch.where(accept, j, cur)
    if draft_probs is None:
        p = _residual(target_probs, tokens, parents, cur)
    node = torch.arange(n, device=tokens.device)
    path = torch.full((batch, n + 1), -1, dtype=torch.long, device=tokens.device)
    path.scatter_(1, slot, node.expand(batch, n).clone())
    return Acceptance(path[:, :n], count, _sample_token(p, uniforms[:, 0]))


def greedy_accept_device(tokens: torch.Tensor, parents: torch.Tensor, target_logits: torch.Tensor, ancestors: torch.Tensor) -> Acceptance:
    """:func:`greedy_accept` without loops or host synchronisation (it runs inside the engine's CUDA
    graph): a node is on the accepted path when every node from node 0 down to it is the first child
    of its parent whose token is the target's argmax there. ``ancestors [B, N, N]`` is the inclusive
    ancestor mask; ``parents`` must already be valid (no checks here: they would synchronise)."""
    batch, n = parents.shape
    best = target_logits.argmax(-1)  # [B, N]
    match = (parents >= 0) & (tokens == best.gather(1, parents.clamp(min=0)))
    node = torch.arange(n, device=tokens.device)
    earlier_sibling = (parents[:, :, None] == parents[:, None, :]) & (node[None, None, :] < node[None, :, None])
    first_match = match & ~(earlier_sibling & match[:, None, :]).any(-1)
    first_match[:, 0] = True  # the pending token is always accepted
    on_path = ~(ancestors & ~first_match[:, None, :]).any(-1)
    depth = ancestors.sum(-1) - 1
    count = on_path.sum(-1)
    slot = torch.where(on_path, depth, n)  # off-path nodes land in a spare column, dropped below
    path = torch.full((batch, n + 1), -1, dtype=torch.long, device=tokens.device)
    path.scatter_(1, slot, node.expand(batch, n).clone())
    path = path[:, :n]
    last = path.gather(1, (count - 1)[:, None])
    return Acceptance(path, count, best.gather(1, last)[:, 0])


def cut_at_stop(tokens: torch.Tensor, acceptance: Acceptance, remaining: torch.Tensor, eos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each row's emitted tokens end, on the device: a row emits its accepted drafts, then
    ``acceptance.next_token``, cut after its first EOS (``eos [E]``, padded with -1) and at its budget
    ``remaining [B]`` (tokens it may still emit). Returns ``(kept [B], last [B], stops [B])``: tokens kept
    (>= 1 where ``remaining`` is >= 1), the last of them (the row's next pending token) and whether the row ends
    with them. ``tokens [B, N]`` is the verified draft."""
    path, accepted = acceptance.path, acceptance.num_accepted
    n = path.shape[1]
    index = torch.arange(n, device=path.device)
    # emitted token j: the path's node j + 1, and the target's token after the last accepted node
    following = tokens.gather(1, path.roll(-1, dims=1).clamp(min=0))
    emitted = torch.where(index == accepted[:, None] - 1, acceptance.next_token[:, None], following)
    is_eos = (emitted[..., None] == eos).any(-1) & (index < accepted[:, None])
    through_eos = torch.where(is_eos, index + 1, n + 1).amin(1)  # tokens up to the first EOS (n + 1: none)
    kept = torch.minimum(torch.minimum(accepted, through_eos), remaining)
    last = emitted.gather(1, (kept - 1).clamp(min=0)[:, None])[:, 0]
    return kept, last, (through_eos <= kept) | (kept >= remaining)
