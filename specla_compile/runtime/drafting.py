"""The drafter interface: what every drafter receives and returns.

The generator owns the token history. Each iteration it asks the drafter for a :class:`Draft` of
every active row, verifies it in one target pass, accepts a path per row and tells the drafter
what was committed (:meth:`Drafter.commit`), with the target's features at those positions when
the drafter asked for them (``needs_features``). A drafter that can draft from the pass's device outputs
alone (:meth:`Drafter.propose_after`) lets the generator queue the next draft behind the pass and read
the pass's result while the device drafts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from .config import SpecConfig


@dataclass
class Draft:
    """Draft trees of a batch. Node 0 of each row is the pending token (the target's last sample).

    ``tokens [B, N]`` and ``parents [B, N]`` (topology conventions of :mod:`.topology`: -1 root,
    -2 padding at the row's tail). ``probs [B, N, V]``, when given, is the draft distribution at each
    node from which that node's children were sampled without replacement, in node-index order;
    ``None`` means the children were chosen deterministically (point masses), which lossless
    sampling also handles. ``chain``: True when every row is a chain (each node's parent the node before
    it, or padding), False when the draft is a tree whatever its rows look like, None when unknown (the
    engine then reads ``parents``: a device-to-host copy that waits for the drafter's work).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    probs: torch.Tensor | None = None
    chain: bool | None = None


@dataclass
class PassOutputs:
    """What an accepting verify pass leaves on the device, for every row of the batch, before the host has
    read any of it: the verified draft's ``tokens [B, N]``, the accepted ``path [B, N]`` (node indices from
    node 0 on, -1 padded), ``counts [B]`` (tokens each row committed: its accepted nodes up to its EOS and
    budget, 0 for a finished row), the new pending token ``next_token [B]`` and the target's last hidden state at
    every node ``hidden [B, N, D]`` (None unless the engine returns features). The next pass overwrites them."""

    tokens: torch.Tensor
    path: torch.Tensor
    counts: torch.Tensor
    next_token: torch.Tensor
    hidden: torch.Tensor | None


@dataclass
class DraftRequest:
    """What the generator knows when it asks for drafts.

    ``rows`` are the batch rows to draft for (finished rows are left out); ``sequences[i]`` is row
    ``rows[i]``'s whole token history (prompt and emitted tokens, padding removed), whose last token
    is the pending one.
    """

    rows: list[int]
    sequences: list[torch.Tensor]


def output_vocab_size(model: torch.nn.Module) -> int:
    """Size of the logits a causal LM produces (its output embedding's rows), e.g. to check a drafter."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not hasattr(head, "weight"):
        raise ValueError(
            f"{type(model).__name__} has no output embedding (get_output_embeddings()) to read its vocabulary from"
        )
    return head.weight.shape[0]


class Drafter(ABC):
    """Base class of drafters. Subclasses set ``vocab_size`` (``None`` = any vocabulary) and
    ``needs_features`` (True = wants the target's last hidden state at committed positions)."""

    vocab_size: int | None = None
    needs_features: bool = False

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``ValueError`` unless this drafter proposes tokens of a target with ``vocab_size`` logits."""
        if self.vocab_size is not None and self.vocab_size != vocab_size:
            raise ValueError(
                f"{type(self).__name__} drafts over a vocabulary of {self.vocab_size} tokens but the target has "
                f"{vocab_size}; the drafter must share the target's tokenizer"
            )

    def begin(self, sequences: list[torch.Tensor], features: list[torch.Tensor] | None = None) -> None:
        """Start of ``generate``: the prompts (one 1-D tensor per row) and, if ``needs_features``, the
        target's features over each prompt ``[T_b, D]``. Drafters reset their per-row state here."""

    @abstractmethod
    def propose(self, request: DraftRequest, config: SpecConfig) -> Draft:
        """Draft trees for ``request.rows`` (returned in that order, padded to a common size)."""

    def propose_after(self, last: PassOutputs, config: SpecConfig, max_length: int) -> Draft | None:
        """Draft every row's next tree from ``last`` alone, queued on the device behind the pass that made it,
        so that the host reads that pass's result while the device drafts (the generator's pipelined loop).
        Called after :meth:`begin` and a first :meth:`propose`; once it returned a draft the drafter's state
        follows the device, and the generator calls neither :meth:`commit` nor :meth:`propose` again before the
        next :meth:`begin`. ``max_length``: the most tokens a row can hold in this call. None (the default):
        this drafter cannot draft that way."""
        return None

    def commit(self, rows: list[int], tokens: list[torch.Tensor], features: list[torch.Tensor] | None = None) -> None:
        """Tokens newly committed to row ``rows[i]`` this iteration (the accepted path from the pending
        token on; the new pending token is not included), with the target's features at those
        positions ``[A_i, D]`` if ``needs_features``. Drafters with caches roll back rejected work here."""
