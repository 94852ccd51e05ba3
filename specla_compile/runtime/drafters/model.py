"""Drafting with a small causal LM that shares the target's vocabulary (attention, GDN or hybrid).

Each row keeps one cache of the drafter that only ever holds committed tokens (the prompt, accepted
tokens and the pending token, which the target sampled itself). A recurrent state cannot be
truncated, so drafting never writes into that cache: each ``propose`` first feeds the row's new
committed tokens, then copies the cache and rolls the draft out on the copy, one batch entry per
frontier node, reordering the copy's batch entries between levels like beam search
(``Cache.reorder_cache``, which transformers' and fla's caches both implement). The copy is dropped
afterwards, so rejected drafts need no rollback.
"""

from __future__ import annotations

import copy
import inspect
import os
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from ..cache_layout import cache_argument
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
            pending = torch.stack([seq[-1] for seq in request.sequences]).to(device)
            return build_draft(_Rollout(self, request, device), pending, config)

    def _forward(self, input_ids: torch.Tensor, cache: object) -> tuple[torch.Tensor, object]:
        """Logits after the last of ``input_ids [F, S]`` (``[F, V]``) and the updated cache."""
        kwargs = {self._cache_arg: cache, "use_cache": True}
        if self._keep_last:
            kwargs["logits_to_keep"] = 1
        out = self.model(input_ids=input_ids, **kwargs)
        cache = getattr(out, "cache", None)
        if cache is None or not hasattr(cache, "reorder_cache"):
            raise ValueError(
                f"{type(self.model).__name__} did not return a cache with reorder_cache(); ModelDrafter needs one"
            )
        return out.logits[:, -1], cache

    def _catch_up(self, b: int, seq: torch.Tensor) -> torch.Tensor:
        """Feed row ``b``'s committed tokens not in its cache yet; logits after the pending token (a
        repeated request for the same sequence reuses them)."""
        if b not in self._rows:
            raise ValueError(f"row {b} was not started with begin()")
        cache, length, logits = self._rows[b]
        if length > seq.shape[0]:
            raise ValueError(f"row {b}: the sequence ({seq.shape[0]} tokens) is shorter than its committed history")
        if length < seq.shape[0]:
            logits, cache = self._forward(seq[None, length:], cache)
            self._rows[b] = (cache, seq.shape[0], logits[0])
        return self._rows[b][2]


class _Rollout:
    """The tree builder's step function for one ``propose``: per row, level 0 extends the committed
    cache; later levels run on a private copy with one batch entry per frontier node."""

    def __init__(self, drafter: ModelDrafter, request: DraftRequest, device: torch.device):
        self.drafter, self.request, self.device = drafter, request, device
        self.work: list[object] = []

    def __call__(self, frontier: Frontier) -> torch.Tensor:
        if frontier.depth == 0:
            rows = zip(self.request.rows, self.request.sequences)
            return torch.stack([self.drafter._catch_up(b, seq.to(self.device)) for b, seq in rows])[:, None]
        if frontier.depth == 1:
            self.work = [copy.deepcopy(self.drafter._rows[b][0]) for b in self.request.rows]
        logits = []
        for i, (tokens, slots) in enumerate(zip(frontier.tokens, frontier.parent_slots)):
            self.work[i].reorder_cache(slots)
            row_logits, self.work[i] = self.drafter._forward(tokens[:, None], self.work[i])
            logits.append(row_logits)
        return torch.stack(logits)
