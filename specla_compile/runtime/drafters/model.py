"""Drafting with a small causal LM that shares the target's vocabulary (attention, GDN or hybrid).

Each row keeps one cache of the drafter that only ever holds committed tokens (the prompt, accepted
tokens and the pending token, which the target sampled itself). A recurrent state cannot be
truncated, so drafting never writes into those caches: each ``propose`` first feeds the rows' new
committed tokens (rows with as many new tokens in one forward), then stacks the rows' caches into one
batched copy and rolls the draft out on it, one forward per level for the whole batch, with one batch
entry per (row, frontier node), reordered between levels like beam search (``Cache.reorder_cache``).
Attention K/V of rows of different lengths are left-padded and masked (:func:`stack_rows`). The copy
is dropped afterwards, so rejected drafts need no rollback. Caches must be laid out as fla's ``Cache``
or transformers' ``DynamicCache`` (:func:`~specla_compile.runtime.cache_layout.cache_slots`).
"""

from __future__ import annotations

import inspect
import os
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from ..cache_layout import (
    cache_argument,
    has_attention,
    left_padding_mask,
    past_columns_inputs,
    returned_cache,
    split_rows,
    stack_rows,
)
from ..config import SpecConfig
from ..drafting import Draft, Drafter, DraftRequest, output_vocab_size
from ..tree_builder import Frontier, build_draft


class ModelDrafter(Drafter):
    """Drafts with ``model`` (any Hugging Face-style causal LM returning a cache), chain or tree per
    :class:`SpecConfig`, through the tree builder."""

    def __init__(self, model: nn.Module):
        self.model = model.eval()
        self.vocab_size = output_vocab_size(model)
        self._cache_arg = cache_argument(model)
        self._keep_last = "logits_to_keep" in inspect.signature(model.forward).parameters
        # row -> (committed cache, number of tokens in it, logits after its last token)
        self._rows: dict[int, tuple[object, int, torch.Tensor | None]] = {}

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, device: torch.device | str | None = None, **kwargs: Any
    ) -> ModelDrafter:
        """Load the drafter LM with ``AutoModelForCausalLM.from_pretrained(path, **kwargs)`` onto
        ``device`` (a drafter is not a module: move the LM before wrapping it)."""
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        return cls(model if device is None else model.to(device))

    def begin(self, sequences: list[torch.Tensor], features: list[torch.Tensor] | None = None) -> None:
        self._rows = {b: (None, 0, None) for b in range(len(sequences))}

    def propose(self, request: DraftRequest, config: SpecConfig) -> Draft:
        if not request.rows:
            raise ValueError("DraftRequest has no rows to draft for")
        device = next(self.model.parameters()).device
        with torch.no_grad():
            sequences = [seq.to(device) for seq in request.sequences]
            self._catch_up(request.rows, sequences)
            pending = torch.stack([seq[-1] for seq in sequences])
            return build_draft(_Rollout(self, request.rows), pending, config)

    def _forward(
        self, input_ids: torch.Tensor, cache: object, valid: torch.Tensor | None
    ) -> tuple[torch.Tensor, object]:
        """Logits after the last of ``input_ids [F, S]`` (``[F, V]``) and the updated cache. ``valid [F, C]``
        marks which of the cache's ``C`` attention columns hold tokens (``None``: no attention columns)."""
        kwargs = {self._cache_arg: cache, "use_cache": True}
        if self._keep_last:
            kwargs["logits_to_keep"] = 1
        if valid is not None:  # rows' K/V are left-padded to a common width
            kwargs.update(past_columns_inputs(valid, input_ids.shape[1]))
        out = self.model(input_ids=input_ids, **kwargs)
        cache = returned_cache(out)
        if cache is None or not hasattr(cache, "reorder_cache"):
            raise ValueError(
                f"{type(self.model).__name__} did not return a cache with reorder_cache(); ModelDrafter needs one"
            )
        return out.logits[:, -1], cache

    def _catch_up(self, rows: list[int], sequences: list[torch.Tensor]) -> None:
        """Feed every row's committed tokens not in its cache yet (a repeated request for the same
        sequence feeds nothing). Rows with as many new tokens share one forward: padding the new tokens
        instead would run the padding through the rows' recurrent states."""
        groups: dict[tuple[bool, int], list[tuple[int, torch.Tensor]]] = {}
        for b, seq in zip(rows, sequences):
            if b not in self._rows:
                raise ValueError(f"row {b} was not started with begin()")
            length = self._rows[b][1]
            if length > seq.shape[0]:
                raise ValueError(f"row {b}: the sequence ({seq.shape[0]} tokens) is shorter than its committed history")
            if length < seq.shape[0]:
                groups.setdefault((length == 0, seq.shape[0] - length), []).append((b, seq))
        for (fresh, new), group in groups.items():
            lengths = [self._rows[b][1] for b, _ in group]
            cache = None if fresh else stack_rows([self._rows[b][0] for b, _ in group], lengths)
            tokens = torch.stack([seq[-new:] for _, seq in group])
            logits, cache = self._forward(tokens, cache, _valid_columns(cache, lengths, tokens.device))
            lengths = [length + new for length in lengths]
            for (b, _), row_cache, length, row_logits in zip(group, split_rows(cache, lengths), lengths, logits):
                self._rows[b] = (row_cache, length, row_logits)


def _valid_columns(cache: object, lengths: list[int], device: torch.device) -> torch.Tensor | None:
    """Which attention columns of a :func:`stack_rows` cache hold tokens; ``None`` without attention."""
    if cache is None or not has_attention(cache):
        return None
    return left_padding_mask(torch.tensor(lengths, device=device))


class _Rollout:
    """The tree builder's step function for one ``propose``: level 0 reads the logits after the pending
    tokens; every later level runs all rows' frontier nodes in one forward, on a stacked copy of the
    rows' committed caches with one batch entry per (row, frontier slot)."""

    def __init__(self, drafter: ModelDrafter, rows: list[int]):
        entries = [drafter._rows[b] for b in rows]
        lengths = [length for _, length, _ in entries]
        self.drafter = drafter
        self.logits = torch.stack([logits for _, _, logits in entries])
        self.cache = stack_rows([cache for cache, _, _ in entries], lengths)
        self.valid = _valid_columns(self.cache, lengths, self.logits.device)
        self.width = 1  # frontier slots per row held by the cache's batch entries

    def __call__(self, frontier: Frontier) -> torch.Tensor:
        if frontier.depth == 0:
            return self.logits[:, None]
        rows, width = frontier.tokens.shape
        # Entry r * width + w continues from entry r * self.width + parent_slots[r, w] (beam-search reorder).
        first_entry = torch.arange(rows, device=frontier.tokens.device)[:, None] * self.width
        parents = (first_entry + frontier.parent_slots).flatten()
        self.cache.reorder_cache(parents)
        valid = None if self.valid is None else self.valid[parents]
        logits, self.cache = self.drafter._forward(frontier.tokens.reshape(-1, 1), self.cache, valid)
        if valid is not None:
            self.valid = torch.cat([valid, torch.ones_like(valid[:, :1])], dim=1)
        self.width = width
        return logits.view(rows, width, -1)
