"""Reliability, measured on CPU: greedy speculative decoding over many random cases equals plain
decoding; long runs do not drift from plain decoding's states; faults in the middle of a call leave
the caller's cache as it was (and the generator usable)."""

from __future__ import annotations

import random

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
            truth = self.continuations[b][seq.numel() - self.prompt_lengths[b] :]
            rows.append(self._tree(truth, self.rng.randint(0, config.max_nodes - 1), chain))
        return draft_from_paths(torch.stack([s[-1] for s in request.sequences]), rows)


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


@pytest.mark.parametrize("engine", ["static", "dynamic"])
def test_a_fault_leaves_the_cache_as_before_the_call(engine, monkeypatch):
    """A drafter that raises, a KeyboardInterrupt between passes, an out-of-memory error inside the
    verify pass (after it committed the previous pass's records): each leaves the hybrid cache (GDN
    states and attention K/V) of a continued call as it was, and the generator still decodes exactly."""
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
            monkeypatch.setattr(engine_module, "greedy_accept_device", _raise_on_second_call(engine_module.greedy_accept_device, oom))
            monkeypatch.setattr(generator_module, "greedy_accept", _raise_on_second_call(generator_module.greedy_accept, oom))
            spec.drafter = OracleDrafter(rest, error_rate=0.2, seed=4)
        else:
            spec.drafter = FailingDrafter(rest, _Fault("drafter failed") if fault == "drafter raises" else KeyboardInterrupt())
        with pytest.raises((_Fault, KeyboardInterrupt, torch.OutOfMemoryError)):
            spec.generate(first.sequences[:, -1:], max_new_tokens=12, past_key_values=first.past_key_values)
        after = cache_tensors(first.past_key_values)
        assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(before, after)), fault
        monkeypatch.undo()
    # the generator and the cache are still good: continuing gives plain decoding's tokens
    spec.drafter = OracleDrafter(rest, error_rate=0.2, seed=5)
    second = spec.generate(first.sequences[:, -1:], max_new_tokens=12, past_key_values=first.past_key_values)
    assert torch.cat([first.sequences, second.sequences[:, 1:]], 1).tolist() == expected[:, :23].tolist()
