"""EAGLE drafting at run time: the head's per-row KV cache over committed positions and tree rollouts.

Pair ``t`` of a row is (target feature f_t, token x_{t+1}). A row's cache only ever holds pairs made of
real target features and committed tokens: at each ``propose`` the pairs not cached yet are run (the
last one pairs the newest feature with the pending token, which the target sampled itself, so it is
committed too). Draft nodes beyond the pending token use the head's own predicted features; they live
in a scratch buffer for the duration of one ``propose`` and are dropped afterwards, which is the
rollback: whatever the target rejects never reaches the cache, and accepted tokens are re-run with the
target's real features at the next ``propose``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from ..config import SpecConfig
from ..drafting import Draft, Drafter, DraftRequest
from ..tree_builder import Frontier, build_draft
from .eagle_head import EagleHead


@dataclass
class _Row:
    keys: torch.Tensor  # [H, cached pairs, d]
    values: torch.Tensor
    features: torch.Tensor  # [not yet paired, D]: committed features waiting for their pair
    last_hidden: torch.Tensor | None = None  # head output at the newest cached pair

    @property
    def cached(self) -> int:
        return self.keys.shape[1]


def _stack(rows: list[_Row]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cached keys and values of ``rows`` right-padded into ``[R, H, L, d]``, and the ``[R, L]`` validity mask."""
    length = max(r.cached for r in rows)
    keys = torch.stack([nn.functional.pad(r.keys, (0, 0, 0, length - r.cached)) for r in rows])
    values = torch.stack([nn.functional.pad(r.values, (0, 0, 0, length - r.cached)) for r in rows])
    lengths = torch.tensor([r.cached for r in rows], device=keys.device)
    return keys, values, torch.arange(length, device=keys.device) < lengths[:, None]


def _gather_slots(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``t [R, W', ...]`` taken at ``slots [R, W]`` along dim 1."""
    index = slots.view(*slots.shape, *[1] * (t.dim() - 2)).expand(-1, -1, *t.shape[2:])
    return t.gather(1, index)


class EagleDrafter(Drafter):
    """Drafts with an :class:`EagleHead` on the target's features, through the tree builder.

    ``target`` supplies the (frozen) input embeddings and LM head; ``needs_features`` is True: the
    generator passes the target's last hidden state over the prompt to :meth:`begin` and at the newly
    committed positions to :meth:`commit`.
    """

    needs_features = True

    def __init__(self, head: EagleHead, target: nn.Module):
        head.config.check_target(target)
        self.head = head.eval()
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.vocab_size = head.config.vocab_size
        self._rows: dict[int, _Row] = {}

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, target: nn.Module, dtype: torch.dtype | None = None
    ) -> EagleDrafter:
        """Load a head saved by :meth:`save_pretrained` (or the training script) for ``target``,
        on the device of the target's embeddings."""
        return cls(
            EagleHead.from_pretrained(path, device=target.get_input_embeddings().weight.device, dtype=dtype), target
        )

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Save the head (config.json + model.safetensors); the target's weights are not included."""
        self.head.save_pretrained(path)

    @property
    def _dtype(self) -> torch.dtype:
        return self.head.fuse.weight.dtype

    def begin(self, sequences: list[torch.Tensor], features: list[torch.Tensor] | None = None) -> None:
        if features is None or len(features) != len(sequences):
            raise ValueError("EagleDrafter.begin needs the target's features over every prompt (needs_features=True)")
        cfg, device = self.head.config, self.head.fuse.weight.device
        empty = torch.empty(cfg.num_heads, 0, cfg.head_dim, device=device, dtype=self._dtype)
        self._rows = {}
        for b, feats in enumerate(features):
            self._check_features(feats, f"features[{b}]")
            self._rows[b] = _Row(empty, empty, feats.to(device, self._dtype))

    def commit(self, rows: list[int], tokens: list[torch.Tensor], features: list[torch.Tensor] | None = None) -> None:
        if features is None or len(features) != len(rows):
            raise ValueError("EagleDrafter.commit needs the target's features at the committed positions")
        for b, toks, feats in zip(rows, tokens, features):
            self._check_features(feats, f"features of row {b}")
            if feats.shape[0] != len(toks):
                raise ValueError(f"row {b}: {len(toks)} committed tokens but {feats.shape[0]} feature rows")
            row = self._row(b)
            row.features = torch.cat([row.features, feats.to(row.features)])

    def propose(self, request: DraftRequest, config: SpecConfig) -> Draft:
        if not request.rows:
            raise ValueError("DraftRequest has no rows to draft for")
        rows = [self._row(b) for b in request.rows]
        with torch.no_grad():
            self._catch_up(rows, request)
            pending = torch.stack([seq[-1] for seq in request.sequences]).to(self.head.fuse.weight.device)
            return build_draft(_TreeRollout(self, rows), pending, config)

    def _row(self, b: int) -> _Row:
        if b not in self._rows:
            raise ValueError(f"row {b} was not started with begin()")
        return self._rows[b]

    def _check_features(self, feats: torch.Tensor, what: str) -> None:
        if feats.dim() != 2 or feats.shape[1] != self.head.config.hidden_size:
            raise ValueError(f"{what} must be [positions, {self.head.config.hidden_size}], got {tuple(feats.shape)}")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target LM head over predicted features."""
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))

    def _catch_up(self, rows: list[_Row], request: DraftRequest) -> None:
        """Cache every pair up to the one holding the pending token, all rows in one head call."""
        todo = []
        for b, row, seq in zip(request.rows, rows, request.sequences):
            new = seq.shape[0] - 1 - row.cached  # pairs (f_t, x_{t+1}) for t = cached .. len - 2
            if new > row.features.shape[0]:
                raise ValueError(
                    f"row {b}: the sequence has {seq.shape[0]} tokens but only {row.cached + row.features.shape[0]} "
                    "target features were given (begin/commit must cover every token but the pending one)"
                )
            if new < 0:
                raise ValueError(f"row {b}: the sequence ({seq.shape[0]} tokens) is shorter than its committed history")
            if new == 0 and row.last_hidden is None:
                raise ValueError(
                    f"row {b}: EAGLE needs at least one committed token (and its feature) before the pending one"
                )
            if new:
                todo.append((row, seq[row.cached + 1 :].to(row.keys.device), new))
        if not todo:
            return
        keys, values, valid = _stack([row for row, _, _ in todo])
        width = max(new for _, _, new in todo)
        device = keys.device
        tokens = torch.stack([nn.functional.pad(t, (0, width - n)) for _, t, n in todo])
        feats = torch.stack([nn.functional.pad(r.features[:n], (0, 0, 0, width - n)) for r, _, n in todo])
        offsets = torch.tensor([r.cached for r, _, _ in todo], device=device)
        counts = torch.tensor([n for _, _, n in todo], device=device)
        slot = torch.arange(width, device=device)
        # New pairs see the row's valid cache and earlier new pairs; padding pairs also see themselves.
        own = (slot[None, None, :] <= slot[None, :, None]) & (
            (slot[None, None, :] < counts[:, None, None]) | torch.eye(width, dtype=torch.bool, device=device)
        )
        mask = torch.cat([valid[:, None, :].expand(-1, width, -1), own], dim=-1)
        hidden, k, v = self.head(
            feats, self.embed(tokens).to(self._dtype), offsets[:, None] + slot, mask, (keys, values)
        )
        for i, (row, _, n) in enumerate(todo):
            row.keys = torch.cat([row.keys, k[i, :, :n]], dim=1)
            row.values = torch.cat([row.values, v[i, :, :n]], dim=1)
            row.features = row.features[n:]
            row.last_hidden = hidden[i, n - 1]


class _TreeRollout:
    """The tree builder's step function over one ``propose``: frontier nodes attend to the rows'
    cached pairs and to their own draft ancestors, held in a scratch buffer."""

    def __init__(self, drafter: EagleDrafter, rows: list[_Row]):
        self.drafter = drafter
        self.keys, self.values, self.valid = _stack(rows)  # valid covers the cached pairs only
        self.hidden = torch.stack([r.last_hidden for r in rows])[:, None]  # [R, W, D] of the current frontier
        self.base = torch.tensor([r.cached - 1 for r in rows], device=self.keys.device)  # pending pair's position
        self.seen = torch.zeros(len(rows), 1, 0, dtype=torch.bool, device=self.keys.device)  # [R, W, scratch]

    def __call__(self, frontier: Frontier) -> torch.Tensor:
        if frontier.depth > 0:
            self._advance(frontier)
        return self.drafter.logits(self.hidden)

    def _advance(self, frontier: Frontier) -> None:
        rows, width = frontier.tokens.shape
        slots = frontier.parent_slots
        parent_hidden, ancestors = _gather_slots(self.hidden, slots), _gather_slots(self.seen, slots)
        eye = torch.eye(width, dtype=torch.bool, device=slots.device).expand(rows, -1, -1)
        mask = torch.cat([self.valid[:, None, :].expand(-1, width, -1), ancestors, eye], dim=-1)
        positions = (self.base + frontier.depth)[:, None].expand(-1, width)
        embeds = self.drafter.embed(frontier.tokens).to(self.drafter._dtype)
        self.hidden, k, v = self.drafter.head(parent_hidden, embeds, positions, mask, (self.keys, self.values))
        self.keys, self.values = torch.cat([self.keys, k], 2), torch.cat([self.values, v], 2)
        self.seen = torch.cat([ancestors, eye], dim=-1)
