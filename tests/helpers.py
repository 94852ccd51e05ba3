"""Shared test helpers: random topologies and random GDN inputs (never zeros)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from specla_compile.runtime.topology import PAD


@st.composite
def parent_rows(draw, max_nodes: int = 16, forest: bool = True) -> list[int]:
    """One topologically ordered row: node 0 is a root, node j's parent is drawn from [-1 or 0, j)."""
    n = draw(st.integers(1, max_nodes))
    low = -1 if forest else 0
    return [-1] + [draw(st.integers(low, j - 1)) for j in range(1, n)]


@st.composite
def parent_batches(draw, max_rows: int = 3, max_nodes: int = 16, extra_padding: int = 3) -> torch.Tensor:
    """[B, N] parents: rows of different sizes padded with PAD to a common size (plus optional extra)."""
    rows = draw(st.lists(parent_rows(max_nodes), min_size=1, max_size=max_rows))
    size = max(len(r) for r in rows) + draw(st.integers(0, extra_padding))
    return torch.tensor([r + [PAD] * (size - len(r)) for r in rows], dtype=torch.long)


def random_gdn_inputs(
    parents: torch.Tensor,
    *,
    heads: int = 2,
    value_heads: int = 4,
    dk: int = 8,
    dv: int = 8,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
    normalized_keys: bool = True,
) -> dict[str, torch.Tensor]:
    """q, k, v, g, beta and an initial state for ``parents``. When ``normalized_keys`` is set, keys
    are unit vectors (as after l2norm) so the recurrence stays a contraction without normalizing."""
    gen = torch.Generator().manual_seed(seed)
    batch, n = parents.shape
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    k = randn(batch, n, heads, dk)
    if normalized_keys:
        k = k / k.norm(dim=-1, keepdim=True)
    inputs = {
        "q": randn(batch, n, heads, dk),
        "k": k,
        "v": randn(batch, n, value_heads, dv),
        "g": -torch.rand(batch, n, value_heads, generator=gen, dtype=torch.float64) * 0.7 - 0.01,
        "beta": torch.rand(batch, n, value_heads, generator=gen, dtype=torch.float64) * 0.9 + 0.05,
        "initial_state": randn(batch, value_heads, dk, dv),
    }
    return {name: t.to(dtype) for name, t in inputs.items()}


def path_recurrence(inputs: dict[str, torch.Tensor], path: list[int], row: int, scale: float, use_qk_l2norm: bool):
    """Independent oracle: walk one root-to-node path of one row with the matrix form
    S' = alpha (I - beta k k^T) S + beta k v^T and return (o of the last node, its state) per value head."""
    q, k, v, g, beta = (inputs[n][row].double() for n in ("q", "k", "v", "g", "beta"))
    state = inputs["initial_state"][row].double().clone()
    value_heads, dk = state.shape[0], state.shape[1]
    group = value_heads // q.shape[1]
    eye = torch.eye(dk, dtype=torch.float64)
    outs = []
    for h in range(value_heads):
        s = state[h]
        for j in path:
            kj, qj = k[j, h // group], q[j, h // group]
            if use_qk_l2norm:
                kj = kj / torch.sqrt((kj * kj).sum() + 1e-6)
                qj = qj / torch.sqrt((qj * qj).sum() + 1e-6)
            b = beta[j, h]
            s = torch.exp(g[j, h]) * (eye - b * torch.outer(kj, kj)) @ s + b * torch.outer(kj, v[j, h])
        outs.append((scale * s.T @ qj, s))
    return torch.stack([o for o, _ in outs]), torch.stack([s for _, s in outs])
