"""Draft construction from any next-token model: chain mode and beam top-k tree mode.

The builder drives a drafter-supplied *step function* level by level. Every level has the same number
``W`` of frontier nodes per row (1 at the pending token, then the beam width), so a drafter can keep
one state slot per frontier node and reorder its slots between levels the way beam search reorders a
cache: ``parent_slots`` says which slot of the previous level each new frontier node continues from.

Tree mode (``SpecConfig.mode == "tree"``): level 0 expands the pending token into its ``tree_top_k`` most
likely children; every later level expands each of the ``tree_top_k`` beam nodes into its ``tree_top_k`` children,
and the beam becomes the ``tree_top_k`` children with the best cumulative draft log-probability. After
``depth`` levels every generated node is a candidate; a candidate is kept when its cumulative
log-probability is within ``tau`` of the best candidate at its depth, kept nodes keep their
ancestors, and the ``budget`` best nodes (by cumulative log-probability, which never increases along
a path, so ancestors always rank first) form the draft.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..kernels import ops
from ..tree import PAD, ROOT, ancestor_mask_device
from .config import SpecConfig
from .drafting import Draft

PAD_TOKEN = 0  # token id stored at padding nodes; never read


@dataclass
class Frontier:
    """One rollout level: ``W`` frontier nodes for each of ``R`` rows.

    ``tokens [R, W]``: the frontier nodes' tokens. ``parent_slots [R, W]``: for ``depth >= 1``, the
    slot (0..W'-1) of the previous level's frontier each node continues from; ``None`` at
    ``depth == 0``, where the single frontier node is the pending token (the last token of the row's
    sequence). ``depth``: distance of these nodes from the pending token.
    """

    tokens: torch.Tensor
    parent_slots: torch.Tensor | None
    depth: int


# Returns next-token scores ``[R, W, V]`` after each frontier node: log-probabilities or logits
# (the builder applies log_softmax, so both work). A step object whose ``draft_vocab`` attribute is a tensor
# of token ids scores only those tokens: column ``j`` of its scores is token ``draft_vocab[j]`` (exact ties
# then go to the earlier column, not to the lower token id). A tree level calls the step object's ``top_k(frontier,
# k)`` where it has one: ``(log_probs, columns) [R, W, min(k, V)]``, what ``ops.vocab_top_k`` of its scores gives
# (a drafter that computes both in fewer launches).
StepFn = Callable[[Frontier], torch.Tensor]


def build_draft(step: StepFn, pending: torch.Tensor, config: SpecConfig, fixed_size: bool = False) -> Draft:
    """Roll out ``step`` from the pending tokens ``[R]`` and pack the draft (chain or tree per ``config``).

    Returns a :class:`Draft` with ``probs=None``: children are chosen deterministically (top-k). A tree
    has as many nodes as its widest row keeps, which the host reads from the device; ``fixed_size``: it
    has ``budget + 1`` nodes instead (padded), read nothing back (what a CUDA graph of it needs).
    """
    if pending.dim() != 1 or pending.numel() == 0:
        raise ValueError(f"pending must be a non-empty 1-D tensor of token ids, got shape {tuple(pending.shape)}")
    pending = pending.long()
    vocab = getattr(step, "draft_vocab", None)
    if config.mode == "chain":
        return _chain(step, pending, config.depth, vocab)
    return _tree(step, pending, config, fixed_size, vocab)


def _scores(step: StepFn, frontier: Frontier) -> torch.Tensor:
    rows, width = frontier.tokens.shape
    scores = step(frontier)
    if scores.dim() != 3 or scores.shape[:2] != (rows, width):
        raise ValueError(f"step function must return [R, W, V] = [{rows}, {width}, V], got {tuple(scores.shape)}")
    return scores


def _token_ids(columns: torch.Tensor, vocab: torch.Tensor | None) -> torch.Tensor:
    """Token ids of score columns (themselves, without a draft vocabulary)."""
    return columns if vocab is None else vocab[columns]


def _chain(step: StepFn, pending: torch.Tensor, depth: int, vocab: torch.Tensor | None) -> Draft:
    tokens = [pending[:, None]]
    slots = torch.zeros_like(tokens[0])
    for level in range(depth):
        frontier = Frontier(tokens[-1], None if level == 0 else slots, level)
        best = _scores(step, frontier).argmax(-1)  # (a chain needs no normalisation: same argmax)
        tokens.append(_token_ids(best, vocab))
    rows, n = pending.shape[0], depth + 1
    parents = torch.arange(-1, n - 1, device=pending.device).expand(rows, n).clone()
    return Draft(tokens=torch.cat(tokens, dim=1), parents=parents, chain=True)


def _tree(step: StepFn, pending: torch.Tensor, config: SpecConfig, fixed_size: bool, vocab: torch.Tensor | None) -> Draft:
    rows, device = pending.shape[0], pending.device
    row_ix = torch.arange(rows, device=device)[:, None]
    # Candidates of every level, concatenated level after level (so parents precede children).
    cand_token, cand_parent, cand_score, cand_depth = [], [], [], []
    frontier = Frontier(pending[:, None], None, 0)
    beam_ids = torch.full((rows, 1), ROOT, device=device)  # candidate index of each frontier node
    beam_score = torch.zeros(rows, 1, device=device)
    offset = 0
    for level in range(config.depth):
        child_lp, child_col = _children(step, frontier, config.tree_top_k)
        width, k = child_lp.shape[1:]
        child_tok = _token_ids(child_col, vocab)
        score = (beam_score[..., None] + child_lp).reshape(rows, width * k)
        cand_token.append(child_tok.reshape(rows, width * k))
        cand_parent.append(beam_ids[..., None].expand(rows, width, k).reshape(rows, width * k))
        cand_score.append(score)
        cand_depth.append(torch.full((width * k,), level + 1, device=device))
        if level + 1 == config.depth:
            break
        beam = _best(score, min(config.tree_top_k, width * k))  # [R, W'] local candidate ids
        frontier = Frontier(cand_token[-1].gather(1, beam), torch.div(beam, k, rounding_mode="floor"), level + 1)
        beam_ids, beam_score = beam + offset, score.gather(1, beam)
        offset += width * k
    tokens, parents, scores = (torch.cat(x, dim=1) for x in (cand_token, cand_parent, cand_score))
    keep = _select(parents, scores, torch.cat(cand_depth), config)
    return _pack(pending, tokens, parents, keep, row_ix, config.budget + 1 if fixed_size else None)


def _children(step: StepFn, frontier: Frontier, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each frontier node's ``min(k, V)`` most likely children ``[R, W, k]``, sorted by likelihood: their
    log-probabilities and score columns (the log-probabilities of the k best only: one launch on GPUs)."""
    top_k = getattr(step, "top_k", None)
    if top_k is not None:
        return top_k(frontier, k)
    scores = _scores(step, frontier)
    rows, width, columns = scores.shape
    k = min(k, columns)
    return tuple(t.view(rows, width, k) for t in ops.vocab_top_k(scores.reshape(rows * width, columns), k))


def _ranks(score: torch.Tensor, among: torch.Tensor | None = None) -> torch.Tensor:
    """Each candidate's rank among a row's few candidates ``score [R, n]`` (or among those ``among [R, n]``
    marks), best first, ties to the lower index, NaN as -inf: counted pairwise, elementwise work that inductor
    fuses with its neighbours (``topk`` is two kernels, about 10 us on the H200, for a level's 16 candidates, and
    a sort and a scatter are kernels of their own)."""
    score = score.nan_to_num(nan=float("-inf"))  # (NaN compares false with everything: ranks would repeat)
    index = torch.arange(score.shape[-1], device=score.device)
    other, this = score[:, None, :], score[:, :, None]
    ahead = (other > this) | ((other == this) & (index[None, :] < index[:, None]))  # [R, n, n]: j ranks before i
    return (ahead if among is None else ahead & among[:, None, :]).sum(-1)


def _best(score: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest of each row's few candidates ``score [R, n]``, best first, ties to the lower
    index (:func:`_ranks`)."""
    rank = _ranks(score)
    return (rank[:, None, :] == torch.arange(k, device=score.device)[:, None]).int().argmax(-1)


def _select(parents: torch.Tensor, scores: torch.Tensor, depth: torch.Tensor, config: SpecConfig) -> torch.Tensor:
    """Kept candidates ``[R, M]``: within ``tau`` of the best at their depth, closed under ancestors,
    truncated to the ``budget`` best."""
    # Depths are 1..config.depth and the budget cut below is unconditional: no device-to-host read here. No
    # scatter either (each is a kernel of its own on the GPU): masked reductions and gathers, which inductor fuses.
    rows, m = scores.shape
    levels = torch.arange(1, config.depth + 1, device=scores.device)
    best = torch.where(depth[:, None] == levels, scores[..., None], float("-inf")).amax(1)  # [R, depth]
    keep = scores >= best.gather(1, (depth - 1).expand(rows, m)) - config.tau
    # Ancestor closure: a candidate is kept when it or one of its descendants is (candidates' parents index
    # candidates, ROOT at level 1, so a root path holds at most ``depth`` of them).
    above = ancestor_mask_device(parents, height=config.depth).transpose(1, 2)  # [R, i, j]: i is j or above it
    keep = (above & keep[:, None, :]).any(-1)
    # The ``budget`` best kept nodes (all of them in a row that keeps fewer): ranked among the kept ones, ties to
    # the earlier candidate (candidates are in depth order, so ancestors rank before descendants).
    return keep & (_ranks(scores, among=keep) < config.budget)


def _pack(
    pending: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, keep: torch.Tensor, row_ix: torch.Tensor,
    nodes: int | None,
) -> Draft:
    """Kept candidates as draft rows (node 0 = pending token), in candidate order, padded with PAD to
    ``nodes`` (at least 1 + the kept count of every row; None: exactly the widest row)."""
    rows = keep.shape[0]
    n = nodes if nodes is not None else 1 + int(keep.sum(-1).max())
    # Node index of each kept candidate: 1 + number of kept candidates before it.
    node_of = keep.long().cumsum(-1)
    node_of = torch.where(keep, node_of, 0)
    slot = torch.where(keep, node_of, n)  # dropped candidates go to a discarded extra column
    parent_node = torch.where(parents >= 0, node_of.gather(1, parents.clamp(min=0)), 0)
    out_tok = torch.full((rows, n + 1), PAD_TOKEN, dtype=torch.long, device=pending.device)
    out_par = torch.full((rows, n + 1), PAD, dtype=torch.long, device=pending.device)
    out_tok[row_ix, slot] = tokens
    out_par[row_ix, slot] = parent_node
    out_tok[:, 0], out_par[:, 0] = pending, ROOT
    return Draft(tokens=out_tok[:, :n], parents=out_par[:, :n], chain=False)


def draft_from_paths(pending: torch.Tensor, rows: Sequence[Sequence[tuple[int, int]]]) -> Draft:
    """Pack per-row lists of ``(token, parent node)`` (draft nodes 1.. in topological order, parent 0 =
    the pending token) into a padded :class:`Draft`. Used by drafters that build trees directly."""
    n = 1 + max((len(r) for r in rows), default=0)
    tokens = torch.full((len(rows), n), PAD_TOKEN, dtype=torch.long)
    parents = torch.full((len(rows), n), PAD, dtype=torch.long)
    tokens[:, 0], parents[:, 0] = pending.cpu(), ROOT
    for b, nodes in enumerate(rows):
        if nodes:
            tokens[b, 1 : len(nodes) + 1] = torch.tensor([t for t, _ in nodes])
            parents[b, 1 : len(nodes) + 1] = torch.tensor([p for _, p in nodes])
    return Draft(tokens=tokens.to(pending.device), parents=parents.to(pending.device))
