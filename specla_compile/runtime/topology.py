"""Draft topology: parent arrays, their validation, masks, paths, padding and chain decomposition.

A draft for batch row ``b`` is ``parents[b, j]`` over nodes ``j = 0..N-1`` in topological order:

* ``parents[b, j] = p`` with ``0 <= p < j``: node ``j`` continues from node ``p``;
* ``ROOT`` (-1): node ``j`` continues from the durable state (node 0, the pending token, always does);
* ``PAD`` (-2): an inert padding node. Padding fills the tail of a row up to a fixed bucket size,
  is computed as a root (so every output stays finite) and is never an ancestor of anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx
import torch

from ..tree import PAD, ROOT, ancestor_mask, depth  # noqa: F401  (the tree primitives, re-exported with the topology API)



def validate_parents(parents: torch.Tensor) -> torch.Tensor:
    """Check a ``[B, N]`` parent array and return it as int64.

    Raises ``ValueError`` naming the first offending row and node.
    """
    if not isinstance(parents, torch.Tensor):
        raise ValueError(f"parents must be a torch.Tensor, got {type(parents).__name__}")
    if parents.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"parents must be int32 or int64, got {parents.dtype}")
    if parents.dim() != 2 or parents.shape[1] == 0:
        raise ValueError(f"parents must have shape [batch, num_nodes] with num_nodes >= 1, got {tuple(parents.shape)}")
    parents = parents.long()
    host = parents.cpu()
    node = torch.arange(host.shape[1])
    checks = (
        (host < PAD, f"values below {PAD} (PAD) are not allowed"),
        (host >= node, "parents[b, j] must be < j (nodes in topological order)"),
        (host[:, :1] != ROOT, "node 0 (the pending token) must have parent -1 (ROOT)"),
        ((host[:, :-1] == PAD) & (host[:, 1:] != PAD), "padding nodes (-2) must form the tail of a row"),
    )
    for bad, why in checks:
        if bad.any():
            b, j = bad.nonzero()[0].tolist()
            raise ValueError(f"invalid parents at row {b}, node {j} (value {host[b, j].item()}): {why}")
    return parents


def num_real_nodes(parents: torch.Tensor) -> torch.Tensor:
    """Number of non-padding nodes per row, ``[B]``."""
    return (parents != PAD).sum(dim=-1)


def path_to(parents_row: torch.Tensor, node: int) -> list[int]:
    """Root-to-node path ``[root, ..., node]`` in one row."""
    row = parents_row.tolist()
    if not 0 <= node < len(row) or row[node] == PAD:
        raise ValueError(f"node {node} is not a real node of this row")
    path = [node]
    while row[path[-1]] >= 0:
        path.append(row[path[-1]])
    return path[::-1]


def parents_from_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """Convert an EAGLE-style tree attention mask to a ``[B, N]`` parent array.

    ``mask[..., i, j]`` is nonzero when node ``i`` may attend to node ``j`` (its ancestors and itself);
    accepted shapes are ``[N, N]``, ``[B, N, N]`` and ``[B, 1, N, N]``. The parent of ``i`` is its
    deepest strict ancestor, which in topological order is the last one.
    """
    if mask.dim() == 4 and mask.shape[1] == 1:
        mask = mask[:, 0]
    elif mask.dim() == 2:
        mask = mask[None]
    if mask.dim() != 3 or mask.shape[-1] != mask.shape[-2]:
        raise ValueError(f"tree mask must be [N, N], [B, N, N] or [B, 1, N, N], got {tuple(mask.shape)}")
    visible = mask != 0
    n = visible.shape[-1]
    eye = torch.eye(n, dtype=torch.bool, device=mask.device)
    if not visible[:, eye].all():
        raise ValueError("tree mask must let every node see itself (nonzero diagonal)")
    if (visible & ~torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()).any():
        raise ValueError("tree mask must be lower triangular (nodes in topological order)")
    strict = visible & ~eye
    idx = torch.arange(n, device=mask.device)
    parents = torch.where(strict.any(-1), torch.where(strict, idx, -1).amax(-1), ROOT)
    parents = validate_parents(parents)
    if not torch.equal(ancestor_mask(parents, inclusive=True), visible):
        raise ValueError("tree mask is not the ancestor mask of a tree: some node sees a non-ancestor")
    return parents


def pad_parents(parents: torch.Tensor, size: int) -> torch.Tensor:
    """Pad ``[B, N]`` parents to ``[B, size]`` with inert ``PAD`` nodes."""
    parents = validate_parents(parents)
    n = parents.shape[1]
    if size < n:
        raise ValueError(f"cannot pad {n} nodes down to a bucket of {size}")
    return torch.nn.functional.pad(parents, (0, size - n), value=PAD)


def bucket_size(num_nodes: int, multiple: int = 16) -> int:
    """Smallest multiple of ``multiple`` holding ``num_nodes`` nodes."""
    return -(-num_nodes // multiple) * multiple


def tree_graph(parents_row: torch.Tensor) -> nx.DiGraph:
    """The forest of one row as a networkx DiGraph (edges parent -> child), padding left out."""
    graph = nx.DiGraph()
    for j, p in enumerate(parents_row.tolist()):
        if p == PAD:
            break
        graph.add_node(j)
        if p >= 0:
            graph.add_edge(p, j)
    return graph


@dataclass(frozen=True)
class ChainDecomposition:
    """Heavy-light decomposition of one row's tree into chains.

    ``chains[c]`` lists its nodes root-side first; ``boundary[c]`` is the parent of its first node
    (-1 when it starts from the durable state); ``level[c]`` is 0 for chains starting at a root and
    one more than the level of the chain holding its boundary node otherwise, so chains of one level
    can run in parallel once every lower level has run.
    """

    chains: tuple[tuple[int, ...], ...]
    boundary: tuple[int, ...]
    level: tuple[int, ...]

    @property
    def ready_levels(self) -> list[list[int]]:
        """Chain indices grouped by level, lowest level first."""
        levels: list[list[int]] = [[] for _ in range(max(self.level) + 1)]
        for c, lvl in enumerate(self.level):
            levels[lvl].append(c)
        return levels

    @property
    def boundary_nodes(self) -> list[int]:
        """Nodes whose state other chains start from (the only states a serial kernel must store)."""
        return sorted({b for b in self.boundary if b >= 0})

    def to_tensors(self, device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
        """Padded tensors for kernels: ``nodes [C, Lmax]`` (-1 padded), ``length``, ``boundary``, ``level``."""
        longest = max(len(c) for c in self.chains)
        nodes = torch.full((len(self.chains), longest), -1, dtype=torch.long)
        for c, chain in enumerate(self.chains):
            nodes[c, : len(chain)] = torch.tensor(chain)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
        return {
            "nodes": nodes.to(device),
            "length": as_tensor([len(c) for c in self.chains]),
            "boundary": as_tensor(self.boundary),
            "level": as_tensor(self.level),
        }


def chain_decomposition(parents_row: torch.Tensor) -> ChainDecomposition:
    """Heavy-light chains of one row: every node continues into its child with the largest subtree
    (ties go to the earliest child, usually the most likely draft)."""
    if parents_row.dim() != 1:
        raise ValueError(f"chain_decomposition takes one row of parents, got shape {tuple(parents_row.shape)}")
    graph = tree_graph(validate_parents(parents_row[None])[0])
    size = {n: len(nx.descendants(graph, n)) + 1 for n in graph}
    heavy = {n: min(graph.successors(n), key=lambda c: (-size[c], c)) for n in graph if graph.out_degree(n)}
    chain_of: dict[int, int] = {}
    chains, boundary, level = [], [], []
    for start in sorted(n for n in graph if graph.in_degree(n) == 0 or heavy[next(graph.predecessors(n))] != n):
        parent = next(graph.predecessors(start), ROOT)
        chain = [start]
        while chain[-1] in heavy:
            chain.append(heavy[chain[-1]])
        for n in chain:
            chain_of[n] = len(chains)
        chains.append(tuple(chain))
        boundary.append(parent)
        level.append(0 if parent == ROOT else level[chain_of[parent]] + 1)
    return ChainDecomposition(tuple(chains), tuple(boundary), tuple(level))
