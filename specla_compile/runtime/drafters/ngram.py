"""Prompt-lookup drafting: continue the text the way it continued after earlier copies of its suffix."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..config import SpecConfig
from ..drafting import Draft, Drafter, DraftRequest
from ..tree_builder import draft_from_paths


class NgramDrafter(Drafter):
    """Parameter-free prompt lookup over each row's whole history (prompt and generated tokens).

    The last ``n`` tokens (``n`` from ``max_ngram`` down to ``min_ngram``) are searched for earlier in
    the history; the tokens that followed a match are a candidate continuation. Longer n-grams rank
    first, then more recent matches. Chain mode drafts the best continuation (``depth`` tokens); tree
    mode merges the ``tree_top_k`` best distinct continuations into a trie (shared prefixes share nodes),
    each at most ``depth`` tokens, at most ``budget`` nodes in all. A row with no match drafts only
    its pending token.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, request: DraftRequest, config: SpecConfig) -> Draft:
        if not request.sequences:
            raise ValueError("DraftRequest has no rows to draft for")
        pending = torch.stack([seq[-1] for seq in request.sequences])
        if config.mode == "chain":
            branches, budget = 1, config.depth
        else:
            branches, budget = config.tree_top_k, config.budget
        rows = [self._trie(seq.cpu(), config.depth, branches, budget) for seq in request.sequences]
        return draft_from_paths(pending, rows)

    def continuations(self, seq: torch.Tensor, length: int) -> Iterator[list[int]]:
        """Continuations of ``seq`` (1-D) after earlier copies of its suffix, best first (longest n-gram,
        then most recent), each at most ``length`` tokens; the suffix itself is never a match."""
        n = seq.shape[0]
        for size in range(min(self.max_ngram, n - 1), self.min_ngram - 1, -1):
            # Windows starting at 0..n-1-size: every one has a following token, the suffix is excluded.
            windows = seq[: n - 1].unfold(0, size, 1)
            starts = (windows == seq[n - size :]).all(-1).nonzero()[:, 0].flip(0)
            for start in starts.tolist():
                yield seq[start + size : start + size + length].tolist()

    def _trie(self, seq: torch.Tensor, depth: int, branches: int, budget: int) -> list[tuple[int, int]]:
        """Merge the best distinct continuations into ``(token, parent node)`` lists (node 0 = pending)."""
        nodes: list[tuple[int, int]] = []
        child: dict[tuple[int, int], int] = {}
        added = 0
        for tokens in self.continuations(seq, depth):
            if added == branches or len(nodes) == budget:
                break
            parent, grew = 0, False
            for token in tokens:
                if (parent, token) not in child:
                    if len(nodes) == budget:
                        break
                    nodes.append((token, parent))
                    child[(parent, token)] = len(nodes)
                    grew = True
                parent = child[(parent, token)]
            added += grew
        return nodes
