"""``SpeculativeGenerator``: the draft -> verify -> accept loop over a ``specla``-compiled GDN model.

One iteration: the drafter proposes a tree per active row (node 0 = the pending token), the compiled
model verifies all trees in one pass (:class:`~specla_compile.lowering.session.VerifySession`; the
previous iteration's accepted records are committed inside that pass), acceptance picks a path per
row, the accepted path's factor records become pending, attention K/V (hybrid models) are compacted
to the accepted nodes. At the end the pending records are flushed, so the cache equals the cache of
plain decoding of the same tokens.
"""

from __future__ import annotations

import json
import logging
import time
import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig

from ..kernels.dispatch import TopologyHint, topology_hint
from ..lowering.capture import install, recurrence_calls
from ..lowering.fuse_projections import pack_projections
from ..lowering.session import VerifySession
from ..tree import PAD, ancestor_mask, depth
from .acceptance import Acceptance, draw_uniforms, greedy_accept, sample_accept, warp_probs
from .cache_layout import (
    attention_width,
    cache_argument,
    compact_attention,
    has_attention,
    left_padding_mask,
    past_columns_inputs,
    restore,
    returned_cache,
    set_fla_seen_tokens,
    set_seen_tokens,
    snapshot,
    stack_rows,
    zeroed_copy,
)
from .config import SpecConfig
from .distributed import broadcast_draft, tensor_parallel_mesh
from .drafting import Draft, Drafter, DraftRequest, PassOutputs, output_vocab_size
from .engine import EOS_SLOTS, PLAIN_LOOKAHEAD, PLAIN_STEPS, Sampling, StaticEngine, eos_fits
from .generation_args import GenerationArgs
from .generation_args import resolve as resolve_generation_args
from .graph_capture import capturable_experts
from .token_rows import TokenRows

log = logging.getLogger("specla_compile")


@dataclass
class GenerationStats:
    """What one ``generate`` call did. Per-row lists hold one entry per (iteration, active row)."""

    iterations: int = 0
    prefill_passes: int = 0
    new_tokens: int = 0
    accepted_drafts: list[int] = field(default_factory=list)
    tree_sizes: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    commit_seconds: float = 0.0
    seconds: float = 0.0  # the whole call, wall clock

    @property
    def target_passes(self) -> int:
        return self.prefill_passes + self.iterations

    @property
    def tokens_per_target_pass(self) -> float:
        """New tokens per target forward pass (plain decoding: 1 per row and pass)."""
        return self.new_tokens / max(self.target_passes, 1)

    @property
    def mean_accepted(self) -> float:
        """Draft tokens accepted per iteration and row (the target's own token not counted)."""
        return sum(self.accepted_drafts) / max(len(self.accepted_drafts), 1)

    @property
    def acceptance_rate(self) -> float:
        """Share of the drafted tokens (every draft node but the pending token) that were accepted, as
        vLLM's draft acceptance rate; a tree's rejected branches count as drafted."""
        drafted = sum(self.tree_sizes) - len(self.tree_sizes)
        return sum(self.accepted_drafts) / max(drafted, 1)

    @property
    def tokens_per_second(self) -> float:
        """New tokens per second of the whole call (all rows, prefill included)."""
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def first_token_match_rate(self) -> float:
        """Share of (iteration, row) whose first drafted token was accepted."""
        return sum(a > 0 for a in self.accepted_drafts) / max(len(self.accepted_drafts), 1)

    def summary(self) -> dict[str, float]:
        sizes = self.tree_sizes or [0]
        return {
            "iterations": self.iterations,
            "target_passes": self.target_passes,
            "new_tokens": self.new_tokens,
            "tokens_per_target_pass": round(self.tokens_per_target_pass, 3),
            "mean_accepted": round(self.mean_accepted, 3),
            "acceptance_rate": round(self.acceptance_rate, 3),
            "first_token_match_rate": round(self.first_token_match_rate, 3),
            "mean_tree_size": round(sum(sizes) / len(sizes), 2),
            "prefill_seconds": round(self.prefill_seconds, 4),
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "commit_seconds": round(self.commit_seconds, 4),
            "seconds": round(self.seconds, 4),
            "tokens_per_second": round(self.tokens_per_second, 1),
        }


@dataclass
class SpeculativeOutput:
    """``sequences [B, T + new]`` (prompt as given, then new tokens, ``pad_token_id`` after a row ends),
    ``stats``, and the model cache holding prompt and new tokens except each row's last."""

    sequences: torch.Tensor
    stats: GenerationStats
    past_key_values: object

    @property
    def cache(self) -> object:
        """The cache under the name transformers' outputs give it since 5.24."""
        return self.past_key_values


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# cache returned by a call on a model with attention -> [B, W]: which of its attention columns hold tokens
# (rows of a batch commit different numbers of tokens per pass, so each row's columns have gaps)
_KV_VALID: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compile_for_verification(model: torch.nn.Module, options: dict | None = None) -> torch.nn.Module:
    """``torch.compile(model, backend="specla", options=options)``, once per model and options: every
    separate compile would start Dynamo's graph cache (and its recompile limit) anew. Only the
    verification twins are compiled (``plain="eager"``): the generator prefills with the eager model."""
    per_model = _COMPILED.setdefault(model, {})
    options = {"plain": "eager", **(options or {})}
    key = json.dumps(options, sort_keys=True)
    if key not in per_model:
        from .. import backend  # noqa: F401  (registers "specla" by name where no entry point is installed)

        per_model[key] = torch.compile(model, backend="specla", options=options)
    return per_model[key]


class SpeculativeGenerator:
    """Speculative decoding of a GDN model with a drafter.

    ``model``: an eager fla / transformers causal LM (compiled here with ``backend="specla"`` and
    ``compile_options``) or one already compiled with that backend. The weights of projections that
    read one input are packed back to back in place (same values; see
    :func:`~specla_compile.lowering.fuse_projections.pack_projections`), so the compiled passes run
    each group as one GEMM.

    ``shared_features``: every call, plain decoding (:meth:`decode`) included, runs through the static
    engine whose passes also return the target's last hidden state, whether its drafter reads it or not.
    Returning the hidden state changes the compiled graph, so otherwise drafters with features (EAGLE),
    drafters without (n-gram) and plain decoding compile and capture their passes twice; shared, a GDN
    model verifies every route through one compiled graph (the engine's node dimension is dynamic) and
    one static cache, at the price of one more output per pass (``[B, N, D]``). For a benchmark that
    swaps drafters on one generator.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        drafter: Drafter,
        config: SpecConfig | None = None,
        *,
        compile_options: dict | None = None,
        shared_features: bool = False,
    ):
        if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
            self.compiled, self.model = model, model._orig_mod
        else:
            self.model = model
            self.compiled = compile_for_verification(model, compile_options)
        self.drafter = drafter
        self.config = config or SpecConfig()
        self.vocab_size = output_vocab_size(self.model)
        drafter.check_vocab(self.vocab_size)
        self.tp_mesh = tensor_parallel_mesh(self.model)  # tensor-parallel: every rank verifies rank 0's drafts
        if self.tp_mesh is None:  # one eager forward: packs the projections, and finds the GDN layers
            install()
            before = recurrence_calls()
            pack_projections(self.model, torch.zeros(1, 2, dtype=torch.long, device=next(self.model.parameters()).device))
            if recurrence_calls() == before:
                raise ValueError(
                    f"{type(self.model).__name__} has no GDN layer that specla can verify (fla's GatedDeltaNet, transformers' "
                    "Qwen3.5 / Qwen3-Next, or a recurrence named with specla_compile.lowering.capture.register_recurrence)"
                )
        self.shared_features = shared_features
        self._engines: dict[bool, StaticEngine] = {}

    def engine_features(self, drafter: Drafter) -> bool:
        """Whether a call with ``drafter`` runs through the engine that returns features."""
        return drafter.needs_features or self.shared_features

    def engine(self, device: torch.device, features: bool) -> StaticEngine | None:
        """The static engine of this generator (None when ``SpecConfig.engine`` is "dynamic"); CUDA graphs
        on CUDA unless ``SpecConfig.cuda_graphs`` is False."""
        if self.config.engine != "static":
            return None
        if features not in self._engines:
            graphs = device.type == "cuda" and self.config.cuda_graphs is not False
            if graphs:
                capturable_experts(self.model)
            self._engines[features] = StaticEngine(self.compiled, self.model.config, graphs=graphs, features=features)
        return self._engines[features]

    @torch.no_grad()
    def decode(self, input_ids: torch.Tensor, max_new_tokens: int = 32, **kwargs) -> SpeculativeOutput:
        """Plain decoding, one token per target pass, through the same engine (static buffers, CUDA
        graphs, kernels) as :meth:`generate`: the honest baseline of every speedup. Same arguments."""
        return self.generate(input_ids, max_new_tokens, _plain=True, **kwargs)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | list[int] | None = None,
        attention_mask: torch.Tensor | None = None,
        streamer=None,
        *,
        generation_config: GenerationConfig | None = None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
        past_key_values=None,
        cache=None,
        _plain: bool = False,
        **kwargs,
    ) -> SpeculativeOutput:
        """Generate up to ``max_new_tokens`` per row; the same tokens as plain decoding when greedy, the
        same distribution when sampling. Arguments follow transformers' ``generate``: keywords override
        ``generation_config`` (also ``max_length``), EOS and pad tokens not given come from the model's
        ``generation_config``, and a setting this loop does not support (``repetition_penalty``,
        ``num_return_sequences``, ``logits_processor``, ...) raises ``ValueError`` naming it. Without
        either, greedy decoding of 32 new tokens. ``attention_mask`` marks each row's real tokens (left or
        right padding). ``past_key_values`` continues from a cache that an earlier call returned (rows
        then all have the same new length; a batched hybrid cache must come from this generator); ``cache`` is
        the same argument under the name transformers uses since 5.24."""
        if cache is not None and past_key_values is not None:
            raise ValueError("pass the cache to continue from as cache= or as past_key_values=, not both")
        past_key_values = cache if cache is not None else past_key_values
        explicit = {"max_new_tokens": max_new_tokens, "do_sample": do_sample, "temperature": temperature,
                    "top_k": top_k, "top_p": top_p, "eos_token_id": eos_token_id, "pad_token_id": pad_token_id}
        rows = self._check_inputs(input_ids, attention_mask, streamer, past_key_values)
        args = resolve_generation_args(self.model, input_ids.shape[1], generation_config, explicit, kwargs)
        if args.do_sample:
            warp_probs(torch.zeros(1, 1), *args.warp)  # validates the warper arguments
        saved = snapshot(past_key_values) if past_key_values is not None else None
        try:
            drafter = _PlainDrafter() if _plain else self.drafter
            engine = self.engine(input_ids.device, self.engine_features(drafter))
            if engine is not None and not eos_fits(args.eos_token_ids):
                log.warning("specla: %d EOS ids, more than the %d that the engine's passes check on the device: "
                            "decoding without the static engine", len(set(args.eos_token_ids)), EOS_SLOTS)
                engine = None
            run_type = _Run if engine is None else _StaticRun
            if engine is not None and _plain:
                run_type = _PlainDeviceRun
            run = run_type(self, drafter, rows, args, streamer, generator, engine)
            return run.run(input_ids, past_key_values)
        except BaseException:
            if saved is not None:
                restore(past_key_values, saved)
            raise

    def _check_inputs(self, input_ids, attention_mask, streamer, past_key_values) -> list[torch.Tensor]:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            raise ValueError("input_ids must be an integer tensor of shape [batch, length]")
        if input_ids.numel() == 0:
            raise ValueError("input_ids is empty: every row needs at least one token")
        if (input_ids < 0).any() or (input_ids >= self.vocab_size).any():
            raise ValueError(f"input_ids hold token ids outside the model's vocabulary [0, {self.vocab_size})")
        if streamer is not None and input_ids.shape[0] != 1:
            raise ValueError("streaming supports batch size 1 only (as in transformers)")
        if attention_mask is None:
            return list(input_ids)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
        if past_key_values is not None and not attention_mask.bool().all():
            raise ValueError("continuing from past_key_values needs rows of equal length (no padding)")
        rows = [ids[mask.bool()] for ids, mask in zip(input_ids, attention_mask)]
        if any(r.numel() == 0 for r in rows):
            raise ValueError("a row of input_ids has no real token (its attention_mask is all zeros)")
        return rows


class _Run:
    """The state of one ``generate`` call, and its loop on the dynamic path: each pass calls the compiled model on
    the model's own growing cache and the host accepts (``SpecConfig(engine="dynamic")``, or more EOS ids than the
    engine checks). :class:`_StaticRun` runs the passes through the static engine instead."""

    def __init__(self, owner: SpeculativeGenerator, drafter: Drafter, rows, args: GenerationArgs, streamer, generator,
                 engine: StaticEngine | None = None):
        self.owner, self.compiled, self.drafter, self.config = owner, owner.compiled, drafter, owner.config
        self.engine = engine  # (the static engine of a _StaticRun)
        self.rows = [r.long() for r in rows]
        # where the host's bookkeeping tensors (committed lengths, pending tokens, drafts) live: the target's device,
        # the CPU once a static run starts (the engine keeps its own copies on the device)
        self.book_device = self.target_device = self.rows[0].device
        self.batch = len(rows)
        self.max_new_tokens = args.max_new_tokens
        self.do_sample, self.warp, self.generator = args.do_sample, args.warp, generator
        self.eos = args.eos_token_ids
        self.pad_token_id = args.pad_token_id
        self.cache_arg = cache_argument(owner.model)
        self.streamer = streamer
        self.stats = GenerationStats()
        self.session = VerifySession()
        self.nodes = 1 if isinstance(drafter, _PlainDrafter) else self.config.pass_nodes(self.batch)
        self.new_tokens: list[list[int]] = [[] for _ in rows]
        self.finished = [False] * self.batch
        self.phase_events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.stream = torch.cuda.current_stream(self.target_device) if self.target_device.type == "cuda" else None
        self.drafter_on_device = False  # the drafter drafts from the passes' device outputs (no commit calls)

    @contextmanager
    def _timed(self, what: str):
        """Add the block's time to ``stats.<what>``. On CUDA two events bracket it, read when the call ends:
        waiting for the device after each phase would stall the pipeline (the host could not queue the
        verify pass while the draft runs)."""
        if self.target_device.type != "cuda":
            start = time.perf_counter()
            yield
            setattr(self.stats, what, getattr(self.stats, what) + time.perf_counter() - start)
            return
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.stream)
        yield
        end.record(self.stream)
        self.phase_events.append((what, start, end))

    def _read_phase_events(self) -> None:
        """Add the CUDA-event phase times to the stats (after the device finished the call)."""
        for what, start, end in self.phase_events:
            setattr(self.stats, what, getattr(self.stats, what) + start.elapsed_time(end) / 1000)
        self.phase_events = []

    # --- prefill ---------------------------------------------------------------------------------

    def _past_columns(self, cache) -> torch.Tensor:
        """``[B, W]``: which attention columns of a cache to continue from hold tokens. A batched cache must
        come from this generator (rows of a batch leave gaps between their columns); one row's holds no gap."""
        width = attention_width(cache)
        valid = _KV_VALID.get(cache)
        if valid is None and self.batch > 1:
            raise NotImplementedError(
                "continuing a batched hybrid-model cache needs the cache that a call of this generator returned "
                "(which attention columns of each row hold tokens is known only for those); continue rows one by one"
            )
        if valid is None:
            valid = torch.ones(1, width, dtype=torch.bool, device=self.book_device)
        if valid.shape != (self.batch, width):
            raise ValueError(
                f"the cache holds {width} attention columns, its call returned {valid.shape[1]} for "
                f"{valid.shape[0]} rows, and this call has {self.batch} rows (was the cache changed after that call?)"
            )
        return valid.to(self.book_device)

    def _model_kwargs(self) -> dict:
        return {"use_cache": True, "output_hidden_states": self.drafter.needs_features}

    def _prefill(self, past_key_values):
        """Process the prompts with the eager model (a plain call of the compiled one is the same
        computation, but every prompt length would be a new graph); returns the first new token of every
        row. Rows of equal length run as one batch; ragged rows run one at a time (exact lengths, no
        padding inside GDN states) and are stacked into one batched cache."""
        outs = []
        past_valid = None
        if past_key_values is not None and has_attention(past_key_values):
            past_valid = self._past_columns(past_key_values)
        if past_key_values is not None or len({r.numel() for r in self.rows}) == 1:
            new_tokens = torch.stack(self.rows)
            kwargs = self._model_kwargs()
            if past_valid is not None:  # the new tokens see each row's own columns, at each row's own positions
                kwargs.update(past_columns_inputs(past_valid, new_tokens.shape[1]))
            out = self.owner.model(input_ids=new_tokens, **{self.cache_arg: past_key_values}, **kwargs)
            self.stats.prefill_passes = 1
            self.cache = returned_cache(out)
            if past_valid is not None:
                before = past_valid.sum(-1)
            else:
                before = _committed_length(past_key_values) if past_key_values is not None else 0
            self.committed = before + torch.tensor([r.numel() for r in self.rows], device=self.book_device)
            outs = [(out.logits[b, -1], out.hidden_states[-1][b] if self.drafter.needs_features else None) for b in range(self.batch)]
        else:
            caches = []
            for row in self.rows:
                out = self.owner.model(input_ids=row[None], **self._model_kwargs())
                caches.append(returned_cache(out))
                outs.append((out.logits[0, -1], out.hidden_states[-1][0] if self.drafter.needs_features else None))
            self.stats.prefill_passes = self.batch
            lengths = [r.numel() for r in self.rows]
            self.cache = caches[0] if self.batch == 1 else stack_rows(caches, lengths)
            self.committed = torch.tensor(lengths, device=self.book_device)
        self.attention = has_attention(self.cache)
        if past_valid is not None:
            self.kv_valid = kwargs["attention_mask"].bool()
        elif self.attention:
            self.kv_valid = left_padding_mask(self.committed)
        features = [o[1] for o in outs] if self.drafter.needs_features else None
        return self._begin(torch.stack([o[0] for o in outs]), features)

    def _begin(self, logits: torch.Tensor, features: list[torch.Tensor] | None) -> torch.Tensor:
        """End of the prefill: the first new token of every row from the logits after its prompt ``[B, V]``;
        the drafter starts on the prompts (and their features when it reads them)."""
        first = self._sample(logits)
        self.drafter.begin([r.clone() for r in self.rows], features if self.drafter.needs_features else None)
        return first

    def _sample(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.do_sample:
            return logits.argmax(-1)
        probs = warp_probs(logits, *self.warp)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)

    # --- one iteration -------------------------------------------------------------------------

    def _draft(self, active: list[int]) -> Draft:
        """Draft trees of the active rows placed into ``[B, nodes]`` (finished rows: pending token only)."""
        request = DraftRequest(active, self._sequences(active))
        draft: Draft = self.drafter.propose(request, self.config)
        if self.owner.tp_mesh is not None and not isinstance(self.drafter, _PlainDrafter):  # (plain: the pending tokens, equal)
            draft = broadcast_draft(draft, self.owner.tp_mesh)
        return self._placed(draft, active)

    def _sequences(self, active: list[int]) -> list[torch.Tensor]:
        """Each active row's history followed by its pending token (what a drafter reads)."""
        return [torch.cat([self.rows[b], self.pending[b : b + 1]]) for b in active]

    def _extend(self, active: list[int], committed: list[list[int]]) -> list[torch.Tensor]:
        """Append each active row's committed tokens to its history; returns them as tensors."""
        new = [torch.tensor(tokens, device=self.book_device) for tokens in committed]
        for b, tokens in zip(active, new):
            self.rows[b] = torch.cat([self.rows[b], tokens])
        return new

    def _placed(self, draft: Draft, active: list[int]) -> Draft:
        """A draft of the ``active`` rows placed into ``[B, nodes]`` (finished rows: pending token only)."""
        n = draft.tokens.shape[1]
        if n > self.nodes:
            raise ValueError(f"{type(self.drafter).__name__} proposed {n} nodes, more than the configured {self.nodes}")
        tail = (0, self.nodes - n)
        if len(active) == self.batch:  # every row drafted: pad the draft (padding tokens are never read)
            device = self._draft_device(draft)
            tokens, parents = draft.tokens.to(device), draft.parents.to(device)
            if n < self.nodes:
                tokens, parents = torch.nn.functional.pad(tokens, tail), torch.nn.functional.pad(parents, tail, value=PAD)
        else:
            tokens = self.pending[:, None].repeat(1, self.nodes)
            parents = torch.full((self.batch, self.nodes), PAD, dtype=torch.long, device=self.book_device)
            parents[:, 0] = -1
            index = torch.tensor(active, device=self.book_device)
            tokens[index, :n] = draft.tokens.to(self.book_device)
            parents[index, :n] = draft.parents.to(self.book_device)
        probs = None
        if draft.probs is not None:
            index = torch.tensor(active, device=self.book_device)
            probs = torch.zeros(self.batch, self.nodes, draft.probs.shape[-1], device=self.book_device)
            probs[index, :n] = draft.probs.to(self.book_device, torch.float32)
        return Draft(tokens, parents, probs, draft.chain)

    def _draft_device(self, draft: Draft) -> torch.device:
        """Where the verify pass takes a draft: the model's device."""
        return self.target_device

    def _verify(self, tokens: torch.Tensor, parents: torch.Tensor):
        kwargs = self._model_kwargs()
        tree_mask = None
        if self.attention:
            tree = ancestor_mask(parents, inclusive=True)
            past = self.kv_valid[:, None, None, :].expand(-1, 1, self.nodes, -1)
            tree_mask = torch.cat([past, tree[:, None]], dim=-1)
            kwargs["position_ids"] = self.committed[:, None] + depth(parents)
        with self.session.verify(parents, tree_mask), topology_hint(TopologyHint.from_parents(parents)):
            out = self.compiled(input_ids=tokens, **{self.cache_arg: self.cache}, **kwargs)
        if not self.session.records:
            raise ValueError(
                "the verification pass went through no GDN layer: the model has none, was compiled with another "
                "backend than 'specla', or Dynamo hit its recompile limit and ran the model eagerly"
            )
        return out

    def _accept(self, tokens, parents, probs, logits) -> Acceptance:
        if not self.do_sample:
            return greedy_accept(tokens, parents, logits)
        return sample_accept(tokens, parents, warp_probs(logits, *self.warp), probs, self.generator)

    def _emit(self, acceptance: Acceptance, tokens: torch.Tensor) -> list[list[int]]:
        """New tokens per row: the accepted drafts then the target's token, cut at EOS and at the budget."""
        paths, counts = acceptance.path.tolist(), acceptance.num_accepted.tolist()
        drafted, next_tokens = tokens.tolist(), acceptance.next_token.tolist()
        raw = counts if acceptance.accepted_before_cut is None else acceptance.accepted_before_cut.tolist()
        emitted = []
        for b in range(self.batch):
            if self.finished[b]:
                emitted.append([])
                continue
            row = [drafted[b][j] for j in paths[b][1 : counts[b]]] + [next_tokens[b]]
            row = self._cut_at_eos(row[: self.max_new_tokens - len(self.new_tokens[b])])
            self.stats.accepted_drafts.append(raw[b] - 1)
            emitted.append(row)
        return emitted

    def _cut_at_eos(self, row: list[int]) -> list[int]:
        for i, token in enumerate(row):
            if token in self.eos:
                return row[: i + 1]
        return row

    def _record(self, emitted: list[list[int]]) -> None:
        for b, row in enumerate(emitted):
            if not row:
                continue
            self.new_tokens[b] += row
            self.stats.new_tokens += len(row)
            if row[-1] in self.eos or len(self.new_tokens[b]) >= self.max_new_tokens:
                self.finished[b] = True
        if self.streamer is not None and emitted[0]:
            self.streamer.put(torch.tensor(emitted[0]))

    def _commit(self, acceptance: Acceptance, emitted: list[list[int]], hidden) -> None:
        """Keep the first ``len(emitted[b])`` accepted nodes of every row: the old pending token and the
        accepted drafts before the new pending token."""
        counts = torch.tensor([len(e) for e in emitted], device=self.book_device)
        self.session.accept(acceptance.path, counts)
        width = int(counts.max())
        if self.attention:
            past = self.kv_valid.shape[1]
            compact_attention(self.cache, past, acceptance.path, width)
            new_valid = torch.arange(width, device=self.book_device)[None] < counts[:, None]
            self.kv_valid = torch.cat([self.kv_valid, new_valid], dim=1)
        self.committed += counts
        set_fla_seen_tokens(self.cache, int(self.committed.max()))
        self._advance(acceptance, emitted, hidden)

    def _advance(self, acceptance: Acceptance, emitted: list[list[int]], hidden) -> None:
        """Host side of a commit: the drafter, the token history and the pending tokens."""
        active = [b for b, e in enumerate(emitted) if e]
        pending = self.pending.tolist()
        # the committed tokens are the old pending token and the accepted drafts: emitted minus its last
        committed = self._extend(active, [[pending[b]] + emitted[b][:-1] for b in active])
        if not self.drafter_on_device:
            features = None
            if hidden is not None and self.drafter.needs_features:  # (a shared features engine returns them to all)
                paths = acceptance.path.to(hidden.device, non_blocking=True)  # (pageable: staged, no stream synchronisation)
                features = [hidden[b, paths[b, : len(emitted[b])]] for b in active]
            self.drafter.commit(active, committed, features)
        self.pending = torch.tensor([e[-1] if e else p for e, p in zip(emitted, pending)], device=self.book_device)

    def _pass(self, draft: Draft) -> tuple[Acceptance, torch.Tensor | None, Draft]:
        """One target pass over a padded draft and its acceptance: ``(acceptance, last hidden state or None,
        the draft where the host reads it)``."""
        out = self._verify(draft.tokens, draft.parents)
        acceptance = self._accept(draft.tokens, draft.parents, draft.probs, out.logits)
        return acceptance, (out.hidden_states[-1] if self.drafter.needs_features else None), draft

    def _start(self) -> None:
        """After the prefill, before the first pass."""

    def _finish(self) -> None:
        self.session.flush()
        set_seen_tokens(self.cache, int(self.committed.max()))  # (transformers' counters too: once, not every pass)

    # --- the loop ------------------------------------------------------------------------------

    def run(self, input_ids: torch.Tensor, past_key_values) -> SpeculativeOutput:
        start = time.perf_counter()
        self._loop(input_ids, past_key_values)
        if self.target_device.type == "cuda":
            torch.cuda.synchronize(self.target_device)
        self.stats.seconds = time.perf_counter() - start
        self._read_phase_events()
        pad = self.pad_token_id if self.pad_token_id is not None else (self.eos[0] if self.eos else 0)
        longest = max(len(t) for t in self.new_tokens)
        new = torch.full((self.batch, longest), pad, dtype=input_ids.dtype, device=input_ids.device)
        for b, toks in enumerate(self.new_tokens):
            new[b, : len(toks)] = torch.tensor(toks, dtype=input_ids.dtype)
        if self.attention:
            _KV_VALID[self.cache] = self._final_columns().clone()
        return SpeculativeOutput(torch.cat([input_ids, new], dim=1), self.stats, self.cache)

    def _final_columns(self) -> torch.Tensor:
        return self.kv_valid

    def _loop(self, input_ids: torch.Tensor, past_key_values) -> None:
        with self._timed("prefill_seconds"):
            first = self._prefill(past_key_values)
        self.pending = first
        if self.streamer is not None:
            self.streamer.put(input_ids[0].cpu())
        self._record([[t] for t in first.tolist()])
        self._start()
        while not all(self.finished):
            self._iteration()
        with self._timed("commit_seconds"):
            self._finish()
        if self.streamer is not None:
            self.streamer.end()

    def _iteration(self) -> None:
        """Draft, verify, accept and commit once for every active row."""
        active = [b for b in range(self.batch) if not self.finished[b]]
        with self._timed("draft_seconds"):
            draft = self._draft(active)
        with self._timed("verify_seconds"):
            acceptance, hidden, verified = self._pass(draft)
        self._conclude(acceptance, hidden, verified, active)

    def _conclude(self, acceptance: Acceptance, hidden, verified: Draft, active: list[int]) -> None:
        """End of an iteration: emit and record the accepted tokens, commit them, count."""
        with self._timed("commit_seconds"):
            emitted = self._emit(acceptance, verified.tokens)
            self._record(emitted)
            self._commit(acceptance, emitted, hidden)
        self.stats.iterations += 1
        sizes = [len(row) - row.count(PAD) for row in verified.parents.tolist()]  # (host lists: cheaper than tensor ops)
        self.stats.tree_sizes += [sizes[b] for b in active]


class _StaticRun(_Run):
    """A ``generate`` call through the :class:`~.engine.StaticEngine`: the prompts run through its passes
    from an empty cache (``SpecConfig.prefill``), or an eager prefill's cache is copied into its static
    buffers; every pass is a replay, its acceptance (greedy or sampled) and the commit run on the device inside
    it, and the host reads the accepted path once per pass."""

    def _prefill(self, past_key_values):
        self.engine_started = False
        cache = None
        wanted = self.config.prefill == "engine" or (self.config.prefill is None and self.engine.graphs)
        if wanted and past_key_values is None and self.owner.tp_mesh is None:
            cache = self._empty_cache()
        if cache is None:
            return super()._prefill(past_key_values)
        self.engine.start(cache, torch.zeros(self.batch, dtype=torch.long, device=self.book_device), None)
        self.engine_started = True
        logits, features = self.engine.prefill(self.rows)
        self.cache, self.attention = cache, False
        self.committed = torch.tensor([r.numel() for r in self.rows], device=self.book_device)
        self.stats.prefill_passes = self.engine.prefill_passes
        return self._begin(logits, features)

    def _draft_device(self, draft: Draft) -> torch.device:
        """Where the drafter made it: the engine takes host and device drafts alike, and moving a device
        draft to the host's bookkeeping would wait for the whole draft graph before the host could even
        queue the verify pass."""
        return draft.tokens.device

    def _empty_cache(self):
        """A cache of the engine's layout for this batch with zero states (what a prompt starts from), or
        None for a model with attention layers. Its layout comes from the engine's static cache, else
        (a process's first call at this batch size) from a one-token eager forward."""
        template = self.engine.cache
        if template is None or self.engine.committed.shape[0] != self.batch:
            one = torch.zeros(self.batch, 1, dtype=torch.long, device=self.book_device)
            template = returned_cache(self.owner.model(input_ids=one, use_cache=True))
        return None if has_attention(template) else zeroed_copy(template)

    def _start(self) -> None:
        if not self.engine_started:
            columns = self.kv_valid.shape[1] if self.attention else 0
            # attention columns: powers of two from 256, so that calls of similar lengths share graphs
            capacity = max(256, 1 << (columns + self.max_new_tokens + self.nodes).bit_length()) if self.attention else 0
            self.engine.start(self.cache, self.committed, self.kv_valid if self.attention else None, capacity)
        # every pass stops rows on the device (EOS, budget): the host never trims them
        self.engine.begin_generation(list(self.eos), [self.max_new_tokens - len(t) for t in self.new_tokens], self.finished)
        # from here on the host keeps its bookkeeping (history, pending tokens, drafts) on the CPU
        self.book_device = torch.device("cpu")
        self.max_length = max(r.numel() for r in self.rows) + 1 + self.max_new_tokens  # (prompt, pending, new tokens)
        self.history = TokenRows(self.rows, self.max_length)  # (each row's history from here on; self.rows keeps the prompts)
        self.pending = self.pending.cpu()
        self.next_draft: Draft | None = None  # drafted on the device behind the pass in flight
        self.in_flight: deque[tuple[PassOutputs, bool | None, int]] = deque()  # passes launched, not collected: outputs, chain, nodes
        self.pipelined = self.owner.tp_mesh is None and self.config.pipelined is not False

    def _iteration(self) -> None:
        """The pass is queued and, where the drafter can, the next draft behind it (pipelined:
        ``SpecConfig.pipelined``), then the next pass behind that draft, before the host reads the first: every
        pass accepts and stops rows at EOS and at their budgets on the device, so the device runs pass after pass
        while the host does its bookkeeping. The next pass is queued that early only where the pass before it
        cannot end every row by its budget (a row's EOS can: the pass queued after it then commits nothing), else
        once the host has read that some row goes on."""
        active = [b for b in range(self.batch) if not self.finished[b]]
        left = [self.max_new_tokens - len(self.new_tokens[b]) for b in active]  # tokens each row may still emit
        if not self.in_flight:
            with self._timed("draft_seconds"):
                draft = self._draft(active)
            self._launch(draft, left)
        early = self.next_draft is not None and len(self.in_flight) == 1 and max(left) > self.in_flight[0][2]
        if early and self.engine.has_room(self.next_draft.tokens.shape[1]):
            self._launch(self.next_draft, [n - 1 for n in left])  # (the pass in flight emits at least one token a row)
        last, chain, _ = self.in_flight.popleft()
        with self._timed("verify_seconds"):
            acceptance = self.engine.collect()
        verified = Draft(*self.engine.verified_draft, chain=chain)
        if self.next_draft is not None and not self.in_flight and any(self.engine.active_rows):
            counts = acceptance.num_accepted.tolist()
            alive = [b for b, on in enumerate(self.engine.active_rows) if on]
            self._launch(self.next_draft, [self.max_new_tokens - len(self.new_tokens[b]) - counts[b] for b in alive])
        self._conclude(acceptance, last.hidden, verified, active)

    def _launch(self, draft: Draft, budgets: list[int]) -> None:
        """Queue the pass over ``draft`` and, where the drafter can and a row has ``budgets`` (tokens left before
        this pass, or a bound on them) for more than this pass, the next draft behind it."""
        sampling = None
        if self.do_sample:  # (the uniforms drawn on the target's device, as the dynamic path draws them)
            uniforms = draw_uniforms(self.batch, draft.tokens.shape[1], self.generator, self.target_device)
            sampling = Sampling(self.warp, uniforms, draft.probs)
        with self._timed("verify_seconds"):
            outputs = self.engine.launch(draft.tokens, draft.parents, draft.chain, sampling)
        self.in_flight.append((outputs, draft.chain, draft.tokens.shape[1]))
        self.next_draft = None
        if self.pipelined and any(budget > 1 for budget in budgets):  # (else every row ends with this pass)
            with self._timed("draft_seconds"):
                proposed = self.drafter.propose_after(outputs, self.config, self.max_length)
                self.next_draft = None if proposed is None else self._placed(proposed, list(range(self.batch)))
            if proposed is None and self.drafter_on_device:  # (its state follows the device: it cannot go back)
                raise RuntimeError(f"{type(self.drafter).__name__}.propose_after returned None after drafting on the device")
            self.pipelined = self.drafter_on_device = proposed is not None

    def _sequences(self, active: list[int]) -> list[torch.Tensor]:
        pending = self.pending.tolist()
        return [self.history.with_pending(b, pending[b]) for b in active]

    def _extend(self, active: list[int], committed: list[list[int]]) -> list[torch.Tensor]:
        return [self.history.append(b, tokens) for b, tokens in zip(active, committed)]

    def _commit(self, acceptance: Acceptance, emitted, hidden) -> None:
        kept, counts = [len(e) for e in emitted], acceptance.num_accepted.tolist()
        if kept != counts:  # (the device cut the pass: a disagreement is a bug, not something to trim)
            raise RuntimeError(f"specla: the engine kept {counts} tokens per row where the host kept {kept}")
        self._advance(acceptance, emitted, hidden)

    def _finish(self) -> None:
        self.cache = self.engine.finish()

    def _final_columns(self) -> torch.Tensor:
        return self.engine.kv_valid[:, : self.engine.columns]


class _PlainDeviceRun(_StaticRun):
    """Plain decoding (greedy or sampled) through the engine with the loop on the device: the host reads ``PLAIN_STEPS``
    passes per synchronisation while the device runs the ``PLAIN_LOOKAHEAD`` passes queued behind them
    (:meth:`~.engine.StaticEngine.queue_steps`, :meth:`~.engine.StaticEngine.read_steps`), never past the
    token budget; a row stops at EOS on the device. The strongest plain baseline the engine offers."""

    def _start(self) -> None:
        super()._start()
        self.unread: int | None = None  # passes queued and not read yet (None: decoding has not begun)

    def _iteration(self) -> None:
        """Queue passes up to a block of ``PLAIN_STEPS`` and ``PLAIN_LOOKAHEAD`` more behind it, then read the
        block: the device runs the lookahead while the host reads."""
        if self.unread is None:
            self.engine.begin_decoding(self.pending, self.warp if self.do_sample else None)
            self.unread = 0
        emitted_so_far = max(len(t) for t, done in zip(self.new_tokens, self.finished) if not done)
        left = self.max_new_tokens - emitted_so_far - self.unread  # passes not queued yet
        block = min(PLAIN_STEPS, self.unread + left)
        ahead = min(PLAIN_LOOKAHEAD, left - (block - self.unread))
        with self._timed("verify_seconds"):
            for steps in (block - self.unread, ahead):
                if steps:
                    self.engine.queue_steps(steps, self._uniforms(steps))
            tokens, _ = self.engine.read_steps(block)  # (the commit counts: the engine advances its columns by them)
        self.unread = ahead
        with self._timed("commit_seconds"):
            emitted = [[] if done else self._cut_at_eos(row) for row, done in zip(tokens.tolist(), self.finished)]
            for b, row in enumerate(emitted):
                if row:
                    self.pending[b] = row[-1]
                    self.stats.accepted_drafts += [0] * len(row)
                    self.stats.tree_sizes += [1] * len(row)
            self._record(emitted)
        self.stats.iterations += block

    def _uniforms(self, steps: int) -> torch.Tensor | None:
        """``steps`` sampled passes' uniforms ``[steps, B, 1]``, in one draw (None: greedy). A CPU generator gives the
        numbers the dynamic path draws pass by pass; a CUDA one, others (its draws of one size are not those of
        several smaller ones)."""
        if not self.do_sample:
            return None
        return draw_uniforms(steps * self.batch, 1, self.generator, self.target_device).view(steps, self.batch, 1)


class _PlainDrafter(Drafter):
    """Drafts nothing: every pass verifies the pending token alone (plain decoding)."""

    def propose(self, request: DraftRequest, config: SpecConfig) -> Draft:
        tokens = torch.stack([seq[-1:] for seq in request.sequences])
        return Draft(tokens, torch.full_like(tokens, -1), chain=True)


def _committed_length(cache) -> int:
    getter = getattr(cache, "get_seq_length", None)
    return int(getter()) if getter is not None else 0
