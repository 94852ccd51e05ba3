"""EAGLE drafting at run time: the head's per-row KV cache over committed positions and tree rollouts.

Pair ``t`` of a row is (target feature f_t, token x_{t+1}). A row's cache only ever holds pairs made of
real target features and committed tokens: at each ``propose`` the pairs not cached yet are run (the
last one pairs the newest feature with the pending token, which the target sampled itself, so it is
committed too). Draft nodes beyond the pending token use the head's own predicted features; they live
in scratch columns for the duration of one ``propose`` and are overwritten by the next, which is the
rollback: whatever the target rejects never reaches the cache, and accepted tokens are re-run with the
target's real features at the next ``propose``.

Cost: a ``propose`` moves its inputs to the device in one copy, runs the head once for the new pairs
and once per draft level over fixed-shape buffers (no copy that grows with the sequence), and reads
one number back (the draft's width, in the tree builder). With static shapes (on CUDA, unless
``SpecConfig(cuda_graphs=False)``) it reads nothing back: the new pairs are padded to ``depth + 1``
(the most one iteration commits), a tree is padded to ``budget + 1`` nodes, and the device work of a
propose (catch-up, every draft level, the tree's selection) is one program compiled by inductor (its
elementwise work fused: the kernel count bounds a propose) and one captured CUDA graph, replayed. The
prompts' pairs are cached at ``begin`` by one head call over them, padded to a power of two from 64 and, where
the last propose replayed graphs, replayed as that width's captured graph: eager, its launches cost ~2.9 ms of
host time per prompt on the H200, which queueing it behind the target's prefill did not hide. More new pairs
than ``depth + 1`` at a propose (a host loop's rows) are cached first the same way, all but the last
``depth + 1``, so that every propose replays its graph.

Pipelined (:meth:`EagleDrafter.propose_after`): after the first propose, each propose's inputs come from
the verify pass's device outputs (the accepted path's tokens and features, the counts, the new pending
token) by a few gathers, and the rows' cached pair counts live on the device: the host reads nothing and
writes nothing, and the same captured graph replays.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from ...kernels import TRITON_KERNELS, ops
from ...kernels.reference import quantize_rows
from ..config import SpecConfig
from ..drafting import Draft, Drafter, DraftRequest, PassOutputs
from ..graph_capture import capture
from ..tree_builder import Frontier, build_draft
from .eagle_head import DEFAULT_HEAD_GEMMS, HEAD_GEMMS, INT8_HEAD_GEMMS, EagleHead

log = logging.getLogger("specla_compile")

PROPOSE_PROGRAMS = 64  # compiled propose programs a process may hold (EagleDrafter._device_propose)
# Largest table of every token's embedding through the head's fuse (EagleHead.pack_projections) that a drafter
# builds: 63 MiB at the trained study's shape (32k tokens, hidden 1024, bf16); a 248k-token vocabulary skips it.
TOKEN_FUSE_BYTES = 256 * 2**20
# The attention kernels a propose may use (EagleDrafter's ``attention``): a propose's attention is a few
# queries over the whole key buffer under a mask. PyTorch's own choice, one of its kernels (math as the
# fallback), or specla's (``specla::draft_attention``: split across the keys, Triton on CUDA).
SDPA_BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
ATTENTION = ("pytorch", *SDPA_BACKENDS, "specla")
QUANTIZE = (None, "none", "int8")  # EagleDrafter's quantize (None: "int8" where it is measured faster)


def _specla_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return ops.draft_attention(q, keys, values, mask, q.shape[-1] ** -0.5)


class _Buffers:
    """Keys and values of every row, ``[B, H, capacity + scratch, d]``: columns ``[0, capacity)`` hold a
    row's cached pairs from column 0 on, the ``scratch`` columns after them one ``propose``'s draft nodes.

    Pairs are written in place, never concatenated, and the attention always reads the whole buffer
    under a mask, so its shapes change only when the capacity doubles: nothing is copied per pair, and
    attention kernels that plan per shape (cuDNN's, which PyTorch prefers for masked half-precision
    attention on H100/H200) plan once per capacity, not at every call of a growing sequence.
    """

    def __init__(self, rows: int, heads: int, dim: int, device: torch.device, dtype: torch.dtype):
        self.keys = self.values = torch.zeros(rows, heads, 0, dim, device=device, dtype=dtype)
        self.capacity = self.scratch = 0

    def fits(self, rows: int, heads: int, dim: int, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether these buffers serve a batch of that shape (a new ``begin`` then keeps them, and the
        graphs captured over them)."""
        k = self.keys
        return (k.shape[0], k.shape[1], k.shape[3], k.device, k.dtype) == (rows, heads, dim, torch.device(device), dtype)

    def reserve(self, pairs: int, scratch: int) -> bool:
        """Room for ``pairs`` cached pairs per row and ``scratch`` draft nodes; True if the buffers were
        replaced (graphs captured over the old ones are stale, and a propose compiled for the old shape
        compiles again: both sizes are powers of two, so that few lengths and configs need a program)."""
        capacity = self.capacity if pairs <= self.capacity else _room(pairs, 256)
        scratch = self.scratch if scratch <= self.scratch else _room(scratch, 32)
        if (capacity, scratch) == (self.capacity, self.scratch):
            return False
        rows, heads, _, dim = self.keys.shape
        grown = []
        for old in (self.keys, self.values):
            # zeros, not empty: masked columns still enter the attention's products (with weight 0)
            new = old.new_zeros(rows, heads, capacity + scratch, dim)
            new[:, :, : self.capacity] = old[:, :, : self.capacity]
            grown.append(new)
        self.keys, self.values = grown
        self.capacity, self.scratch = capacity, scratch
        return True

    def rows(self, index: torch.Tensor, every_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the rows at ``index``: the buffers themselves when that is every row."""
        if every_row:
            return self.keys, self.values
        return self.keys[index], self.values[index]


def _room(needed: int, least: int) -> int:
    """The power of two from ``least`` on that holds ``needed``."""
    return max(least, 1 << (needed - 1).bit_length())


@dataclass
class _Plan:
    """One ``propose``. On the host: the requested rows, their new pair counts, whether they are every
    row of the batch. ``inputs`` on the device, one line per requested row: its batch index, its cached
    pairs before the catch-up, its new pair count, its new pairs' tokens (padded to the plan's width) and
    its pending token."""

    row_ids: list[int]
    new: list[int] | None  # (None: known on the device only, a pipelined propose)
    every_row: bool
    inputs: torch.Tensor

    @property
    def rows(self) -> torch.Tensor:
        return self.inputs[:, 0]

    @property
    def cached(self) -> torch.Tensor:
        return self.inputs[:, 1]

    @property
    def counts(self) -> torch.Tensor:
        return self.inputs[:, 2]

    @property
    def lengths(self) -> torch.Tensor:
        return self.cached + self.counts

    @property
    def tokens(self) -> torch.Tensor:
        return self.inputs[:, 3:-1]

    @property
    def pending(self) -> torch.Tensor:
        return self.inputs[:, -1]


@dataclass
class _Captured:
    """A propose's or a catch-up's captured device work for one key: its graph, its draft (None for a
    catch-up), and the static inputs that a replay copies its own into (none for a pipelined propose: it reads
    the pass's buffers themselves)."""

    graph: torch.cuda.CUDAGraph
    draft: Draft | None
    inputs: tuple[torch.Tensor, ...] = ()


def _gather_slots(t: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """``t [R, W', ...]`` taken at ``slots [R, W]`` along dim 1."""
    index = slots.view(*slots.shape, *[1] * (t.dim() - 2)).expand(-1, -1, *t.shape[2:])
    return t.gather(1, index)


class EagleDrafter(Drafter):
    """Drafts with an :class:`EagleHead` on the target's features, through the tree builder.

    ``target`` supplies the (frozen) input embeddings and LM head; ``needs_features`` is True: the
    generator passes the target's last hidden state over the prompt to :meth:`begin` and at the newly
    committed positions to :meth:`commit`.

    The head's q/k/v and gate/up weights are packed for inference (:meth:`EagleHead.pack_projections`), and
    every token's embedding passed through its fuse once (a table of at most ``TOKEN_FUSE_BYTES``).
    ``static_shapes``: draft in fixed shapes and, on CUDA, replay each propose's captured graph (module
    docstring); None (default): on CUDA unless ``SpecConfig(cuda_graphs=False)``. ``compiled``: run a
    fixed-shape propose's device work as one program compiled by inductor; None (default): on CUDA.
    The drafts are the same either way, up to padding nodes. ``attention``: the head's attention kernel in
    a propose, one of ``ATTENTION``: ``"pytorch"`` (PyTorch's choice: cuDNN's on the H200), its ``"cudnn"``,
    ``"efficient"`` or ``"math"`` (matrix products and a softmax that inductor fuses), or ``"specla"``
    (``specla::draft_attention``: on CUDA a Triton kernel split across the keys, the reference elsewhere);
    None (default): ``"specla"`` on CUDA (on the H200 its tree propose replays in 0.63 ms against cuDNN's
    0.71), ``"pytorch"`` elsewhere. ``draft_vocab``: draft only the head's ``draft_vocab`` most frequent tokens
    (its ``token_ranking``, from its training data), through a copy of those rows of the target's LM head
    made here: each draft level reads that many rows instead of the whole vocabulary (FR-Spec's
    frequency-ranked drafting). The output stays exact (the target verifies); a token outside the draft
    vocabulary can only be emitted by the target itself. None (default) or the vocabulary's size: every
    token, through the target's LM head module. ``head_gemms``: how the head's GEMMs run with the norms,
    residuals, table rows and gate around them (``HEAD_GEMMS``, the ``gemms`` of :meth:`EagleHead.project` and
    :meth:`EagleHead.attend`): ``"pytorch"`` (PyTorch code, cuBLAS's GEMMs and inductor's fusions) or
    ``"specla"`` (one launch each, Triton on CUDA for up to 16 half-precision rows; on the H200 no faster in a
    propose, ``benchmarks/results/eagle_profile.md``) or ``"mixed"`` (specla's ``linear_add`` for the
    fuse and o_proj, PyTorch's for the rest; on the H200 a tree's propose replays 14% faster than with
    ``"pytorch"``, ``benchmarks/results/eagle_profile_head_gemms.md``) or ``"triton"`` (default: ``"mixed"`` with
    q/k/v and gate/up as specla's bare Triton GEMMs after PyTorch's norms, 5% faster again at hidden 1024 and 2048,
    ``eagle_profile_head_gemms_triton.md``; and, as with ``"specla"``, each tree level's LM head and top-k as one
    ``specla::linear_top_k`` and a down projection whose depth splits as ``specla::linear_add``: 0.349 -> 0.322 ms
    a tree propose at hidden 1024, ``eagle_profile_linear_top_k.md``). The same drafts with any of the four, up to
    rounding.
    ``quantize="int8"`` (with ``head_gemms`` "triton" or "specla" and an ``nn.Linear`` LM head): the head's GEMMs
    and the draft levels' LM head rows stream weight-only int8 copies (per
    output row, :meth:`EagleHead.int8_weights`): half the bytes per draft level. The drafts may differ where int8
    rounding reorders near-ties; the output never does (the target verifies). ``"none"``: the head's own weights.
    None (default): ``"int8"`` where it is measured faster (Triton's kernels on CUDA, a half-precision head and LM
    head, head GEMMs and LM head that int8 takes), ``"none"`` elsewhere. On the H200's trained study (``benchmarks/results/trained/
    e2e_trained.md``) int8 kept the depth-6 tree's accepted length (5.68 against 5.66 tokens on the mixed suite)
    and took its speedup from 2.48 to 2.58x.
    ``acceptance_temperature``: the draft levels score ``logits / T`` (folded into a copy of the LM head's rows, so
    at no cost per level); None (default): the head's calibrated ``config.acceptance_temperature`` (1 for heads
    saved before it). A tree keeps the nodes of best cumulative log-probability: with the head's raw, flat
    probabilities it spends its nodes on siblings near the root rather than on depth. A chain drafts the same
    argmax at any ``T`` (up to the rounding of the scaled rows). Sharper probabilities also let ``SpecConfig.tau``
    cut more siblings; a fixed-size draft (static shapes: padded to ``budget + 1`` nodes, a pass costs the same)
    loses acceptance by it and wants ``tau=math.inf``, as ``benchmarks/e2e_trained.py``'s trees use.
    ``inductor_options``: the ``torch._inductor.config`` entries of the compiled propose; None (default): on CUDA
    those of a launch-bound program (``kernels.pdl.launch_bound_inductor_options``: combo kernels and PDL; on
    the H200 the depth-6 tree's propose replays in 0.418 ms against 0.464 without, 130 kernels against 158),
    inductor's defaults elsewhere; ``{}``: inductor's defaults (an A/B).
    """

    needs_features = True

    def __init__(self, head: EagleHead, target: nn.Module, static_shapes: bool | None = None,
                 compiled: bool | None = None, attention: str | None = None, draft_vocab: int | None = None,
                 head_gemms: str = DEFAULT_HEAD_GEMMS, acceptance_temperature: float | None = None,
                 inductor_options: dict | None = None, quantize: str | None = None):
        if quantize not in QUANTIZE:
            raise ValueError(f"EagleDrafter: quantize must be one of {QUANTIZE}, got {quantize!r}")
        if attention is not None and attention not in ATTENTION:
            raise ValueError(f"EagleDrafter: attention must be None or one of {sorted(ATTENTION)}, got {attention!r}")
        if head_gemms not in HEAD_GEMMS:
            raise ValueError(f"EagleDrafter: head_gemms must be one of {sorted(HEAD_GEMMS)}, got {head_gemms!r}")
        int8_ready = head_gemms in INT8_HEAD_GEMMS and type(target.get_output_embeddings()) is nn.Linear
        if quantize is None:  # (int8 where the study measured it faster: Triton's kernels, half-precision rows)
            half = (torch.float16, torch.bfloat16)
            quantize = "int8" if (int8_ready and TRITON_KERNELS and head.fuse.weight.is_cuda and head.fuse.weight.dtype
                                  in half and target.get_output_embeddings().weight.dtype in half) else "none"
            if quantize == "int8":
                log.info("EagleDrafter: drafting with int8 copies of the head's GEMM weights and LM head rows "
                         "(quantize='none' keeps its own; the output is the same either way)")
        if quantize == "int8" and not int8_ready:
            raise ValueError(f"EagleDrafter: quantize='int8' takes head_gemms in {INT8_HEAD_GEMMS} (specla's kernels; the "
                             f"others' PyTorch GEMMs would widen each int8 weight at every call) and an nn.Linear LM head, "
                             f"got {head_gemms!r} and {type(target.get_output_embeddings()).__name__}")
        if draft_vocab is not None and head.token_ranking is None:
            raise ValueError("EagleDrafter: draft_vocab needs a head with a token ranking (one trained by "
                             "examples/train_eagle.py since the ranking was added)")
        if draft_vocab is not None and not 1 <= draft_vocab <= head.config.vocab_size:
            raise ValueError(f"EagleDrafter: draft_vocab must be in [1, {head.config.vocab_size}], got {draft_vocab}")
        if acceptance_temperature is not None and not acceptance_temperature > 0:
            raise ValueError(f"EagleDrafter: acceptance_temperature must be > 0, got {acceptance_temperature}")
        head.config.check_target(target)
        self.attention = attention or ("specla" if TRITON_KERNELS and head.fuse.weight.is_cuda else "pytorch")
        embed = target.get_input_embeddings()
        table = embed.weight.shape[0] * head.config.hidden_size * head.fuse.weight.element_size()
        head.pack_projections(embed if table <= TOKEN_FUSE_BYTES else None)
        self._int8 = head.int8_weights() if quantize == "int8" else None  # (the drafter's own: other drafters share the head)
        self.head_gemms = head_gemms
        if inductor_options is None and head.fuse.weight.is_cuda:
            from ...kernels import pdl  # (imports Triton, which CUDA implies)

            inductor_options = pdl.launch_bound_inductor_options(head.fuse.weight.device)
        self.inductor_options = dict(inductor_options or {})
        self.static_shapes = static_shapes
        self.compiled = compiled
        self._graphs: dict[tuple, _Captured] = {}  # captured over the current buffers (cleared when they grow)
        self._after_key: tuple | None = None  # the last pipelined propose's graph key (_replay_after)
        self._graph_error = ""
        self._catch_up_error = ""  # (apart: a catch-up that cannot be captured leaves the proposes' graphs on)
        self._graphs_wanted = False  # the last propose's config's word on graphs: begin() has no config of its own
        self._compiled_propose: Callable | None = None
        self.head = head.eval()
        self.embed = embed
        self.lm_head = target.get_output_embeddings()
        self.draft_vocab = None  # [N] token ids the draft levels score (None: every token)
        if draft_vocab is not None and draft_vocab < head.config.vocab_size:
            self.draft_vocab = head.token_ranking[:draft_vocab].to(self.lm_head.weight.device)
        self.acceptance_temperature = float(head.config.acceptance_temperature if acceptance_temperature is None
                                            else acceptance_temperature)
        self._lm_weight = self._lm_bias = None  # the draft levels' LM rows, where they differ from the target's
        self._lm_scale = None  # (their per-row scale, where quantized: _lm_weight is int8)
        if self.draft_vocab is not None or self.acceptance_temperature != 1.0 or quantize == "int8":
            bias = getattr(self.lm_head, "bias", None)
            rows = slice(None) if self.draft_vocab is None else self.draft_vocab
            with torch.no_grad():  # (copies: those tokens' rows, scaled by 1 / T)
                self._lm_weight = self.lm_head.weight[rows] / self.acceptance_temperature
                self._lm_bias = None if bias is None else bias[rows] / self.acceptance_temperature
                if quantize == "int8":
                    self._lm_weight, self._lm_scale = quantize_rows(self._lm_weight)
        self.quantize = quantize
        self.vocab_size = head.config.vocab_size
        self._cached: list[int] = []  # per row: pairs in the buffers
        self._features: list[torch.Tensor] = []  # per row: committed features waiting for their pair
        self._buffers = _Buffers(0, 1, 1, head.fuse.weight.device, self._dtype)
        self._last_hidden = torch.empty(0)  # [B, D]: head output at each row's newest cached pair
        self._device_cached: torch.Tensor | None = None  # [B] pairs per row, once pipelined (then _cached is stale)
        self._cached_counts = torch.zeros(0, dtype=torch.long)  # where _device_cached lives: one buffer per batch shape

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, target: nn.Module, dtype: torch.dtype | None = None, **options
    ) -> EagleDrafter:
        """Load a head saved by :meth:`save_pretrained` (or the training script) for ``target``,
        on the device of the target's embeddings; ``options`` go to the constructor (``draft_vocab``, ...)."""
        return cls(
            EagleHead.from_pretrained(path, device=target.get_input_embeddings().weight.device, dtype=dtype), target,
            **options,
        )

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Save the head (config.json + model.safetensors); the target's weights are not included."""
        self.head.save_pretrained(path)

    @property
    def _dtype(self) -> torch.dtype:
        return self.head.fuse.weight.dtype

    @property
    def captured_graphs(self) -> int:
        """How many propose graphs the drafter holds now: 0 where it drafts without CUDA graphs (on the CPU,
        ``SpecConfig(cuda_graphs=False)``, or after a failed capture: :attr:`graph_error`). The catch-ups' graphs
        over prompts are not counted."""
        return sum(1 for key in self._graphs if key[0] != "catch_up")

    @property
    def graph_error(self) -> str:
        """The first line of the error that stopped its proposes from capturing CUDA graphs ("" if none)."""
        return self._graph_error

    @property
    def catch_up_graphs(self) -> int:
        """How many graphs of ``begin``'s catch-up over prompts it holds now (one per rows and padded width)."""
        return sum(1 for key in self._graphs if key[0] == "catch_up")

    @property
    def catch_up_error(self) -> str:
        """The first line of the error that stopped a catch-up's capture ("" if none); catch-ups then run eagerly."""
        return self._catch_up_error

    def begin(self, sequences: list[torch.Tensor], features: list[torch.Tensor] | None = None) -> None:
        if features is None or len(features) != len(sequences):
            raise ValueError("EagleDrafter.begin needs the target's features over every prompt (needs_features=True)")
        cfg, device = self.head.config, self.head.fuse.weight.device
        for b, feats in enumerate(features):
            self._check_features(feats, f"features[{b}]")
        self._cached = [0] * len(sequences)
        self._device_cached = None
        self._features = [feats.to(device, self._dtype) for feats in features]
        if self._buffers.fits(len(sequences), cfg.num_heads, cfg.head_dim, device, self._dtype):
            self._last_hidden.zero_()  # (the buffers' old pairs stay, masked, until overwritten)
        else:
            self._buffers = _Buffers(len(sequences), cfg.num_heads, cfg.head_dim, device, self._dtype)
            self._last_hidden = torch.zeros(len(sequences), cfg.hidden_size, device=device, dtype=self._dtype)
            self._cached_counts = torch.zeros(len(sequences), dtype=torch.long, device=device)
            self._graphs.clear()
        if self._static_shapes(None):
            # the prompts' pairs now, so that the first propose runs only its fixed shapes (nothing here waits for
            # the device); graphed: eager, the seventeenth trained study paid 2.8 ms per prompt for its launches
            prompts = [b for b, seq in enumerate(sequences) if seq.shape[0] > 1]
            if prompts:
                request = DraftRequest(prompts, [sequences[b] for b in prompts])
                self._catch_up_once(request, self._buffers.scratch, self._graphs_on(None))

    def commit(self, rows: list[int], tokens: list[torch.Tensor], features: list[torch.Tensor] | None = None) -> None:
        self._check_host_state()
        if features is None or len(features) != len(rows):
            raise ValueError("EagleDrafter.commit needs the target's features at the committed positions")
        for b, toks, feats in zip(rows, tokens, features):
            self._check_row(b)
            self._check_features(feats, f"features of row {b}")
            if feats.shape[0] != len(toks):
                raise ValueError(f"row {b}: {len(toks)} committed tokens but {feats.shape[0]} feature rows")
            self._features[b] = torch.cat([self._features[b], feats.to(self._features[b])])

    def propose(self, request: DraftRequest, config: SpecConfig) -> Draft:
        self._check_host_state()
        if not request.rows:
            raise ValueError("DraftRequest has no rows to draft for")
        self._graphs_wanted = config.cuda_graphs is not False
        with torch.no_grad():
            static = self._static_shapes(config)
            if static:
                self._catch_up_all_but(config.depth + 1, request, config)
            plan = self._plan(request, self._scratch(config), config.depth + 1 if static else None)
            features = self._new_features(plan)
            draft = self._run_plan(plan, features, config, static, fixed=static and plan.tokens.shape[1] == config.depth + 1)
            self._mark_cached(plan)
            return draft

    def propose_after(self, last: PassOutputs, config: SpecConfig, max_length: int) -> Draft | None:
        """Every row's next draft from the pass's device outputs (module docstring); None without static
        shapes or features, or before the rows' host bookkeeping is settled (a first propose)."""
        rows = len(self._cached)
        if last.hidden is None or not self._static_shapes(config) or last.tokens.shape[0] != rows:
            return None
        width = config.depth + 1
        if self._device_cached is None:
            if any(f.shape[0] for f in self._features) or not all(self._cached):
                return None  # (features waiting for their pair: the host path caches them first)
            # (in one buffer for every call: the pipelined propose's graph reads it in place)
            self._device_cached = self._cached_counts
            self._device_cached.copy_(torch.tensor(self._cached))
        # the whole call's room, once: room for a row's last pass (depth + 1 pairs) past its budget, and each
        # later propose writes width padding pairs
        if self._buffers.reserve(max_length + 2 * width, self._scratch(config)):
            self._graphs.clear()
        with torch.no_grad():
            draft = self._replay_after(last, config, width) if self._graphs_on(config) else None
            if draft is None:
                draft = self._run_plan(*self._after_inputs(last, width), config, static=True, fixed=True)
            self._device_cached += last.counts
        return draft

    def _after_inputs(self, last: PassOutputs, width: int) -> tuple[_Plan, torch.Tensor]:
        """A pipelined propose's plan and new features, gathered from the pass's device outputs."""
        rows, device = last.tokens.shape[0], last.tokens.device
        # pair j of a row: the feature at its path's node j, the token after it (the path's next node, or
        # the new pending token after the last accepted node); columns past the count are padding
        path = nn.functional.pad(last.path, (0, max(0, width - last.path.shape[1])), value=-1)[:, :width].clamp(min=0)
        following = last.tokens.gather(1, path).roll(-1, dims=1)
        pending = last.next_token[:, None]
        tokens = torch.where(torch.arange(width, device=device) == last.counts[:, None] - 1, pending, following)
        meta = torch.stack([torch.arange(rows, device=device), self._device_cached, last.counts], dim=1)
        plan = _Plan(list(range(rows)), None, True, torch.cat([meta, tokens, pending], dim=1))
        return plan, _gather_slots(last.hidden, path).to(self._dtype)

    def _replay_after(self, last: PassOutputs, config: SpecConfig, width: int) -> Draft | None:
        """A pipelined propose as one captured graph that reads the pass's outputs where the pass left them
        (the engine's static buffers): the gathers of :meth:`_after_inputs` replay inside it instead of a dozen
        launches from the host per iteration. Captured once the same buffers come a second time in a row
        (their addresses key the graph); None until then, or if it cannot be captured."""
        sources = (last.tokens, last.path, last.counts, last.next_token, last.hidden, self._device_cached)
        key = ("after", config.mode, config.depth, config.tree_top_k, config.budget, config.tau,
               *((t.data_ptr(), t.shape, t.stride()) for t in sources))
        captured = self._graphs.get(key)
        if captured is None:
            seen, self._after_key = self._after_key, key
            if seen != key:
                return None
            compiled = self.compiled is not False
            # (the warm-up runs repeat the real catch-up: the cached counts move only outside the graph)
            captured = self._captured(key, lambda: self._device_propose(*self._after_inputs(last, width), config, True, compiled))
        return None if captured is None else self._replayed(captured)

    def _run_plan(self, plan: _Plan, features: torch.Tensor, config: SpecConfig, static: bool, fixed: bool) -> Draft:
        """A propose's device work: with ``fixed`` shapes (new pairs padded to exactly ``depth + 1``) a replay
        of its captured graph where graphs are on, else the work itself (compiled by inductor when the shapes
        are fixed, by default on CUDA)."""
        draft = self._replay(plan, features, config) if fixed and self._graphs_on(config) else None
        if draft is None:
            compiled = fixed and (self._buffers.keys.is_cuda if self.compiled is None else self.compiled)
            draft = self._device_propose(plan, features, config, static, compiled)
        return draft

    def _beam(self, config: SpecConfig) -> int:
        """Frontier nodes per draft level after the first."""
        scored = self.vocab_size if self.draft_vocab is None else len(self.draft_vocab)
        return 1 if config.mode == "chain" else min(config.tree_top_k, scored)

    def _scratch(self, config: SpecConfig) -> int:
        """Buffer columns for one propose's draft nodes (the levels after the first)."""
        return (config.depth - 1) * self._beam(config)

    def _attention_kernels(self) -> contextlib.AbstractContextManager:
        """The chosen SDPA kernel, with math as its fallback."""
        if self.attention not in SDPA_BACKENDS:
            return contextlib.nullcontext()
        return sdpa_kernel(list(dict.fromkeys([SDPA_BACKENDS[self.attention], SDPBackend.MATH])))

    def project(self, features: torch.Tensor, tokens: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head's :meth:`EagleHead.project` of pairs of ``features`` and token ids (their ids where the head
        holds the token table, else their embeddings), with the chosen GEMMs and weights."""
        pairs = tokens if self.head.token_fuse is not None else self.embed(tokens).to(self._dtype)
        return self.head.project(features, pairs, positions, HEAD_GEMMS[self.head_gemms], self._int8)

    def attend(self, x: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """The head's :meth:`EagleHead.attend` with the chosen attention kernel, GEMMs and weights."""
        return self.head.attend(x, q, keys, values, mask, _specla_attention if self.attention == "specla" else None,
                                HEAD_GEMMS[self.head_gemms], self._int8)

    def _check_host_state(self) -> None:
        if self._device_cached is not None:
            raise RuntimeError("EagleDrafter: its rows follow the device since propose_after(); call begin() first")

    def _catch_up_all_but(self, last: int, request: DraftRequest, config: SpecConfig) -> None:
        """Cache the new pairs of each row but its ``last`` ones, in one head call (a prompt's, where
        ``begin`` did not cache it). The propose itself then keeps its fixed shapes and replays its graph;
        uncaptured, a whole propose costs 10-17 ms of launches on the H200. The call's pairs are padded to a
        power of two from 64: its masked attention's shape (a cuDNN plan built at each new shape, tens of ms)
        follows the prompt length only in a few steps."""
        long = [(b, seq[: seq.shape[0] - last]) for b, seq in zip(request.rows, request.sequences)
                if seq.shape[0] - 1 - self._cached[b] > last]
        if long:
            request = DraftRequest([b for b, _ in long], [seq for _, seq in long])
            self._catch_up_once(request, self._scratch(config), self._graphs_on(config))

    def _catch_up_once(self, request: DraftRequest, scratch: int, graphed: bool) -> None:
        """Cache every pair of the request's sequences (the last token's too: no pending token follows) in one
        head call, its pairs padded to a power of two from 64 (:meth:`_catch_up_all_but`); ``graphed``: as a
        replay of the captured graph of its rows and width."""
        plan = self._plan(request, scratch, round_up=True)
        features = self._new_features(plan)
        # (buffers no propose has sized yet, scratch 0, are replaced by the first propose, and graphs with them)
        graphed = graphed and self._buffers.scratch > 0 and not self._catch_up_error
        with torch.no_grad(), self._attention_kernels():
            if not (graphed and self._replay_catch_up(plan, features)):
                self._catch_up(plan, features)
        self._mark_cached(plan)

    def _replay_catch_up(self, plan: _Plan, features: torch.Tensor) -> bool:
        """The catch-up as a replay of its captured graph (captured at its rows' and width's first use, over
        the current buffers); False if it cannot be captured (the caller then runs it uncaptured)."""
        captured = self._plan_graph(("catch_up", tuple(plan.row_ids), plan.tokens.shape[1]), plan, features, self._catch_up)
        if captured is None:
            return False  # (_catch_up_error says why)
        self._replayed(captured, plan.inputs, features)
        return True

    def _mark_cached(self, plan: _Plan) -> None:
        for b, n in zip(plan.row_ids, plan.new):
            self._cached[b] += n
            self._features[b] = self._features[b][n:]

    def _static_shapes(self, config: SpecConfig | None) -> bool:
        """Whether proposes run in fixed shapes; ``None``: before any config is known (``begin``)."""
        if self.static_shapes is not None:
            return self.static_shapes
        return self._buffers.keys.is_cuda and (config is None or config.cuda_graphs is not False)

    def _graphs_on(self, config: SpecConfig | None) -> bool:
        """Whether to replay captured graphs; ``None`` (``begin``, which has no config): as the last propose's
        config said. So a new drafter's first catch-up runs uncaptured, a drafter only ever run with
        ``SpecConfig(cuda_graphs=False)`` captures nothing, and one switched to it captures at most at the next
        ``begin`` (the same pairs cached either way)."""
        wanted = self._graphs_wanted if config is None else config.cuda_graphs is not False
        return self._buffers.keys.is_cuda and wanted and not self._graph_error

    def _check_row(self, b: int) -> None:
        if not 0 <= b < len(self._cached):
            raise ValueError(f"row {b} was not started with begin()")

    def _check_features(self, feats: torch.Tensor, what: str) -> None:
        if feats.dim() != 2 or feats.shape[1] != self.head.config.hidden_size:
            raise ValueError(f"{what} must be [positions, {self.head.config.hidden_size}], got {tuple(feats.shape)}")

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Target LM head over predicted features, over ``acceptance_temperature``: ``[..., V]``, or ``[..., N]`` for
        the draft vocabulary's tokens."""
        if self._lm_weight is None:
            return self.lm_head(hidden.to(self.lm_head.weight.dtype))
        if self._lm_scale is not None:  # (int8 rows: specla's GEMM, as the head's)
            return ops.linear(hidden.to(self.lm_head.weight.dtype), self._lm_weight, self._lm_scale, self._lm_bias)
        return nn.functional.linear(hidden.to(self._lm_weight.dtype), self._lm_weight, self._lm_bias)

    def fuses_top_k(self) -> bool:
        """Whether a tree level's LM head and top-k run as one op, :meth:`top_k` (``HeadGemms.linear_top_k``: with
        ``"triton"`` and ``"specla"``, over an ``nn.Linear``'s rows or the draft vocabulary's copy); otherwise the
        tree builder scores through :meth:`logits` (an LM head module's own forward), then takes the top-k."""
        return HEAD_GEMMS[self.head_gemms].linear_top_k is not None and (
            self._lm_weight is not None or type(self.lm_head) is nn.Linear)

    def top_k(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``min(k, V)`` best score columns of :meth:`logits` after each of ``hidden [..., D]`` and their
        log-probabilities, ``[..., k]`` each, best first, as one op (where :meth:`fuses_top_k`)."""
        if not self.fuses_top_k():
            raise ValueError(f"EagleDrafter.top_k: head_gemms={self.head_gemms!r} with a {type(self.lm_head).__name__} "
                             "LM head scores through logits() (fuses_top_k() is False)")
        weight, bias = self._lm_weight, self._lm_bias
        if weight is None:
            weight, bias = self.lm_head.weight, self.lm_head.bias
        k = min(k, weight.shape[0])
        log_probs, columns = HEAD_GEMMS[self.head_gemms].linear_top_k(
            hidden.reshape(-1, hidden.shape[-1]).to(self.lm_head.weight.dtype), weight, bias, k, self._lm_scale)
        return log_probs.view(*hidden.shape[:-1], k), columns.view(*hidden.shape[:-1], k)

    def _plan(self, request: DraftRequest, scratch: int, pad_to: int | None = None, round_up: bool = False) -> _Plan:
        """Check the rows' bookkeeping, make room in the buffers (``scratch`` columns for draft nodes), and move
        what the device needs there in one copy: per row its index, cached and new pair counts, new tokens and
        pending token. The new pairs are padded to ``pad_to`` when they fit (a static propose's ``depth + 1``);
        with ``round_up``, to a power of two from 64."""
        new = []
        for b, seq in zip(request.rows, request.sequences):
            self._check_row(b)
            n = seq.shape[0] - 1 - self._cached[b]  # pairs (f_t, x_{t+1}) for t = cached .. len - 2
            if n > self._features[b].shape[0]:
                raise ValueError(
                    f"row {b}: the sequence has {seq.shape[0]} tokens but only {self._cached[b] + self._features[b].shape[0]} "
                    "target features were given (begin/commit must cover every token but the pending one)"
                )
            if n < 0:
                raise ValueError(f"row {b}: the sequence ({seq.shape[0]} tokens) is shorter than its committed history")
            if n == 0 and self._cached[b] == 0:
                raise ValueError(
                    f"row {b}: EAGLE needs at least one committed token (and its feature) before the pending one"
                )
            new.append(n)
        width = max(new)
        if pad_to is not None and width <= pad_to:
            width = pad_to
        if round_up:
            width = _room(width, 64)
        if self._buffers.reserve(max(self._cached[b] for b in request.rows) + width, scratch):
            self._graphs.clear()
        seqs = request.sequences
        # (non_blocking from pageable memory: the driver stages the data, no stream synchronisation as a blocking
        # copy: sequences on the device, as at begin() behind the prefill, leave the host free to queue on)
        meta = torch.tensor([[b, self._cached[b], n] for b, n in zip(request.rows, new)])
        meta = meta.to(seqs[0].device, non_blocking=True)
        tokens = [
            torch.cat([seq[self._cached[b] + 1 :], seq.new_zeros(width - n), seq[-1:]])
            for b, seq, n in zip(request.rows, seqs, new)
        ]
        inputs = torch.cat([meta, torch.stack(tokens)], dim=1).to(self._buffers.keys.device, non_blocking=True)
        return _Plan(list(request.rows), new, list(request.rows) == list(range(len(self._cached))), inputs)

    def _new_features(self, plan: _Plan) -> torch.Tensor:
        """The new pairs' target features ``[R, width, D]``, padded with zeros."""
        width = plan.tokens.shape[1]
        return torch.stack(
            [nn.functional.pad(self._features[b][:n], (0, 0, 0, width - n)) for b, n in zip(plan.row_ids, plan.new)]
        )

    def _device_propose(self, plan: _Plan, features: torch.Tensor, config: SpecConfig, fixed_size: bool,
                        compiled: bool) -> Draft:
        """A propose's device work: the catch-up, then the draft levels and the tree's selection; with
        ``compiled`` (fixed shapes only), as one program compiled by inductor, one per shape and config.
        Unfused, a tree level is about 75 kernels, mostly small elementwise and indexing ones, and a
        propose is bound by their count."""
        chain = config.mode == "chain"
        if not compiled:
            return Draft(*self._propose_steps(plan, features, config, fixed_size), chain=chain)
        if self._compiled_propose is None:  # (one graph: tests/test_eagle.py checks that nothing breaks it)
            self._compiled_propose = torch.compile(self._propose_steps, dynamic=False, options=self.inductor_options)
        # one program per number of rows drafted, buffer capacity and SpecConfig, for every drafter of the
        # process: Dynamo's default of 8 per function would soon run the propose eagerly
        with torch._dynamo.config.patch(recompile_limit=PROPOSE_PROGRAMS):
            return Draft(*self._compiled_propose(plan, features, config, fixed_size), chain=chain)

    def _propose_steps(self, plan: _Plan, features: torch.Tensor, config: SpecConfig,
                       fixed_size: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The device work of a propose, as tensors (what inductor compiles); reads only the plan's
        device inputs and whether it covers every row."""
        with self._attention_kernels():  # (inside the compiled code: Dynamo guards on the choice)
            self._catch_up(plan, features)
            draft = build_draft(_TreeRollout(self, plan), plan.pending, config, fixed_size)
        return draft.tokens, draft.parents

    def _replay(self, plan: _Plan, features: torch.Tensor, config: SpecConfig) -> Draft | None:
        """The propose's device work as a replay of its captured graph (captured at the key's first
        use); None if it cannot be captured (the caller then runs it uncaptured)."""
        key = (tuple(plan.row_ids), config.mode, config.depth, config.tree_top_k, config.budget, config.tau)
        compiled = self.compiled is not False
        captured = self._plan_graph(key, plan, features, lambda p, f: self._device_propose(p, f, config, True, compiled))
        return None if captured is None else self._replayed(captured, plan.inputs, features)

    def _plan_graph(self, key: tuple, plan: _Plan, features: torch.Tensor,
                    step: Callable[[_Plan, torch.Tensor], Draft | None]) -> _Captured | None:
        """``key``'s graph of ``step`` over static copies of a plan's inputs and new features, captured at the
        key's first use (its warm-up runs do the real catch-up: a replay writes the same pairs again); None if it
        cannot be captured."""
        captured = self._graphs.get(key)
        if captured is None:
            static = _Plan(plan.row_ids, plan.new, plan.every_row, plan.inputs.clone())
            static_features = features.clone()
            captured = self._captured(key, lambda: step(static, static_features), (static.inputs, static_features))
        return captured

    def _captured(self, key: tuple, step: Callable[[], Draft | None],
                  inputs: tuple[torch.Tensor, ...] = ()) -> _Captured | None:
        """``step`` captured as ``key``'s graph; None if it cannot be captured (drafting then runs uncaptured)."""
        try:
            graph, draft = capture(step)
        except RuntimeError as err:
            error = str(err).splitlines()[0]
            if key[0] == "catch_up":
                self._catch_up_error = error
                log.warning("specla: the EAGLE head's catch-up over prompts runs without CUDA graphs: its capture "
                            "failed (%s)", error)
            else:
                self._graph_error = error
                log.warning("specla: EAGLE drafting runs without CUDA graphs: its capture failed (%s)", error)
            return None
        captured = self._graphs[key] = _Captured(graph, draft, inputs)
        return captured

    @staticmethod
    def _replayed(captured: _Captured, *inputs: torch.Tensor) -> Draft | None:
        """Replay ``captured`` on ``inputs`` (copied into its static ones); the draft's copy (the next replay
        overwrites it), None for a catch-up."""
        for static, value in zip(captured.inputs, inputs):
            static.copy_(value)
        captured.graph.replay()
        draft = captured.draft
        return None if draft is None else Draft(draft.tokens.clone(), draft.parents.clone(), chain=draft.chain)

    def _catch_up(self, plan: _Plan, features: torch.Tensor) -> None:
        """Cache every pair up to the one holding the pending token, all rows in one head call."""
        width = plan.tokens.shape[1]
        if width == 0:
            return
        positions = plan.cached[:, None] + torch.arange(width, device=features.device)
        x, q, k, v = self.project(features, plan.tokens, positions)
        buffers = self._buffers
        # Written at the rows' next columns; padding pairs land past a row's valid columns (never read).
        buffers.keys[plan.rows[:, None], :, positions] = k.transpose(1, 2)
        buffers.values[plan.rows[:, None], :, positions] = v.transpose(1, 2)
        keys, values = buffers.rows(plan.rows, plan.every_row)
        # A pair sees its row's cached pairs, the new pairs before it and itself (padding ones too).
        columns = torch.arange(keys.shape[2], device=features.device)
        hidden = self.attend(x, q, keys, values, columns <= positions[..., None])
        counts = plan.counts
        newest = hidden[torch.arange(plan.inputs.shape[0], device=features.device), (counts - 1).clamp(min=0)]
        self._last_hidden[plan.rows] = torch.where(counts[:, None] > 0, newest, self._last_hidden[plan.rows])


class _TreeRollout:
    """The tree builder's step function over one ``propose``: frontier nodes attend to the rows'
    cached pairs and to their own draft ancestors, written to the buffers' scratch columns."""

    def __init__(self, drafter: EagleDrafter, plan: _Plan):
        self.drafter, self.project, self.attend = drafter, drafter.project, drafter.attend
        self.draft_vocab = drafter.draft_vocab  # (the tree builder maps score columns to these token ids)
        self.keys, self.values = drafter._buffers.rows(plan.rows, plan.every_row)
        self.column = drafter._buffers.capacity  # the next free scratch column
        columns = torch.arange(self.keys.shape[2], device=self.keys.device)
        self.seen = (columns < plan.lengths[:, None])[:, None]  # [R, W, columns] each frontier node may attend to
        self.hidden = drafter._last_hidden[plan.rows][:, None]  # [R, W, D] of the current frontier
        self.base = plan.lengths - 1  # the pending pair's position
        if not drafter.fuses_top_k():  # (the builder then scores through __call__, then takes the top-k)
            self.top_k = None

    def __call__(self, frontier: Frontier) -> torch.Tensor:
        if frontier.depth > 0:
            self._advance(frontier)
        return self.drafter.logits(self.hidden)

    def top_k(self, frontier: Frontier, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if frontier.depth > 0:
            self._advance(frontier)
        return self.drafter.top_k(self.hidden, k)

    def _advance(self, frontier: Frontier) -> None:
        width = frontier.tokens.shape[1]
        slots = frontier.parent_slots
        parent_hidden, mask = _gather_slots(self.hidden, slots), _gather_slots(self.seen, slots)
        own = slice(self.column, self.column + width)
        mask[:, :, own].logical_or_(torch.eye(width, dtype=torch.bool, device=mask.device))
        positions = (self.base + frontier.depth)[:, None].expand(-1, width)
        x, q, k, v = self.project(parent_hidden, frontier.tokens, positions)
        self.keys[:, :, own], self.values[:, :, own] = k, v
        self.hidden = self.attend(x, q, self.keys, self.values, mask)
        self.seen, self.column = mask, self.column + width
