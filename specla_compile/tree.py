"""Tree primitives on the ground floor: the padding marker, depths, ancestor masks and per-row node
gathers that the kernels, the lowering and the runtime all use (a draft is ``parents [B, N]`` in
topological order, ``ROOT`` = -1 continues from the durable state, ``PAD`` = -2 is inert padding)."""

from __future__ import annotations

import torch

ROOT = -1
PAD = -2


def gather_nodes(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t[b, index[b, i]]`` for ``t [B, N, ...]`` and ``index [B, A]`` (-1 entries read node 0)."""
    idx = index.clamp(min=0).reshape(*index.shape, *([1] * (t.dim() - 2))).expand(*index.shape, *t.shape[2:])
    return t.gather(1, idx)


def _parent_index(parents: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(has_parent [B], parent index clamped into range [B]) for node ``j``."""
    p = parents[:, j]
    return p >= 0, p.clamp(min=0)


def depth(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node, ``[B, N]`` int64; roots (and padding) have depth 0."""
    out = torch.zeros(parents.shape, dtype=torch.long, device=parents.device)
    rows = torch.arange(parents.shape[0], device=parents.device)
    for j in range(1, parents.shape[1]):
        has, p = _parent_index(parents, j)
        out[:, j] = torch.where(has, out[rows, p] + 1, 0)
    return out


def ancestor_mask(parents: torch.Tensor, *, inclusive: bool = False) -> torch.Tensor:
    """``mask[b, j, m]`` is True when ``m`` is an ancestor of ``j`` (or ``j`` itself if ``inclusive``)."""
    batch, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device)
    incl = eye.expand(batch, n, n).clone()
    rows = torch.arange(batch, device=parents.device)
    for j in range(1, n):
        has, p = _parent_index(parents, j)
        incl[:, j] |= incl[rows, p] & has[:, None]
    return incl if inclusive else incl & ~eye


def ancestor_mask_device(parents: torch.Tensor, height: int | None = None) -> torch.Tensor:
    """Inclusive ancestor mask ``[B, N, N]`` with no host synchronisation, so it can run inside a captured CUDA
    graph: by repeated squaring of (I + parent edges), log2(N) batched products; or, given ``height`` (the most
    nodes on any root path, known to the caller), by ``height`` steps up the parents from every node: gathers and
    compares, elementwise work that inductor fuses into a few kernels."""
    batch, n = parents.shape
    node = torch.arange(n, device=parents.device)
    if height is not None:
        walk = node.expand(batch, n)  # each node, then its ancestor one level further up per step (negative past the root)
        # built as [b, m, j] (m is j or above it) and returned as its transposed view: a reduction over descendants
        # (the tree builder's) reads it in this order, and inductor then fuses the walk into that reduction
        below = torch.zeros(batch, n, n, dtype=torch.bool, device=parents.device)
        for _ in range(height):
            below = below | (walk[:, None, :] == node[None, :, None])
            walk = torch.where(walk >= 0, parents.gather(1, walk.clamp(min=0)), -1)
        return below.transpose(1, 2)
    reach = (parents[:, :, None] == node[None, None, :]) | (node[:, None] == node[None, :])
    reach = reach.float()
    for _ in range(max(n - 1, 1).bit_length()):
        reach = (reach @ reach).clamp(max=1.0)
    return reach > 0
