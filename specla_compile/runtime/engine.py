"""The static decode engine: every target pass replays one captured step over static buffers.

As in gpt-fast, the durable cache lives in tensors allocated once (per batch size) and updated in place,
and the draft of every pass is written into static buffers (``tokens``, ``parents``). One step per bucket
(node count N, chain or tree, who accepts, sampling warpers) runs the compiled model's verification twin on
them, accepts on the device (greedily, or by lossless rejection sampling on uniforms drawn before the pass),
gathers the accepted factor records into the static pending buffers (committed inside the next pass),
compacts attention K/V and advances the committed lengths. On CUDA that step is captured as a CUDA graph
at its first use and replayed afterwards; a smaller tree replays its bucket's graph with inert padding.
The host synchronises once per pass, to read the accepted path, and waits for that pass alone
(:meth:`StaticEngine.launch`, :meth:`StaticEngine.collect`): a drafter can queue the next draft behind it
first, from the pass's device outputs, and the next pass can be queued behind that draft before the host reads
(every accepting pass stops rows at EOS and at their budgets itself), so the device runs pass after pass while
the host reads. Plain decoding (greedy or sampled) runs the loop on
the device (:meth:`StaticEngine.queue_steps`, :meth:`StaticEngine.read_steps`): each replay of the 1-node
graph feeds its token to the next and stops a row at EOS, and the host reads ``PLAIN_STEPS`` tokens per
synchronisation while the device runs the ``PLAIN_LOOKAHEAD`` passes queued behind them. Where graphs are
captured, the step's acceptance and bookkeeping after the model run as one inductor-compiled function
(:func:`accept_pass_`): a few kernels instead of about sixty small eager ones.

A pass with no active row commits nothing (count 0), which makes the warm-up and capture runs of a new
bucket side-effect free once the pending records are flushed.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch
from torch.fx.experimental import _config as fx_config

from ..kernels.dispatch import TopologyHint, commits_before_wait, topology_hint
from ..lowering.session import VerifySession
from ..tree import PAD, ancestor_mask_device
from .acceptance import Acceptance, cut_at_stop, greedy_accept_device, sample_accept_device, warp_probs
from .cache_layout import (
    cache_argument,
    cache_slots,
    gdn_states,
    load_static,
    same_layout,
    set_fla_seen_tokens,
    set_seen_tokens,
    static_twin,
    store_static,
)
from .drafting import PassOutputs
from .graph_capture import capture

log = logging.getLogger("specla_compile")


# One Dynamo graph for every bucket size (the node dimension dynamic from the first pass): Dynamo traces
# the whole model once (several seconds at the 1.3B shape, most of a warm start), and the backend compiles
# a static verification twin per size from it (backend.SpeculativeGraph). Off, Dynamo traces the 1-node
# pass, then again at the second size, where it makes the node dimension dynamic.
ONE_GRAPH = True

# Plain decoding: passes read per host synchronisation (gpt-fast reads its tokens once per call;
# this keeps streaming and EOS within a few tokens), and EOS ids the device checks. While the host reads a
# block, the device runs PLAIN_LOOKAHEAD passes queued behind it: the host's time between two blocks (on the
# H200 0.1-0.2 ms per token at the 1.3B shape without them) hides behind them, and a call whose rows all end
# at EOS pays at most that many passes of no work. The device logs its tokens in a ring of LOG_SLOTS passes.
PLAIN_STEPS = 16
PLAIN_LOOKAHEAD = 4
LOG_SLOTS = 2 * PLAIN_STEPS
EOS_SLOTS = 8
NO_BUDGET = 1 << 62  # a row's budget until begin_generation sets one
MAX_IN_FLIGHT = 2  # accepting passes launched and not collected (StaticEngine.launch)


def eos_fits(eos: list[int]) -> bool:
    """Whether the device can check these EOS ids in every pass (at most ``EOS_SLOTS`` distinct ones)."""
    return len(set(eos)) <= EOS_SLOTS


# Prompts run through the engine (StaticEngine.prefill): first, tokens that every row has, as chunks of these
# lengths (longest first), each one replay of the model's own forward (fla's kernels: the chunked recurrence past
# 64 tokens) captured per length; the rest as chains of PREFILL_NODES tokens through the verify pass (the bucket
# that speculative routes use anyway), which carry rows of different lengths. A verify pass costs about its token
# count past 16 (on the H200 at the trained study's shape 0.8 ms for 16 tokens, 2.5 ms for 64); with the chunks
# that study's prompts (175 tokens on average) took 3.2-4.0 ms each, against 6.2-13.0 ms in passes alone.
PREFILL_CHUNKS = (256, 128, 64, 32)
PREFILL_NODES = 16


def prefill_chunks(shortest: int) -> list[int]:
    """The chunk lengths of a prefill whose shortest row has ``shortest`` tokens, longest first: they cover at most
    ``shortest - 1`` tokens, so that the verify passes get at least one token of every row (they return its
    logits and carry rows of different lengths)."""
    chunks, left = [], shortest - 1
    for size in PREFILL_CHUNKS:
        while left >= size:
            chunks.append(size)
            left -= size
    return chunks


# Sampling buckets an engine keeps: the warpers are constants in a sampled pass's graph, so each setting captures its
# own graphs (and their memory); past this many, the least recently used one is dropped before a new one is made.
SAMPLING_BUCKETS = 8

# Programs of the compiled acceptance (:func:`accept_pass_`), one per bucket shape (batch, node count, loop or
# not, sampling warpers) in a process: past Dynamo's default of 8, a new bucket would run it eagerly.
ACCEPT_PROGRAMS = 64


@dataclass
class Sampling:
    """What a sampled pass accepts with: transformers' warpers ``warp`` (temperature, top-k, top-p:
    :func:`~.acceptance.warp_probs`), the pass's ``uniforms [B, N]`` (:func:`~.acceptance.draw_uniforms`; plain
    decoding's loop: a ring ``[LOG_SLOTS, B, 1]``, a slot per pass, as its token log) and the distributions its
    children were drawn from, ``draft_probs [B, N, V]`` (None: chosen deterministically)."""

    warp: tuple
    uniforms: torch.Tensor
    draft_probs: torch.Tensor | None = None

    @property
    def key(self) -> tuple:
        """What its captured graphs depend on: the warpers (constants in the graph) and whether drafts have
        distributions."""
        return (*self.warp, self.draft_probs is not None)


def accept_pass_(draft: torch.Tensor, logits: torch.Tensor, ancestors: torch.Tensor | None, active: torch.Tensor,
                 committed: torch.Tensor, remaining: torch.Tensor, eos: torch.Tensor, summary: torch.Tensor,
                 loop: tuple[torch.Tensor, torch.Tensor] | None,
                 sampling: Sampling | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The end of a pass on the device, in place: accept the draft ``draft [2, B, N]`` (tokens, parents)
    against ``logits [B, N, V]`` (greedily, or by rejection sampling on ``sampling``'s static buffers), cut each
    row's tokens after its first EOS (``eos [E]``, -1 padded) and at its budget ``remaining [B]``
    (:func:`cut_at_stop`), advance ``committed`` and lower ``remaining`` by the rows'
    counts (0 for rows not ``active``), stop the rows that ended and write path, count, next token, whether
    the row is still active and the nodes it accepted before the cut into ``summary [B, N + 4]``: the host never
    has to trim a pass, so the next one can be queued before the host reads this one. ``ancestors``: the
    inclusive ancestor mask, or None (built here, by a walk up the parents that inductor fuses). ``loop``: plain
    decoding's ``(log, step)``: log the token and the count at ``step`` of the ring ``log [2, B, S]`` and feed the
    token to the next pass. Returns ``(path [B, N], counts [B])`` for the commit of the records."""
    tokens, parents = draft[0], draft[1]
    if sampling is not None:
        uniforms = sampling.uniforms if loop is None else sampling.uniforms.index_select(0, loop[1])[0]  # (this pass's slot)
        probs = warp_probs(logits, *sampling.warp)
        acceptance = sample_accept_device(tokens, parents, probs, sampling.draft_probs, uniforms)
    else:
        if ancestors is None:
            ancestors = ancestor_mask_device(parents, height=parents.shape[1])
        acceptance = greedy_accept_device(tokens, parents, logits, ancestors)
    kept, token, stops = cut_at_stop(tokens, acceptance, remaining, eos)
    counts = torch.where(active, kept, 0)
    committed += counts
    remaining -= counts
    active &= ~stops
    n = parents.shape[1]
    summary[:, :n] = acceptance.path
    summary[:, n] = counts
    summary[:, n + 1] = token
    summary[:, n + 2] = active
    summary[:, n + 3] = acceptance.num_accepted
    if loop is not None:
        log, step = loop
        log.index_copy_(2, step, torch.stack([token, counts])[..., None])
        step.copy_((step + 1) % log.shape[2])
        draft[0, :, 0] = token
    return acceptance.path, counts


def size_oblivious(on: bool):
    """While on, Dynamo traces size-1 dimensions marked dynamic as general sizes (no 0/1 specialisation)."""
    return fx_config.patch(backed_size_oblivious=on)


@dataclass
class StepResult:
    """What a pass leaves on the device: ``logits [B, N, V]``, the last hidden state (or None)."""

    logits: torch.Tensor
    hidden: torch.Tensor | None


class _Bucket:
    """Static inputs and outputs of the passes of one key (node count, chain or tree, ``mode``, sampling
    warpers: see :meth:`StaticEngine._switch_to`), and their captured graph."""

    def __init__(self, batch: int, nodes: int, chain: bool, device: torch.device, mode: str):
        self.nodes = nodes
        self.chain = chain  # every draft of this bucket is a chain: accepted paths are prefixes
        self.accepts = mode != "host"  # acceptance inside the step (else the caller accepts)
        self.sampling: Sampling | None = None  # a sampling bucket's static uniforms and draft distributions
        self.loop = mode == "loop"  # plain decoding on the device: the pass feeds its token to the next pass
        self.log = torch.zeros(2, batch, LOG_SLOTS, dtype=torch.long, device=device)  # tokens, counts per step (a ring)
        self.step = torch.zeros(1, dtype=torch.long, device=device)  # the log slot of the next pass
        self.slot = 0  # the same, as the host counts the passes it queued
        self.queued: deque[_Queued] = deque()  # blocks of loop passes not read yet, oldest first
        self.snapshots: list[torch.Tensor] = []  # free host buffers for the log's copies
        self.session = VerifySession(static=True)
        self.draft = torch.zeros(2, batch, nodes, dtype=torch.long, device=device)  # tokens, parents
        self.draft[1] = PAD
        self.draft[1, :, 0] = -1
        self.summary = torch.zeros(batch, nodes + 4, dtype=torch.long, device=device)  # path, count, next token, active, accepted
        # on CUDA, page-locked host sides of the draft (in, and back with the summary) and the summary: one DMA each;
        # the copies back in MAX_IN_FLIGHT slots, one per pass that may be launched and not collected
        self.staged: torch.cuda.Event | None = None  # the last draft copy has left host_draft
        self.next_slot = 0
        if device.type == "cuda":
            self.host_draft = torch.zeros(2, batch, nodes, dtype=torch.long, pin_memory=True)
            self.host_summary = torch.zeros(MAX_IN_FLIGHT, batch, nodes + 4, dtype=torch.long, pin_memory=True)
            self.host_verified = torch.zeros(MAX_IN_FLIGHT, 2, batch, nodes, dtype=torch.long, pin_memory=True)  # the drafts, read back
            self.read = [torch.cuda.Event() for _ in range(MAX_IN_FLIGHT)]  # a slot's copies to the host are done
            self.staged = torch.cuda.Event()
        self.graph: torch.cuda.CUDAGraph | None = None
        self.flush_graph: torch.cuda.CUDAGraph | None = None  # commits the pending records (end of a call)
        self.result: StepResult | None = None
        self.ancestors: torch.Tensor | None = None  # the pass's ancestor mask where attention needs it before the model
        self.hint: TopologyHint | None = None
        self.prepared = False
        self.last_use = 0


@dataclass
class _Launched:
    """A pass :meth:`StaticEngine.launch` queued and :meth:`StaticEngine.collect` has not read: its bucket, the host
    copies of its summary and draft, and (CUDA) the event after which they hold them."""

    bucket: _Bucket
    summary: torch.Tensor
    draft: torch.Tensor
    read: torch.cuda.Event | None


@dataclass
class _Queued:
    """A block of plain-decoding passes queued on the device: how many, the log slot of the first, and the
    host copy of the log taken after its last pass (on CUDA page-locked, ready once ``copied`` is)."""

    steps: int
    first: int
    snapshot: torch.Tensor
    copied: torch.cuda.Event | None


@dataclass
class _Chunk:
    """A prefill chunk's static tokens ``[B, size]``, its captured forward (None: run uncaptured) and the last
    hidden state that the forward leaves (None without features)."""

    tokens: torch.Tensor
    graph: torch.cuda.CUDAGraph | None = None
    hidden: torch.Tensor | None = None


class StaticEngine:
    """Static buffers and captured passes of one compiled model.

    ``compiled``: the ``specla``-compiled model, ``config`` its config; ``graphs``: capture CUDA graphs (CUDA only);
    ``features``: the passes also return the last hidden state (for drafters that read features).
    """

    def __init__(self, compiled: torch.nn.Module, config, *, graphs: bool, features: bool = False):
        self.compiled = compiled
        self.eager = getattr(compiled, "_orig_mod", compiled)  # (the prefill chunks run the model's own forward)
        # (its last position's logits only, where the model takes the option: transformers' and fla's LMs do)
        self.last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.eager.forward).parameters else {}
        self.cache_arg = cache_argument(compiled)
        self.config = config  # the model's, to build a static cache of its layout
        self.graphs = graphs
        self.features = features
        self.cache = None
        self.capacity = 0
        self.last: _Bucket | None = None
        self.verified_draft: torch.Tensor | None = None  # [2, B, N] host tokens and parents of the last accepting pass
        self.launched: deque[_Launched] = deque()  # passes launched and not collected, oldest first
        self.active_rows: list[bool] = []  # per row, still active after the last collected pass
        self.buckets: dict[tuple[int, bool, str, tuple | None], _Bucket] = {}
        self.switches = 0  # buckets switched to so far (each bucket's last_use: which sampling bucket to drop)
        self.chunks: dict[int, _Chunk] = {}  # prefill chunks by length, over the current static cache
        self.chunk_error = ""  # why a chunk's capture failed: prefills then run passes only
        self.prefill_passes = 0  # chunks and passes of the last prefill
        self.compile_seconds: dict[str, float] = {}
        # where graphs replay, the acceptance after the model is one inductor program per bucket (compiled at the
        # bucket's first warm-up run), not about sixty small eager kernels (0.08 ms of a 1.6 ms pass on the H200)
        self.accept_pass = torch.compile(accept_pass_, dynamic=False, fullgraph=True) if graphs else accept_pass_

    # --- the cache ---------------------------------------------------------------------------------

    def start(self, cache, committed: torch.Tensor, kv_valid: torch.Tensor | None, capacity: int = 0) -> None:
        """Take over a prefilled ``cache``: copy it into the static cache, which is allocated at the first
        call and again when the batch, the state shapes or the attention ``capacity`` (columns) change;
        every graph is then captured anew. ``committed [B]``: tokens per row; ``kv_valid [B, W]``: which
        attention columns hold real tokens (hybrid models)."""
        if kv_valid is not None and kv_valid.shape[1] > capacity:
            raise ValueError(f"the prompt needs {kv_valid.shape[1]} attention columns, more than the capacity {capacity}")
        self.user_states = gdn_states(cache)  # (walked once per call: a walk of a 24-layer cache costs 0.1 ms)
        fresh = (
            self.cache is None
            or self.committed.shape != committed.shape
            or not same_layout(self.static_states, self.user_states)
            or (kv_valid is not None and self.capacity != capacity)
        )
        if fresh:
            self.cache = static_twin(cache, self.config, capacity)
            self.state_slots = [slot for slot in cache_slots(self.cache) if slot.kind == "state"]
            self.static_states = [slot.get() for slot in self.state_slots]  # (gdn_states' order)
            self.capacity = capacity
            self.buckets, self.chunks = {}, {}
            self.committed = torch.zeros_like(committed)
            self.active = torch.ones(committed.shape[0], dtype=torch.bool, device=committed.device)
            self.eos = torch.full((EOS_SLOTS,), -1, dtype=torch.long, device=committed.device)
            self.remaining = torch.empty_like(committed)  # tokens each row may still emit
            self.kv_valid = None if kv_valid is None else torch.zeros(committed.shape[0], capacity, dtype=torch.bool, device=committed.device)
        self.user_cache = cache
        self.last = None
        self.launched.clear()  # (a call that ended at EOS may have left a pass of no work uncollected)
        for bucket in self.buckets.values():  # a call that failed may have left records pending: drop them
            if bucket.session.num_pending is not None:
                bucket.session.num_pending.zero_()
        self.columns = load_static(self.cache, cache, self.static_states, self.user_states)
        self.committed.copy_(committed)
        self.active.fill_(True)
        self.eos.fill_(-1)  # (no stop before begin_generation says where)
        self.remaining.fill_(NO_BUDGET)
        if self.kv_valid is not None:
            self.kv_valid.zero_()
            self.kv_valid[:, : kv_valid.shape[1]] = kv_valid

    def finish(self):
        """Commit every pending record, write the static cache back into the cache given to :meth:`start`
        and return that cache."""
        if self.last is not None:  # the only bucket with pending records: a switch flushes the one before
            self._flush(self.last)
        store_static(self.cache, self.user_cache, self.columns, self.static_states, self.user_states)
        set_seen_tokens(self.user_cache, int(self.committed.max()))
        return self.user_cache

    # --- one pass ----------------------------------------------------------------------------------

    def verify(self, tokens: torch.Tensor, parents: torch.Tensor, chain: bool | None = None) -> StepResult:
        """Run one pass over the draft ``tokens, parents [B, N]`` (host or device tensors) whose caller accepts
        and commits (the prefill's chain passes). ``chain``: whether the draft is a chain
        (:class:`~.drafting.Draft`'s flag); None: read from ``parents``. Generation's passes accept on the device:
        :meth:`launch`, then :meth:`collect`."""
        bucket = self._begin_pass(tokens, parents, "host", chain, None)
        self._run(bucket)
        return bucket.result

    def launch(self, tokens: torch.Tensor, parents: torch.Tensor, chain: bool | None = None,
               sampling: Sampling | None = None) -> PassOutputs:
        """Queue one pass over a draft (as :meth:`verify`) with its acceptance (greedy, or rejection sampling with
        ``sampling``) and the commit of the accepted paths in the same step, and the copy of its result to the
        host, without waiting for either:
        returns the pass's device outputs, from which a drafter may queue the next draft before
        :meth:`collect` waits for this pass alone. Up to ``MAX_IN_FLIGHT`` passes may wait to be collected:
        the next pass can be queued before the host reads the one before it."""
        if len(self.launched) == MAX_IN_FLIGHT:
            raise RuntimeError(f"{MAX_IN_FLIGHT} passes launched and not collected: collect() first")
        bucket = self._begin_pass(tokens, parents, "accept", chain, sampling)
        self._run(bucket)
        if bucket.staged is not None:
            slot, bucket.next_slot = bucket.next_slot, (bucket.next_slot + 1) % MAX_IN_FLIGHT
            bucket.host_summary[slot].copy_(bucket.summary, non_blocking=True)
            bucket.host_verified[slot].copy_(bucket.draft, non_blocking=True)
            bucket.read[slot].record()
            launched = _Launched(bucket, bucket.host_summary[slot], bucket.host_verified[slot], bucket.read[slot])
        else:  # (a CPU engine: the pass has run, and the next one overwrites its buffers)
            launched = _Launched(bucket, bucket.summary.clone(), bucket.draft.clone(), None)
        self.launched.append(launched)
        n = bucket.nodes
        summary = bucket.summary
        return PassOutputs(bucket.draft[0], summary[:, :n], summary[:, n], summary[:, n + 1], bucket.result.hidden)

    def collect(self) -> Acceptance:
        """The accepted paths, counts and next tokens of the oldest pass :meth:`launch` queued, on the host: waits
        for that pass (the one synchronisation of an iteration), not for the work queued after it. The draft's
        host copy goes to ``verified_draft`` (``[2, B, N]`` tokens and parents: a device draft is not read apart),
        whether each row is still active after it to ``active_rows``."""
        if not self.launched:
            raise RuntimeError("StaticEngine.collect() needs a launch() first")
        launched = self.launched.popleft()
        if launched.read is not None:
            launched.read.synchronize()
        summary, self.verified_draft = launched.summary.clone(), launched.draft.clone()
        n = launched.bucket.nodes
        self.columns += max(summary[:, n].tolist())
        self.active_rows = summary[:, n + 2].bool().tolist()
        return Acceptance(summary[:, :n], summary[:, n], summary[:, n + 1], accepted_before_cut=summary[:, n + 3])

    def has_room(self, nodes: int) -> bool:
        """Whether a pass of ``nodes`` nodes fits the attention cache behind the passes launched and not collected
        (each may take all its nodes' columns)."""
        in_flight = sum(launched.bucket.nodes for launched in self.launched)
        return self.kv_valid is None or self.columns + in_flight + nodes <= self.capacity

    def _begin_pass(self, tokens: torch.Tensor, parents: torch.Tensor, mode: str, chain: bool | None,
                    sampling: Sampling | None) -> _Bucket:
        """The draft's bucket, prepared (compiled, captured) and holding the draft (and ``sampling``'s inputs)."""
        nodes = tokens.shape[1]
        if not self.has_room(nodes):
            raise ValueError(f"the attention cache of {self.capacity} columns is full; raise its capacity")
        bucket = self._switch_to(nodes, parents, mode, chain, sampling)
        self._load_draft(bucket, tokens, parents)
        if sampling is not None:
            bucket.sampling.uniforms.copy_(sampling.uniforms, non_blocking=True)
            if sampling.draft_probs is not None:
                bucket.sampling.draft_probs.copy_(sampling.draft_probs, non_blocking=True)
        if not bucket.prepared:
            self._prepare(bucket)
        return bucket

    def _load_draft(self, bucket: _Bucket, tokens: torch.Tensor, parents: torch.Tensor) -> None:
        """Copy a draft into the bucket's static inputs: through its page-locked host buffer when the
        draft is on the host and the engine on CUDA (one asynchronous DMA)."""
        if bucket.staged is None or tokens.is_cuda:
            bucket.draft.copy_(torch.stack([tokens, parents]))
            return
        bucket.staged.synchronize()  # the previous draft has left the host buffer
        bucket.host_draft[0].copy_(tokens)
        bucket.host_draft[1].copy_(parents)
        bucket.draft.copy_(bucket.host_draft, non_blocking=True)
        bucket.staged.record()

    def begin_generation(self, eos: list[int], budgets: list[int], finished: list[bool]) -> None:
        """Where the rows of a call stop, checked on the device by every accepting pass: after one of ``eos``
        and after ``budgets[b]`` more tokens; ``finished`` rows commit nothing."""
        if not eos_fits(eos):
            raise ValueError(f"at most {EOS_SLOTS} EOS ids are checked on the device, got {len(set(eos))}")
        eos = sorted(set(eos))
        self.eos.fill_(-1)
        self.eos[: len(eos)] = torch.tensor(eos, dtype=torch.long)
        self.remaining.copy_(torch.tensor(budgets))
        self.active.copy_(~torch.tensor(finished))

    def begin_decoding(self, pending: torch.Tensor, warp: tuple | None = None) -> None:
        """Start plain decoding on the device from the tokens ``pending [B]``, greedy or, with ``warp`` (the
        warpers of :class:`Sampling`), sampled: each pass that :meth:`queue_steps` queues verifies the token the
        pass before it emitted, and a row stops where :meth:`begin_generation` said."""
        batch = self.committed.shape[0]
        sampling = None if warp is None else Sampling(warp, torch.zeros(LOG_SLOTS, batch, 1, dtype=torch.float64))
        bucket = self._switch_to(1, torch.full((batch, 1), -1), "loop", True, sampling)
        if not bucket.prepared:
            self._prepare(bucket)  # (before the inputs are set: its capture runs feed tokens back)
        bucket.draft[0, :, 0].copy_(pending, non_blocking=True)
        bucket.step.zero_()
        bucket.snapshots += [block.snapshot for block in bucket.queued]  # (a call whose rows all ended left passes unread)
        bucket.queued.clear()
        bucket.slot = 0

    def queue_steps(self, steps: int, uniforms: torch.Tensor | None = None) -> None:
        """Queue ``steps`` (<= ``PLAIN_STEPS``) passes of plain decoding after :meth:`begin_decoding`, and a copy
        of their tokens to the host behind them; returns without waiting for any of it. Sampled decoding takes
        each pass's ``uniforms``, ``[steps, B, 1]`` (written into the ring slots of these passes)."""
        bucket = self.last
        if bucket is None or not bucket.loop:
            raise RuntimeError("StaticEngine.queue_steps() needs begin_decoding() first")
        if not 1 <= steps <= PLAIN_STEPS:
            raise ValueError(f"steps must be in [1, {PLAIN_STEPS}], got {steps}")
        if (bucket.sampling is None) != (uniforms is None):
            raise ValueError("queue_steps() takes uniforms exactly when begin_decoding() was given warpers (sampling)")
        unread = sum(block.steps for block in bucket.queued)
        if unread + steps > LOG_SLOTS:  # (the ring would overwrite tokens not read yet)
            raise RuntimeError(f"{unread} passes queued and not read: read_steps() first")
        if self.kv_valid is not None and self.columns + unread + steps > self.capacity:
            raise ValueError(f"the attention cache of {self.capacity} columns is full; raise its capacity")
        if uniforms is not None:
            ring = bucket.sampling.uniforms
            slots = (torch.arange(steps, device=ring.device) + bucket.slot) % LOG_SLOTS
            ring.index_copy_(0, slots, uniforms.to(ring.device, ring.dtype))
        for _ in range(steps):
            self._run(bucket)
        on_cuda = bucket.staged is not None
        snapshot = bucket.snapshots.pop() if bucket.snapshots else torch.empty_like(bucket.log, device="cpu", pin_memory=on_cuda)
        snapshot.copy_(bucket.log, non_blocking=on_cuda)
        copied = torch.cuda.Event() if on_cuda else None
        if copied is not None:
            copied.record()
        bucket.queued.append(_Queued(steps, bucket.slot, snapshot, copied))
        bucket.slot = (bucket.slot + steps) % LOG_SLOTS

    def read_steps(self, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Wait for the oldest ``steps`` queued passes (whole blocks of :meth:`queue_steps`), not for those queued
        after them, and return host ``(tokens, counts) [B, steps]``: the token each pass emitted and the tokens
        it committed (0 once a row stopped)."""
        bucket, taken, blocks = self.last, 0, []
        while taken < steps and bucket is not None and bucket.queued:
            blocks.append(bucket.queued.popleft())
            taken += blocks[-1].steps
        if taken != steps:
            raise ValueError(f"read_steps({steps}) does not end where a queued block ends ({taken} passes)")
        if blocks[-1].copied is not None:
            blocks[-1].copied.synchronize()  # the one synchronisation
        slots = (blocks[0].first + torch.arange(steps)) % LOG_SLOTS
        tokens, counts = blocks[-1].snapshot[:, :, slots]
        bucket.snapshots += [block.snapshot for block in blocks]
        self.columns += int(counts.max(0).values.sum())
        return tokens, counts

    def prefill(self, rows: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Run the prompts ``rows`` (1-D token tensors, one per batch row) from the cache :meth:`start` took
        (an empty one: zero states): the tokens every row has as chunks (``prefill_chunks``: each one replay of
        the model's own forward), the rest as chain passes of ``PREFILL_NODES`` tokens that commit every token
        (``prefill_passes``: how many of both).
        Returns the logits after each row's last token ``[B, V]`` and, when the passes return features, each
        row's last hidden states ``[T_b, D]``. Reads nothing back from the device but the prompts."""
        if self.kv_valid is not None:
            raise NotImplementedError("the engine prefills models without attention layers only; hybrids prefill eagerly")
        n, batch = PREFILL_NODES, len(rows)
        lengths = [row.numel() for row in rows]
        host = [row.cpu() for row in rows]
        hidden: list[torch.Tensor] = []  # [B, tokens, D] per chunk or pass (copies: the next replay overwrites them)
        done = 0
        chunks = prefill_chunks(min(lengths)) if not self.chunk_error else []
        self.prefill_passes = len(chunks) + -(-(max(lengths) - sum(chunks)) // n)
        for size in chunks:
            features = self._prefill_chunk(torch.stack([row[done : done + size] for row in host]))
            if self.features:
                hidden.append(features.clone())
            done += size
        path = torch.arange(n, device=self.committed.device).expand(batch, n)
        logits: list[torch.Tensor | None] = [None] * batch
        for start in range(done, max(lengths), n):
            tokens = torch.zeros(batch, n, dtype=torch.long)
            parents = torch.full((batch, n), PAD, dtype=torch.long)
            counts = [min(max(length - start, 0), n) for length in lengths]
            for b, count in enumerate(counts):
                tokens[b, :count] = host[b][start : start + count]
                parents[b, : max(count, 1)] = torch.arange(-1, max(count, 1) - 1)  # (a finished row: an inert root)
            result = self.verify(tokens, parents, chain=True)
            # (non_blocking from pageable memory: staged by the driver, no stream synchronisation between passes)
            self._commit(self.last, path, torch.tensor(counts).to(self.committed.device, non_blocking=True))
            for b, count in enumerate(counts):
                if count and start + count == lengths[b]:
                    logits[b] = result.logits[b, count - 1].clone()
            if self.features:
                hidden.append(result.hidden.clone())
        if not self.features:
            return torch.stack(logits), None
        prompts = torch.cat(hidden, dim=1)  # a row's token t sits at column t: rows start together
        return torch.stack(logits), [prompts[b, :length] for b, length in enumerate(lengths)]

    def _prefill_chunk(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """Run ``tokens [B, size]`` (host), which every row commits, through the model's own forward on the static
        cache: a replay of its graph for this length, captured at the length's first use (the states are saved
        around the capture: its warm-up runs advance them). Returns the last hidden state ``[B, size, D]`` (or
        None without features), overwritten by the next replay."""
        chunk = self.chunks.get(tokens.shape[1])
        if chunk is None:  # (chunks run before any pass of a call: no records are pending)
            chunk = self.chunks[tokens.shape[1]] = _Chunk(torch.zeros_like(tokens, device=self.committed.device))
            if self.graphs:
                saved = [state.clone() for state in self.static_states]
                try:
                    chunk.graph, chunk.hidden = capture(lambda: self._chunk_forward(chunk.tokens))
                except RuntimeError as err:  # (this chunk runs uncaptured, later prefills as passes only)
                    self.chunk_error = str(err).splitlines()[0]
                    log.warning("specla: prefills run as verify passes only: capturing a %d-token chunk of the model's "
                                "forward failed (%s)", tokens.shape[1], self.chunk_error)
                    for slot, static in zip(self.state_slots, self.static_states):
                        slot.set(static)
                torch._foreach_copy_(self.static_states, saved)
        chunk.tokens.copy_(tokens, non_blocking=True)
        if chunk.graph is not None:
            chunk.graph.replay()
        else:
            chunk.hidden = self._chunk_forward(chunk.tokens)
        self.committed += tokens.shape[1]
        return chunk.hidden

    def _chunk_forward(self, tokens: torch.Tensor) -> torch.Tensor | None:
        """The model's own forward over ``tokens`` on the static cache, its new states copied into the static ones
        (fla's layers put new tensors into the cache: the verify passes and the graphs read the static ones)."""
        out = self.eager(input_ids=tokens, **{self.cache_arg: self.cache}, use_cache=True,
                         output_hidden_states=self.features, **self.last_logits_only)
        for slot, static in zip(self.state_slots, self.static_states):
            if slot.get() is not static:
                static.copy_(slot.get())
                slot.set(static)
        set_fla_seen_tokens(self.cache, 0)
        return out.hidden_states[-1] if self.features else None

    # --- inside the step -------------------------------------------------------------------------

    def _switch_to(self, nodes: int, parents: torch.Tensor, mode: str, chain: bool | None,
                   sampling: Sampling | None) -> _Bucket:
        """The bucket of a draft, keyed by its node count, whether it is a chain (``chain``, else checked on
        the host copy of ``parents``), ``mode`` (``accept``: acceptance in the step; ``host``: the caller accepts;
        ``loop``: plain decoding on the device) and ``sampling``'s key (None: greedy), each its own captured graph;
        the bucket used before it is flushed."""
        if chain is None:  # (a device draft's copy waits for the drafter: drafters say what they made)
            chain = all(p in (j - 1, PAD) for row in parents.tolist() for j, p in enumerate(row))  # (lists: 5x faster than ops here)
        key = (nodes, chain, mode, None if sampling is None else sampling.key)
        if key not in self.buckets:
            if sampling is not None:
                self._drop_old_sampling_buckets()
            self.buckets[key] = _Bucket(self.committed.shape[0], nodes, chain, self.committed.device, mode)
            if sampling is not None:  # (static copies of its inputs, which every pass of the bucket loads)
                probs = None if sampling.draft_probs is None else torch.zeros(
                    sampling.draft_probs.shape, dtype=torch.float32, device=self.committed.device)
                uniforms = torch.zeros(sampling.uniforms.shape, dtype=torch.float64, device=self.committed.device)
                self.buckets[key].sampling = Sampling(sampling.warp, uniforms, probs)
            self.buckets[key].hint = TopologyHint.from_parents(parents.cpu())  # the route is fixed per captured graph
        bucket = self.buckets[key]
        if self.last is not None and self.last is not bucket:
            self._flush(self.last)  # another bucket's graph commits only its own pending records
        self.last = bucket
        self.switches += 1
        bucket.last_use = self.switches
        return bucket

    def _drop_old_sampling_buckets(self) -> None:
        """Make room for one more sampling bucket within ``SAMPLING_BUCKETS``: drop the least recently used ones
        (never the last used, whose records may be pending; the others' were flushed when it was switched to)."""
        sampled = [key for key in self.buckets if key[3] is not None]
        idle = sorted((key for key in sampled if self.buckets[key] is not self.last), key=lambda k: self.buckets[k].last_use)
        for key in idle[: max(0, len(sampled) + 1 - SAMPLING_BUCKETS)]:
            del self.buckets[key]

    def _run(self, bucket: _Bucket) -> None:
        """One pass of a prepared ``bucket`` over its static draft: a replay where it was captured."""
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            bucket.result = self._step(bucket)

    def _forward(self, bucket: _Bucket) -> StepResult:
        tokens, parents = bucket.draft[0], bucket.draft[1]
        kwargs = {"use_cache": True, "output_hidden_states": self.features}
        tree_mask = bucket.ancestors = None  # (without attention, the acceptance builds them itself)
        if self.kv_valid is not None:
            ancestors = bucket.ancestors = ancestor_mask_device(parents)
            depth = ancestors.sum(-1) - 1
            kwargs["position_ids"] = self.committed[:, None] + depth
            tree_mask = self._tree_mask(ancestors)
        set_fla_seen_tokens(self.cache, 0)  # fla's token counter: a constant keeps Dynamo's guards on it stable
        one_graph = ONE_GRAPH and self.kv_valid is None
        if one_graph:
            # One graph for every bucket size, the 1-node pass included: the node dimension is dynamic from
            # the first compile, and size-oblivious reasoning keeps Dynamo from specialising it when it is 1.
            # Each compile traces the whole model (tens of seconds at the 1.3B shape): this halves cold
            # start. Not for hybrids: transformers' sdpa call computes is_causal from the query length,
            # which a dynamic length of 1 turns into a symbolic bool that sdpa refuses.
            torch._dynamo.maybe_mark_dynamic(tokens, 1)
        # Next hop: Dynamo's guard check, then backend.SpeculativeGraph.__call__, which finds this session through
        # lowering.session.active_session and runs the verification twin; each GDN layer's recurrence in it is
        # specla::gdn_commit_verify_ (kernels/ops.py; on CUDA kernels/cuda.py, route by topology_hint).
        with bucket.session.verify(parents, tree_mask), topology_hint(bucket.hint), size_oblivious(one_graph):
            out = self.compiled(input_ids=tokens, **{self.cache_arg: self.cache}, **kwargs)
        if not bucket.session.records:
            raise ValueError(
                "the verification pass went through no GDN layer: the model has none, was compiled with another "
                "backend than 'specla', or Dynamo hit its recompile limit and ran the model eagerly"
            )
        return StepResult(out.logits, out.hidden_states[-1] if self.features else None)

    def _step(self, bucket: _Bucket) -> StepResult:
        result = self._forward(bucket)
        if bucket.accepts:
            loop = (bucket.log, bucket.step) if bucket.loop else None
            with torch._dynamo.config.patch(recompile_limit=ACCEPT_PROGRAMS):
                path, counts = self.accept_pass(bucket.draft, result.logits, bucket.ancestors, self.active, self.committed,
                                                self.remaining, self.eos, bucket.summary, loop, bucket.sampling)
            self._keep(bucket, path, counts)
        return result

    def _commit(self, bucket: _Bucket, path: torch.Tensor, counts: torch.Tensor) -> None:
        self.committed += counts
        self._keep(bucket, path, counts)

    def _keep(self, bucket: _Bucket, path: torch.Tensor, counts: torch.Tensor) -> None:
        """Keep each row's first ``counts[b]`` nodes of ``path``: their records pending, their K/V compacted."""
        bucket.session.accept(path, counts, prefix=bucket.chain)
        if self.kv_valid is not None:
            self._compact_attention(bucket.nodes, path, counts)

    def _tree_mask(self, ancestors: torch.Tensor) -> torch.Tensor:
        """``[B, 1, N, L]``: the valid committed columns, then the node's ancestors (and itself) at the
        columns the pass writes its nodes to."""
        nodes = ancestors.shape[1]
        start = self._attention_length()
        relative = torch.arange(self.kv_valid.shape[1], device=ancestors.device) - start  # column - first draft column
        in_draft = (relative >= 0) & (relative < nodes)
        tree = ancestors.gather(2, relative.clamp(0, nodes - 1).expand(*ancestors.shape[:2], -1)) & in_draft
        return (self.kv_valid[:, None, :] | tree)[:, None]

    def _attention_layers(self) -> list:
        return [layer for layer in self.cache.layers if getattr(layer, "cumulative_length", None) is not None and getattr(layer, "is_initialized", False)]

    def _attention_length(self) -> torch.Tensor:
        return self._attention_layers()[0].cumulative_length

    def _set_attention_length(self, length: int | torch.Tensor) -> None:
        for layer in self._attention_layers():
            layer.cumulative_length.fill_(length) if isinstance(length, int) else layer.cumulative_length.copy_(length)

    def _compact_attention(self, nodes: int, path: torch.Tensor, counts: torch.Tensor) -> None:
        """The pass wrote its N nodes' K/V at the N columns after the committed ones: move each row's
        accepted path there, mark the columns of the shorter rows invalid, and advance the length by the
        longest row's count."""
        end = self._attention_length()  # the model's update already advanced it by N
        start = end - nodes
        columns = start + torch.arange(nodes, device=path.device)
        source = start + path.clamp(min=0)  # [B, N]
        for layer in self._attention_layers():
            for kv in (layer.keys, layer.values):
                gathered = kv.gather(2, source[:, None, :, None].expand(-1, kv.shape[1], -1, kv.shape[3]))
                kv.index_copy_(2, columns, gathered)
        valid = torch.arange(nodes, device=path.device)[None] < counts[:, None]
        self.kv_valid.index_copy_(1, columns, valid)
        self._set_attention_length(start + counts.max())

    def _flush(self, bucket: _Bucket) -> None:
        """Commit a bucket's pending records now: a replay of its captured flush where there is one."""
        if bucket.flush_graph is not None:
            bucket.flush_graph.replay()
        else:
            bucket.session.flush()

    # --- capture -----------------------------------------------------------------------------------

    def _prepare(self, bucket: _Bucket) -> None:
        """First pass of a bucket: compile it (Dynamo, inductor) and, with graphs, capture it. The runs
        before the real one commit nothing (no row active, pending records flushed first)."""
        for other in self.buckets.values():
            self._flush(other)
        bucket.prepared = True
        name = f"{bucket.nodes}{'-chain' if bucket.chain else '-tree'}"
        also = "; capturing its CUDA graph" if self.graphs else ""
        log.warning("specla: compiling the %s pass (bucket %d) unless a compiled graph serves its size%s", name, bucket.nodes, also)
        if not self.graphs:
            return
        started = time.perf_counter()
        active = self.active.clone()
        self.active.fill_(False)
        # (the device's attention length: a pass launched and not collected yet has advanced it past self.columns)
        length = self._attention_length().clone() if self.kv_valid is not None else None
        # (in a pass only a layer's own launch touches its state, and only the pass's end writes the records)
        with commits_before_wait(slot.get() for slot in self.state_slots):
            bucket.graph, bucket.result = capture(lambda: self._step(bucket))
        # the flush too (about 100 launches, once per call): nothing is pending yet, so its warm-up
        # only compiles its kernels
        bucket.flush_graph, _ = capture(bucket.session.flush, warmups=1)
        self.active.copy_(active)
        if length is not None:
            self._set_attention_length(length)
        torch.cuda.synchronize()
        self.compile_seconds[name] = time.perf_counter() - started


