"""Reliability, measured on CPU: greedy speculative decoding over many random cases equals plain
decoding, and sampled decoding through the static engine (acceptance on the device) emits what the dynamic
path's host walk emits; long runs do not drift from plain decoding's states; faults in the middle of a call leave
the caller's cache as it was (and the generator usable)."""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Callable

import pytest
import torch
from cache_utils import cache_tensors
from models import FAMILIES, VOCAB, tiny_model
from test_generator import OracleDrafter

from specla_compile import SpecConfig, SpeculativeGenerator
from specla_compile.runtime import engine as engine_module
from specla_compile.runtime import generator as generator_module
from specla_compile.runtime.baseline import autoregressive_generate
from specla_compile.runtime.drafting import Draft, Drafter, DraftRequest
from specla_compile.runtime.tree_builder import draft_from_paths

CONFIGS = [  # chains, and trees of every size up to 128 nodes (the pending token included) in one bucket
    SpecConfig(mode="chain", depth=5, bucket=8),
    SpecConfig(mode="tree", budget=127, bucket=128),
]
FAST = {"inner": "eager"}  # (the inner compilers have their own tests; here compile time would dominate)
CALLS, ROWS, NEW = 6, 12, 10  # per family: 6 calls of 12 ragged rows = 72 cases (216 over the families)


class RandomTreeDrafter(Drafter):
    """Random draft shapes of random size up to the configured one. Each node continues the previous
    node (half the time) or a uniformly drawn earlier node; a node whose path is the true continuation
    so far gets the next true token with probability ``p`` (at most one such child per node), any other
    node a random token."""

    def __init__(self, continuations: list[list[int]], p: float, seed: int):
        self.continuations, self.p = continuations, p
        self.rng = random.Random(seed)

    def begin(self, sequences, features=None):
        self.prompt_lengths = [s.numel() for s in sequences]

    def _tree(self, truth: list[int], size: int, chain: bool) -> list[tuple[int, int]]:
        on_truth, depth, has_true_child = [True], [0], [False]
        nodes = []
        for j in range(1, size + 1):
            parent = j - 1 if chain or self.rng.random() < 0.5 else self.rng.randrange(j)
            true_next = on_truth[parent] and not has_true_child[parent] and depth[parent] < len(truth)
            if true_next and self.rng.random() < self.p:
                token, has_true_child[parent] = truth[depth[parent]], True
            else:
                token = self.rng.randrange(VOCAB)
            on_truth.append(true_next and token == truth[depth[parent]])
            depth.append(depth[parent] + 1)
            has_true_child.append(False)
            nodes.append((token, parent))
        return nodes

    def propose(self, request: DraftRequest, config: SpecConfig) -> Draft:
        chain = config.mode == "chain"
        rows = []
        for b, seq in zip(request.rows, request.sequences):
            rows.append(self._tree(self._truth(b, seq), self.rng.randint(0, config.max_nodes - 1), chain))
        return draft_from_paths(torch.stack([s[-1] for s in request.sequences]), rows)

    def _truth(self, row: int, sequence: torch.Tensor) -> list[int]:
        """The tokens the drafts follow after ``sequence`` (the pending token last)."""
        return self.continuations[row][sequence.numel() - self.prompt_lengths[row] :]


class RandomSamplingDrafter(RandomTreeDrafter):
    """:class:`RandomTreeDrafter`'s shapes following the greedy continuation of each row as it stands (a sampled
    row leaves the one of its prompt), with, where ``with_probs``, a random draft distribution at every node that
    puts most of its mass on its children's tokens (as a sampling drafter hands them over)."""

    def __init__(self, model: torch.nn.Module, p: float, seed: int, with_probs: bool, ahead: int):
        super().__init__([], p, seed)
        self.model, self.with_probs, self.ahead = model, with_probs, ahead

    def _truth(self, row: int, sequence: torch.Tensor) -> list[int]:
        return autoregressive_generate(self.model, sequence[None], self.ahead)[0][0, sequence.numel() :].tolist()

    def propose(self, request: DraftRequest, config: SpecConfig) -> Draft:
        draft = super().propose(request, config)
        if not self.with_probs:
            return draft
        logits = torch.randn(*draft.tokens.shape, VOCAB, generator=torch.Generator().manual_seed(self.rng.randrange(2**31)))
        parents = draft.parents.clamp(min=0)  # (a node's token is drawn from its parent's distribution)
        weight = torch.where(draft.parents >= 0, 3.0, 0.0)
        for b in range(draft.tokens.shape[0]):
            logits[b].index_put_((parents[b], draft.tokens[b]), weight[b], accumulate=True)
        return Draft(draft.tokens, draft.parents, logits.softmax(-1), draft.chain)


def _continuations(model, prompts: list[torch.Tensor], new: int) -> list[list[int]]:
    """Plain greedy continuation of every prompt (prompts of equal length decoded as one batch)."""
    out: list[list[int]] = [[] for _ in prompts]
    for length in {p.numel() for p in prompts}:
        index = [i for i, p in enumerate(prompts) if p.numel() == length]
        tokens, _ = autoregressive_generate(model, torch.stack([prompts[i] for i in index]), new)
        for i, row in zip(index, tokens[:, length:].tolist()):
            out[i] = row
    return out


def _until_eos(tokens: list[int], eos: int | None) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_random_greedy_cases_equal_plain_decoding(family):
    model = tiny_model(family, layers=2)
    rng = random.Random(FAMILIES.index(family))
    gen = torch.Generator().manual_seed(FAMILIES.index(family))
    prompts = [torch.randint(0, VOCAB, (rng.choice([1, 1, 2, 3, 5, 8]),), generator=gen) for _ in range(CALLS * ROWS)]
    truths = _continuations(model, prompts, NEW + 1)  # (+1: drafts reach past the budget)
    generators = [SpeculativeGenerator(model, RandomTreeDrafter([], 0, 0), config, compile_options=FAST) for config in CONFIGS]
    cases = 0
    for call in range(CALLS):
        rows = range(call * ROWS, (call + 1) * ROWS)
        # EOS inside drafts: half the calls stop at a token one of their rows emits mid-way
        eos = truths[rows[0]][rng.randrange(1, NEW)] if call % 2 else None
        width = max(prompts[i].numel() for i in rows)
        input_ids = torch.zeros(ROWS, width, dtype=torch.long)
        mask = torch.zeros_like(input_ids)
        for b, i in enumerate(rows):  # left padding
            input_ids[b, width - prompts[i].numel() :], mask[b, width - prompts[i].numel() :] = prompts[i], 1
        spec = generators[call % len(CONFIGS)]
        spec.drafter = RandomTreeDrafter([truths[i] for i in rows], p=rng.choice([0.5, 0.8, 0.95]), seed=call)
        out = spec.generate(input_ids, max_new_tokens=NEW, eos_token_id=eos, attention_mask=mask, pad_token_id=VOCAB)
        for b, i in enumerate(rows):
            expected = _until_eos(truths[i][:NEW], eos)
            got = out.sequences[b, width:].tolist()
            assert got[: len(expected)] == expected and set(got[len(expected) :]) <= {VOCAB}, (family, call, b)
            cases += 1
    assert cases == CALLS * ROWS


def _sampled(spec: SpeculativeGenerator, input_ids: torch.Tensor, mask: torch.Tensor, new: int, eos: int | None,
             drafter: Callable[[], Drafter], seed: int, **warp):
    """A sampled call of ``spec`` with a fresh drafter and generator."""
    spec.drafter = drafter()
    return spec.generate(input_ids, max_new_tokens=new, attention_mask=mask, do_sample=True, eos_token_id=eos,
                         pad_token_id=VOCAB, generator=torch.Generator().manual_seed(seed), **warp)


SAMPLING = [  # (temperature, top_k, top_p): near-greedy (long accepted paths on the greedy drafts) to flat
    (0.2, None, None), (0.5, 3, None), (0.8, None, 0.8), (1.3, 8, 0.95),
]


@pytest.mark.parametrize("family", FAMILIES)
def test_random_sampled_cases_through_the_engine_emit_the_dynamic_paths_tokens(family):
    """Sampled passes accept on the device (rejection sampling over uniforms drawn before the pass, the cut at
    EOS and at the budget inside the step); the dynamic path walks the same uniforms level by level on the host.
    Over random draft shapes (chains, trees up to the 128-node bucket), ragged rows, EOS inside drafts, draft
    distributions or none and sampling settings from near-greedy to flat, both emit the same tokens in the same
    passes and leave the same states."""
    model = tiny_model(family, layers=2)
    rng = random.Random(10 + FAMILIES.index(family))
    gen = torch.Generator().manual_seed(10 + FAMILIES.index(family))
    calls, rows, new = 4, 6, 10
    prompts = [torch.randint(0, VOCAB, (rng.choice([1, 2, 3, 5, 8]),), generator=gen) for _ in range(calls * rows)]
    generators = {engine: [SpeculativeGenerator(model, RandomTreeDrafter([], 0, 0), SpecConfig(**{**c.__dict__, "engine": engine}),
                                                compile_options=FAST) for c in CONFIGS] for engine in ("static", "dynamic")}
    longest, stopped = 0, 0
    for call in range(calls):
        index = range(call * rows, (call + 1) * rows)
        width = max(prompts[i].numel() for i in index)
        input_ids, mask = torch.zeros(rows, width, dtype=torch.long), torch.zeros(rows, width, dtype=torch.long)
        for b, i in enumerate(index):
            input_ids[b, width - prompts[i].numel() :], mask[b, width - prompts[i].numel() :] = prompts[i], 1
        # every (chain or tree, draft distributions or none) in turn, each family its own order of sampling settings
        config, with_probs = CONFIGS[call // 2 % len(CONFIGS)], call % 2 == 1
        temperature, top_k, top_p = SAMPLING[(call + FAMILIES.index(family)) % len(SAMPLING)]
        sample = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": rng.randrange(2**31),
                  "drafter": functools.partial(RandomSamplingDrafter, model, rng.choice([0.5, 0.9]), call, with_probs, new + 1)}
        specs = {engine: generators[engine][CONFIGS.index(config)] for engine in generators}
        eos = None
        if call:  # EOS inside drafts: the token row 0 samples mid-way without one
            eos = _sampled(specs["dynamic"], input_ids, mask, new, None, **sample).sequences[0, width + new // 2].item()
        static, dynamic = (_sampled(specs[engine], input_ids, mask, new, eos, **sample) for engine in ("static", "dynamic"))
        case = (family, call, temperature, top_k, top_p, with_probs)
        assert static.sequences.tolist() == dynamic.sequences.tolist(), case
        assert static.stats.accepted_drafts == dynamic.stats.accepted_drafts, case
        assert _relative_state_error(static.past_key_values, dynamic.past_key_values) <= 1e-5, case
        for row in static.sequences[:, width:].tolist():  # a row that emitted EOS emits nothing after it
            if eos in row:
                assert set(row[row.index(eos) + 1 :]) <= {VOCAB}, case
                stopped += row.index(eos) < new - 1
        longest = max(longest, *static.stats.accepted_drafts)
    # (multi-token paths were accepted, and rows stopped at EOS before their budget: row 0 mostly, where the drafts
    # and the uniforms' shapes, which other rows' stops change, leave it on its course)
    assert longest >= 2 and stopped, (longest, stopped)


def _relative_state_error(ours, theirs) -> float:
    pairs = list(zip(cache_tensors(ours), cache_tensors(theirs)))
    assert pairs
    return max(((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item() for a, b in pairs)


def test_two_thousand_tokens_do_not_drift_from_plain_decoding():
    tokens = 2000
    model = tiny_model("fla", layers=1)
    prompt = torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(30))
    expected, expected_cache = autoregressive_generate(model, prompt, tokens)
    truth = expected[0, 4:].tolist()
    config = SpecConfig(mode="chain", depth=15, bucket=16)
    spec = SpeculativeGenerator(model, OracleDrafter([truth + [0] * 16], error_rate=0.1, seed=2), config, compile_options=FAST)
    out = spec.generate(prompt, max_new_tokens=tokens)
    assert out.sequences.tolist() == expected.tolist()
    assert out.stats.target_passes < tokens / 4  # the states went through thousands of verified and committed records
    assert _relative_state_error(out.past_key_values, expected_cache) <= 1e-5


class _Fault(Exception):
    pass


class FailingDrafter(OracleDrafter):
    """Drafts correctly, then raises ``error`` at its ``fail_at``-th proposal (after passes committed)."""

    def __init__(self, continuations, error: BaseException, fail_at: int = 3):
        super().__init__(continuations, error_rate=0.2, seed=4)
        self.error, self.fail_at, self.calls = error, fail_at, 0

    def propose(self, request, config):
        self.calls += 1
        if self.calls == self.fail_at:
            raise self.error
        return super().propose(request, config)


def _raise_on_second_call(function, error: BaseException):
    calls = []

    def wrapper(*args, **kwargs):
        calls.append(1)
        result = function(*args, **kwargs)  # the pass ran (and committed its pending records) first
        if len(calls) == 2:
            raise error
        return result

    return wrapper


@pytest.mark.parametrize(("engine", "do_sample"), [("static", False), ("dynamic", False), ("static", True)])
def test_a_fault_leaves_the_cache_as_before_the_call(engine, do_sample, monkeypatch):
    """A drafter that raises, a KeyboardInterrupt between passes, an out-of-memory error inside the
    verify pass (after it committed the previous pass's records): each leaves the hybrid cache (GDN
    states and attention K/V) of a continued call, greedy or sampled, as it was, and the generator still decodes
    exactly."""
    model = tiny_model("qwen3_5", layers=2)
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(31))
    expected, _ = autoregressive_generate(model, prompt, 24)
    truth = expected[0, 5:].tolist()
    config = SpecConfig(mode="chain", depth=3, bucket=4, engine=engine)
    spec = SpeculativeGenerator(model, OracleDrafter([truth + [0] * 16]), config, compile_options=FAST)
    first = spec.generate(prompt, max_new_tokens=6)
    before = [t.clone() for t in cache_tensors(first.past_key_values)]
    rest = [truth[5:] + [0] * 16]
    oom = torch.OutOfMemoryError("CUDA out of memory (injected)")
    for fault in ("drafter raises", "KeyboardInterrupt between passes", "out of memory in the verify pass"):
        if fault == "out of memory in the verify pass":  # raised by the acceptance inside the pass (either engine)
            for module, name in ((engine_module, "greedy_accept_device"), (generator_module, "greedy_accept"),
                                 (engine_module, "sample_accept_device"), (generator_module, "sample_accept")):
                monkeypatch.setattr(module, name, _raise_on_second_call(getattr(module, name), oom))
            spec.drafter = OracleDrafter(rest, error_rate=0.2, seed=4)
        else:
            spec.drafter = FailingDrafter(rest, _Fault("drafter failed") if fault == "drafter raises" else KeyboardInterrupt())
        with pytest.raises((_Fault, KeyboardInterrupt, torch.OutOfMemoryError)):
            spec.generate(first.sequences[:, -1:], max_new_tokens=12, past_key_values=first.past_key_values,
                          do_sample=do_sample, temperature=0.3)
        after = cache_tensors(first.past_key_values)
        assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(before, after)), fault
        monkeypatch.undo()
    # the generator and the cache are still good: continuing gives plain decoding's tokens
    spec.drafter = OracleDrafter(rest, error_rate=0.2, seed=5)
    second = spec.generate(first.sequences[:, -1:], max_new_tokens=12, past_key_values=first.past_key_values)
    assert torch.cat([first.sequences, second.sequences[:, 1:]], 1).tolist() == expected[:, :23].tolist()


def test_an_interrupted_pipelined_eagle_call_leaves_the_cache_and_the_next_call_exact():
    """An EAGLE drafter drafts each next pass from the device outputs of the one in flight (pipelined), so a call
    that stops between passes (KeyboardInterrupt in the drafter, with a pass queued) has work ahead of what it
    committed: the continued cache stays as it was, and the same call again, greedy or sampled, emits what an
    uninterrupted drafter emits."""
    from test_generator import _drafting_the_targets_rule

    from specla_compile.runtime.drafters import EagleDrafter

    model = tiny_model("fla", layers=2)
    head = _drafting_the_targets_rule(model)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(33))
    config = SpecConfig(mode="tree", depth=3, tree_top_k=2, budget=7, bucket=8)

    def generator() -> SpeculativeGenerator:
        return SpeculativeGenerator(model, EagleDrafter(head, model, static_shapes=True, compiled=False), config,
                                    compile_options=FAST)

    spec = generator()
    first = spec.generate(prompt, max_new_tokens=5)
    before = [t.clone() for t in cache_tensors(first.past_key_values)]
    real, calls = spec.drafter.propose_after, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    spec.drafter.propose_after = interrupted
    with pytest.raises(KeyboardInterrupt):
        spec.generate(first.sequences[:, -1:], past_key_values=first.past_key_values, max_new_tokens=16)
    assert len(calls) == 3  # (it was drafting from the pass in flight)
    assert all(torch.equal(a, b) for a, b in zip(before, cache_tensors(first.past_key_values)))
    spec.drafter.propose_after = real
    for sample in ({}, {"do_sample": True, "temperature": 30.0}):
        ours, theirs = (gen.generate(first.sequences[:, -1:], past_key_values=copy.deepcopy(first.past_key_values),
                                     max_new_tokens=16, generator=torch.Generator().manual_seed(7), **sample)
                        for gen in (spec, generator()))
        assert ours.sequences.tolist() == theirs.sequences.tolist(), sample
        assert ours.stats.accepted_drafts == theirs.stats.accepted_drafts and max(ours.stats.accepted_drafts) >= 2
        assert _relative_state_error(ours.past_key_values, theirs.past_key_values) <= 1e-5, sample
