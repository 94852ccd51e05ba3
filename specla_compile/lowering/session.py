"""Verification session: what the runtime hands the compiled graphs, and what they hand back.

A :class:`VerifySession` lives for one generation of the dynamic path, or for the life of one static
engine bucket (``static=True``: its pending buffers are the bucket's static inputs). Inside ``with session.verify(parents, tree_mask):``
every call of a ``specla``-compiled graph runs its verification twin: it commits the session's pending
accepted records, verifies the tree, and leaves each GDN layer's new per-node records in
``session.records``. :meth:`VerifySession.accept` gathers the accepted path of every layer into the
pending records (only those nodes' factor records, no dense states); the next verification
commits them first (delayed update); :meth:`VerifySession.flush` commits what is still pending, after
which the model's cache equals the cache of plain decoding.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from ..kernels import ops
from ..tree import gather_nodes


@dataclass
class LayerBinding:
    """The durable tensors of one GDN layer: its recurrent state as the verify op sees it (a view of
    the cache tensor) and its conv states."""

    state: torch.Tensor
    conv_states: list[torch.Tensor]


@dataclass
class DraftInputs:
    parents: torch.Tensor
    tree_mask: torch.Tensor | None


@dataclass
class VerifySession:
    """Pending and fresh factor records of every GDN layer, keyed by the ``data_ptr()`` of the layer's
    recurrent-state tensor."""

    pending: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    num_pending: torch.Tensor | None = None
    records: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    layers: dict[int, LayerBinding] = field(default_factory=dict)
    draft: DraftInputs | None = None
    static: bool = False

    @contextlib.contextmanager
    def verify(self, parents: torch.Tensor, tree_mask: torch.Tensor | None = None) -> Iterator[VerifySession]:
        """Calls of ``specla``-compiled graphs inside this block verify the draft ``parents [B, N]``."""
        self.draft = DraftInputs(parents, tree_mask)
        self.records = {}
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)
            self.draft = None

    def take_pending(self, key: int, batch: int, nodes: int, shapes: list[tuple[tuple[int, ...], torch.dtype]], device) -> list[torch.Tensor]:
        """Hand one layer's pending tensors, padded to ``nodes``, to the graph that commits them (zeros
        when nothing is pending)."""
        if self.static:
            if key not in self.pending:
                self.pending[key] = [torch.zeros(batch, nodes, *shape, dtype=dtype, device=device) for shape, dtype in shapes]
            return self.pending[key]
        pending = self.pending.pop(key, None)
        if pending is None:
            return [torch.zeros(batch, nodes, *shape, dtype=dtype, device=device) for shape, dtype in shapes]
        if pending[0].shape[1] > nodes:
            raise ValueError(f"{pending[0].shape[1]} pending records do not fit a draft of {nodes} nodes")
        pad = nodes - pending[0].shape[1]
        return [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in pending]

    def pending_count(self, batch: int, device) -> torch.Tensor:
        if self.static and self.num_pending is None:
            self.num_pending = torch.zeros(batch, dtype=torch.long, device=device)
        if self.num_pending is None:
            return torch.zeros(batch, dtype=torch.long, device=device)
        return self.num_pending

    def accept(self, accepted: torch.Tensor, num_accepted: torch.Tensor, *, prefix: bool = False) -> None:
        """Keep the accepted path ``accepted [B, A]`` (node indices; entries past ``num_accepted[b]`` are
        ignored) of every layer's fresh records as its pending records. ``prefix``: every accepted path
        is ``0, 1, ..., A-1`` (chains), so the records need no gather."""
        if not self.records:
            raise RuntimeError("accept() needs a verification pass first")
        if self.static:  # in place, so that a captured pass sees them (no host checks: they would synchronise)
            self._accept_in_place(accepted, prefix)
            self.num_pending.copy_(num_accepted)
            return
        if self.pending:
            raise RuntimeError("pending records of some layers were never committed by a verification pass")
        self.pending = {key: [gather_nodes(t, accepted) for t in records] for key, records in self.records.items()}
        self.num_pending = num_accepted.to(torch.long)
        self.records = {}

    def _accept_in_place(self, accepted: torch.Tensor, prefix: bool) -> None:
        """Static sessions: a prefix is one multi-tensor copy per dtype (a few launches for every layer);
        a tree path is one gather of every record, written straight into the pending buffers (on CUDA a few
        launches in all: ``triton_gather``)."""
        pairs = [(buffer, fresh) for key, records in self.records.items() for buffer, fresh in zip(self.pending[key], records)]
        if prefix:
            for dtype in {buffer.dtype for buffer, _ in pairs}:
                same = [(b, f) for b, f in pairs if b.dtype == dtype]
                torch._foreach_copy_([b for b, _ in same], [f for _, f in same])
            return
        ops.gather_paths_([buffer for buffer, _ in pairs], [fresh for _, fresh in pairs], accepted)

    def flush(self) -> None:
        """Commit every pending record into the model's cache now."""
        for key, pending in self.pending.items():
            layer = self.layers[key]
            ops.gdn_commit_(layer.state, *pending[:4], self.num_pending)
            for conv_state, x in zip(layer.conv_states, pending[4:]):
                ops.conv_state_commit_(conv_state, x, self.num_pending)
        if self.static:
            if self.num_pending is not None:
                self.num_pending.zero_()
            return
        self.pending = {}
        self.num_pending = None


_ACTIVE: contextvars.ContextVar[VerifySession | None] = contextvars.ContextVar("specla_verify_session", default=None)


def active_session() -> VerifySession | None:
    """The session whose ``verify`` block is running, if any."""
    return _ACTIVE.get()
