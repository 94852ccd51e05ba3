"""Each row's token history on the host during a static run, in one preallocated numpy buffer.

The loop appends a few tokens to every row per iteration and hands drafters each row's whole history
as a tensor. With a tensor per row that is a ``torch.tensor`` and a ``torch.cat`` to append and another
``torch.cat`` to add the pending token, 2-3 us of host time each on this project's CPU (16 rows: about
0.13 ms an iteration, while the GPU waits for the next draft); a numpy slice assignment costs 0.3 us and a
tensor viewing the buffer 0.7 us. (On the H200's host the gain was not established: see docs/speed.md.) Positions below a row's length never change once written, so the views a drafter
keeps stay valid.
"""

from __future__ import annotations

import numpy as np
import torch


class TokenRows:
    """``rows`` (1-D int64 CPU tensors, one per batch row) with room for ``width`` tokens a row."""

    def __init__(self, rows: list[torch.Tensor], width: int) -> None:
        longest = max(r.numel() for r in rows)
        if width < longest + 1:
            raise ValueError(f"width {width} leaves no room for a pending token after a {longest}-token row")
        self.tokens = np.zeros((len(rows), width), dtype=np.int64)
        self.lengths = [r.numel() for r in rows]
        for b, r in enumerate(rows):
            self.tokens[b, : r.numel()] = r.cpu().numpy()

    def with_pending(self, row: int, token: int) -> torch.Tensor:
        """Row ``row``'s history followed by ``token`` (the pending token, not committed yet): a view."""
        end = self.lengths[row]
        self.tokens[row, end] = token
        return torch.from_numpy(self.tokens[row, : end + 1])

    def append(self, row: int, tokens: list[int]) -> torch.Tensor:
        """Commit ``tokens`` to row ``row``'s history; returns them (a view)."""
        start = self.lengths[row]
        end = start + len(tokens)
        if end > self.tokens.shape[1]:
            raise ValueError(f"row {row} would hold {end} tokens, more than its {self.tokens.shape[1]}")
        self.tokens[row, start:end] = tokens
        self.lengths[row] = end
        return torch.from_numpy(self.tokens[row, start:end])
