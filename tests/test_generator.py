"""SpeculativeGenerator end to end on tiny random models of the three families (CPU, fp32)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from cache_utils import cache_tensors, max_cache_diff
from models import FAMILIES, VOCAB, left_padded_batch, tiny_model
from scipy.stats import chi2_contingency

from specla_compile import GenerationStats, SpecConfig, SpeculativeGenerator
from specla_compile.runtime import acceptance as acceptance_module
from specla_compile.runtime.baseline import autoregressive_generate
from specla_compile.runtime.cache_layout import cache_slots
from specla_compile.runtime.drafters import ModelDrafter, NgramDrafter
from specla_compile.runtime.drafting import Draft, Drafter, DraftRequest
from specla_compile.runtime.tree_builder import draft_from_paths

COMPILE = {"inner": "aot_eager"}
SETTINGS = [
    SpecConfig(mode="chain", depth=3, bucket=4),
    SpecConfig(mode="chain", depth=6, bucket=8),
    SpecConfig(mode="tree", depth=3, tree_top_k=2, budget=7, bucket=8),
]


class OracleDrafter(Drafter):
    """Drafts the target's own greedy continuation (known in advance) with random mistakes and random
    extra branches, so accepted lengths vary from 0 to the whole draft."""

    def __init__(self, continuations: list[list[int]], error_rate: float = 0.3, seed: int = 0):
        self.continuations, self.error_rate = continuations, error_rate
        self.rng = random.Random(seed)

    def begin(self, sequences, features=None):
        self.prompt_lengths = [s.numel() for s in sequences]

    def propose(self, request: DraftRequest, config: SpecConfig) -> Draft:
        rows = []
        for b, seq in zip(request.rows, request.sequences):
            emitted = seq.numel() - self.prompt_lengths[b]  # new tokens so far, the pending one included
            truth = self.continuations[b][emitted : emitted + config.depth]
            nodes, parent = [], 0
            for token in truth:
                if self.rng.random() < self.error_rate:
                    token = self.rng.randrange(VOCAB)
                nodes.append((token, parent))
                parent = len(nodes)
                if config.mode == "tree" and len(nodes) < config.budget and self.rng.random() < 0.5:
                    nodes.append((self.rng.randrange(VOCAB), parent - 1))  # a sibling of the node just added
            rows.append(nodes[: config.budget if config.mode == "tree" else config.depth])
        return draft_from_paths(torch.stack([s[-1] for s in request.sequences]), rows)


def plain(model, prompt: torch.Tensor, max_new_tokens: int, eos=None):
    return autoregressive_generate(model, prompt[None], max_new_tokens, eos_token_id=eos)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_is_token_identical_to_plain_decoding(family):
    model = tiny_model(family)
    gen = torch.Generator().manual_seed(0)
    for trial, config in enumerate(SETTINGS * 2):
        prompt = torch.randint(0, VOCAB, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen)
        max_new = int(torch.randint(1, 15, (1,), generator=gen))
        expected, expected_cache = plain(model, prompt, max_new)
        reference = expected[0, prompt.numel() :].tolist()
        spec = SpeculativeGenerator(model, OracleDrafter([reference + [0] * 16], seed=trial), config, compile_options=COMPILE)
        out = spec.generate(prompt[None], max_new_tokens=max_new)
        assert out.sequences.tolist() == expected.tolist(), f"{config}, prompt {prompt.tolist()}"
        assert out.stats.new_tokens == max_new
        if max_new > 1:
            assert max_cache_diff(out.past_key_values, expected_cache) <= 1e-5
        assert out.stats.target_passes <= max_new  # never more passes than plain decoding


@pytest.mark.parametrize("family", FAMILIES)
def test_eos_inside_a_draft_and_ragged_batch(family):
    model = tiny_model(family)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (1, 5, 3)]
    refs = [plain(model, p, 12)[0][0, p.numel() :].tolist() for p in prompts]
    eos = refs[1][4]  # a token row 1 emits mid-stream (and maybe other rows too)
    expected = [plain(model, p, 12, eos)[0][0, p.numel() :].tolist() for p in prompts]
    width = max(p.numel() for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for b, p in enumerate(prompts):  # left padding, as for transformers' generate
        input_ids[b, width - p.numel() :], mask[b, width - p.numel() :] = p, 1
    spec = SpeculativeGenerator(model, OracleDrafter([r + [0] * 16 for r in refs], error_rate=0.2), SETTINGS[1], compile_options=COMPILE)
    out = spec.generate(input_ids, max_new_tokens=12, eos_token_id=eos, attention_mask=mask, pad_token_id=VOCAB + 1)
    for b, exp in enumerate(expected):
        row = out.sequences[b, width:].tolist()
        assert row[: len(exp)] == exp and all(t == VOCAB + 1 for t in row[len(exp) :])
    assert torch.equal(out.sequences[:, :width], input_ids)
    # every row's GDN states equal that row's own plain decoding (attention K/V are stored padded)
    ours = [s.get() for s in cache_slots(out.past_key_values) if s.kind == "state"]
    for b, p in enumerate(prompts):
        theirs = [s.get() for s in cache_slots(plain(model, p, len(expected[b]), eos)[1]) if s.kind == "state"]
        assert len(ours) == len(theirs) > 0
        assert max((mine[b] - ref[0]).abs().max().item() for mine, ref in zip(ours, theirs)) <= 1e-5


def test_batch_rows_accept_different_lengths_and_finished_rows_stop_drafting():
    model = tiny_model("qwen3_5")
    prompts = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(2))
    refs = [plain(model, p, 10)[0][0, 4:].tolist() for p in prompts]

    class Counting(OracleDrafter):
        drafted_rows: list[list[int]] = []

        def propose(self, request, config):
            self.drafted_rows.append(list(request.rows))
            return super().propose(request, config)

    drafter = Counting([refs[0] + [0] * 16, [0] * 30], error_rate=0.0)  # row 0 always right, row 1 always wrong
    out = SpeculativeGenerator(model, drafter, SETTINGS[0], compile_options=COMPILE).generate(prompts, max_new_tokens=10)
    for b in range(2):
        assert out.sequences[b, 4:].tolist() == refs[b]
    assert all(rows == [1] for rows in drafter.drafted_rows[-3:])  # row 0 finished early, row 1 still drafting


def test_model_drafter_on_itself_accepts_everything():
    model = tiny_model("fla")
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    config = SpecConfig(mode="chain", depth=4, bucket=8)
    out = SpeculativeGenerator(model, ModelDrafter(model), config, compile_options=COMPILE).generate(prompt, max_new_tokens=11)
    assert out.sequences.tolist() == plain(model, prompt[0], 11)[0].tolist()
    assert out.stats.mean_accepted == 4 - 0 and out.stats.first_token_match_rate == 1.0
    assert out.stats.acceptance_rate == 1.0 and out.stats.tokens_per_second > 0
    assert out.stats.target_passes == 1 + 2  # prefill, then 2 iterations of 5 tokens each


def test_inductor_twins_take_a_tree_drafters_strided_ids_and_parents():
    """A model drafter's tree gives its token ids and parents as slices of wider buffers (row strides of 9 for 8
    nodes), the static engine its dense buffers. Inductor's twins assert the layout they were compiled for at
    every call (the first H200 run of this test's GPU twin failed so): through inductor, not aot_eager, both
    engines on one compiled model give plain decoding's tokens."""
    model = tiny_model("fla")
    prompts = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(22))
    refs = [plain(model, p, 12)[0][0, 6:].tolist() for p in prompts]
    for engine in ("static", "dynamic", "static"):
        config = SpecConfig(mode="tree", depth=4, tree_top_k=2, budget=7, bucket=8, engine=engine)
        out = SpeculativeGenerator(model, ModelDrafter(tiny_model("fla", seed=1)), config).generate(prompts, max_new_tokens=12)
        assert out.sequences[:, 6:].tolist() == refs, engine


def test_model_drafter_on_a_ragged_batch_equals_plain_decoding():
    """Rows of different lengths that accept different numbers of drafts, drafted together by a hybrid
    (GDN + attention) drafter that is a noisy copy of the target."""
    model, drafter_model = tiny_model("qwen3_5", layers=2), tiny_model("qwen3_5", layers=2)
    with torch.no_grad():
        head = drafter_model.lm_head.weight
        head.add_(0.5 * head.std() * torch.randn(head.shape, generator=torch.Generator().manual_seed(3)))
    prompts, input_ids, mask = left_padded_batch((1, 5, 3), seed=1)
    width = input_ids.shape[1]
    spec = SpeculativeGenerator(model, ModelDrafter(drafter_model), SETTINGS[2], compile_options=COMPILE)
    out = spec.generate(input_ids, max_new_tokens=10, attention_mask=mask)
    for b, p in enumerate(prompts):
        assert out.sequences[b, width:].tolist() == plain(model, p, 10)[0][0, p.numel() :].tolist()
    assert len(set(out.stats.accepted_drafts)) > 1  # rows committed different numbers of tokens


@pytest.mark.parametrize("engine", ["static", "dynamic"])
def test_continuing_a_ragged_hybrid_batch_equals_plain_decoding_of_each_row(engine):
    """A second call on the cache of a first one (left-padded rows of different lengths that accepted
    different numbers of drafts, so each row's attention columns have gaps) goes on exactly as plain
    decoding of each row's whole history."""
    model = tiny_model("qwen3_5", layers=2)
    prompts, input_ids, mask = left_padded_batch((3, 6, 5), seed=21)
    expected = [plain(model, p, 14)[0][0, p.numel() :].tolist() for p in prompts]
    config = SpecConfig(mode="chain", depth=4, bucket=8, engine=engine)
    spec = SpeculativeGenerator(model, OracleDrafter(expected, error_rate=0.4, seed=2), config, compile_options=COMPILE)
    first = spec.generate(input_ids, max_new_tokens=8, attention_mask=mask)
    assert len(set(first.stats.accepted_drafts)) > 1  # rows committed different numbers of tokens: gaps
    spec.drafter = OracleDrafter([e[8:] for e in expected], error_rate=0.4, seed=3)
    width = input_ids.shape[1]
    second = spec.generate(first.sequences[:, -1:], max_new_tokens=6, past_key_values=first.past_key_values)
    for b in range(len(prompts)):
        assert first.sequences[b, width:].tolist() + second.sequences[b, 1:].tolist() == expected[b]


def test_acceptance_rate_counts_every_drafted_node_and_speed_the_whole_call():
    stats = GenerationStats(new_tokens=9, accepted_drafts=[3, 0, 1], tree_sizes=[5, 7, 1], seconds=1.5)
    assert stats.acceptance_rate == 4 / 10  # a tree's rejected branches were drafted too
    assert stats.tokens_per_second == 6.0
    assert stats.summary()["acceptance_rate"] == 0.4 and GenerationStats().tokens_per_second == 0.0


@pytest.mark.parametrize("engine", ["static", "dynamic"])
def test_continue_from_returned_cache(engine):
    model = tiny_model("qwen3_next")
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(4))
    expected, _ = plain(model, prompt[0], 12)
    spec = SpeculativeGenerator(model, NgramDrafter(), dataclasses.replace(SETTINGS[2], engine=engine), compile_options=COMPILE)
    first = spec.generate(prompt, max_new_tokens=6)
    # the cache holds all but the last emitted token, and says so to transformers: feed that one to continue
    assert first.past_key_values.get_seq_length() == first.sequences.shape[1] - 1
    second = spec.generate(first.sequences[:, -1:], max_new_tokens=6, past_key_values=first.past_key_values)
    assert torch.cat([first.sequences, second.sequences[:, 1:]], 1).tolist() == expected.tolist()


def _histogram(samples: torch.Tensor, vocab: int) -> torch.Tensor:
    """Counts of (position, token) over generated tokens ``samples [S, L]``."""
    positions = torch.arange(samples.shape[1]).expand_as(samples)
    return torch.bincount((positions * vocab + samples).flatten(), minlength=samples.shape[1] * vocab)


def _sampling_p_value(draft_model_seed: int) -> float:
    vocab, rows, new, calls = 12, 250, 4, 10  # 10,000 sampled tokens each way
    model = tiny_model("fla", vocab=vocab, layers=2)
    drafter = ModelDrafter(tiny_model("fla", vocab=vocab, layers=2, seed=draft_model_seed))
    spec = SpeculativeGenerator(model, drafter, SpecConfig(mode="tree", depth=2, tree_top_k=2, budget=4, bucket=8), compile_options=COMPILE)
    prompt = torch.randint(0, vocab, (1, 3), generator=torch.Generator().manual_seed(5)).repeat(rows, 1)
    torch.manual_seed(6)
    ours, theirs = [], []
    for call in range(calls):
        gen = torch.Generator().manual_seed(100 + call)
        ours.append(spec.generate(prompt, max_new_tokens=new, do_sample=True, temperature=1.3, top_k=8, generator=gen).sequences[:, 3:])
        theirs.append(autoregressive_generate(model, prompt, new, do_sample=True, temperature=1.3, top_k=8, generator=gen)[0][:, 3:])
    table = torch.stack([_histogram(torch.cat(ours), vocab), _histogram(torch.cat(theirs), vocab)])
    table = table[:, table.sum(0) > 0]
    return chi2_contingency(table.numpy()).pvalue


def test_sampling_matches_plain_sampling_and_a_broken_rule_fails(monkeypatch):
    """Sampling through the static engine (its acceptance on the device) emits what plain sampling emits,
    and the same test fails when every tried draft token is accepted."""
    assert _sampling_p_value(draft_model_seed=1) > 0.01
    monkeypatch.setattr(acceptance_module, "_accept_probability", lambda px, qx: torch.ones_like(px))
    assert _sampling_p_value(draft_model_seed=1) < 0.01


class ExplodingDrafter(NgramDrafter):
    def propose(self, request, config):
        raise RuntimeError("drafter failed")


def test_errors_and_cache_unchanged_after_a_failure():
    model = tiny_model("qwen3_5")
    spec = SpeculativeGenerator(model, NgramDrafter(), SETTINGS[0], compile_options=COMPILE)
    with pytest.raises(ValueError, match="empty"):
        spec.generate(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="max_new_tokens"):
        spec.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=0)
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeGenerator(model, ModelDrafter(tiny_model("fla", vocab=VOCAB + 3)), compile_options=COMPILE)
    first = spec.generate(torch.ones(1, 3, dtype=torch.long), max_new_tokens=4)
    before = [t.clone() for t in cache_tensors(first.past_key_values)]
    broken = SpeculativeGenerator(model, ExplodingDrafter(), SETTINGS[0], compile_options=COMPILE)
    with pytest.raises(RuntimeError, match="drafter failed"):
        broken.generate(first.sequences[:, -1:], max_new_tokens=5, past_key_values=first.past_key_values)
    after = cache_tensors(first.past_key_values)
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_hybrid_with_eager_attention_equals_plain_decoding(family):
    model = tiny_model(family, layers=2)
    model.config._attn_implementation = "eager"
    prompt = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(9))
    expected, _ = plain(model, prompt, 10)
    drafter = OracleDrafter([expected[0, 5:].tolist() + [0] * 16], seed=2)
    out = SpeculativeGenerator(model, drafter, SETTINGS[2], compile_options=COMPILE).generate(prompt[None], max_new_tokens=10)
    assert out.sequences.tolist() == expected.tolist()


def test_hybrid_with_another_attention_implementation_is_a_clear_error():
    from transformers import AttentionInterface

    def manual_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
        scores = query @ key.transpose(2, 3) * scaling
        weights = (scores if attention_mask is None else scores + attention_mask).softmax(-1)
        return (weights @ value).transpose(1, 2).contiguous(), weights

    AttentionInterface.register("specla_test_manual", manual_attention)
    model = tiny_model("qwen3_5", layers=2)
    model.config._attn_implementation = "specla_test_manual"
    spec = SpeculativeGenerator(model, NgramDrafter(), SETTINGS[0], compile_options=COMPILE)
    with pytest.raises(NotImplementedError, match="attn_implementation='sdpa' or 'eager'"):
        spec.generate(torch.ones(1, 4, dtype=torch.long), max_new_tokens=5)


def test_model_without_gdn_layer_is_a_clear_error():
    from tiny_lm import tiny_lm

    model = tiny_lm("llama", vocab=VOCAB)
    with pytest.raises(ValueError, match="LlamaForCausalLM has no GDN layer"):  # refused when built, not at generate
        SpeculativeGenerator(model, NgramDrafter(), SETTINGS[0], compile_options=COMPILE)


@pytest.mark.parametrize("family", ["fla", "qwen3_next"])
def test_eagle_drafter_gets_features_from_the_verify_pass(family):
    """An (untrained) EAGLE head drafts from the target's own features, taken from the verification
    passes: the output still equals plain decoding, and every committed token arrives with a feature."""
    from specla_compile.runtime.drafters import EagleConfig, EagleDrafter, EagleHead

    model = tiny_model(family)
    torch.manual_seed(7)
    drafter = EagleDrafter(EagleHead(EagleConfig.for_target(model)), model)
    seen = []
    real_commit = drafter.commit

    def commit(rows, tokens, features=None):
        seen.append((sum(t.numel() for t in tokens), sum(f.shape[0] for f in features)))
        return real_commit(rows, tokens, features)

    drafter.commit = commit
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(8))
    out = SpeculativeGenerator(model, drafter, SETTINGS[2], compile_options=COMPILE).generate(prompt, max_new_tokens=9)
    assert out.sequences.tolist() == plain(model, prompt[0], 9)[0].tolist()
    assert seen and all(tokens == features for tokens, features in seen)


def test_pipelined_eagle_drafting_emits_what_the_host_loop_emits(monkeypatch):
    """With static shapes the EAGLE drafter drafts every iteration but the first from the verify pass's
    device outputs, queued behind the pass (SpecConfig.pipelined), and is never told a commit; the next pass
    is queued before the host's bookkeeping of the one before (the device stops rows at EOS and budget itself): a
    ragged batch with a row stopping at EOS gets plain decoding's tokens and GDN states, as the host loop
    (pipelined=False, a commit per iteration) does. (Trees: chains differ only in the drafter's plan, which
    test_eagle.py checks for both.)"""
    from specla_compile.runtime import generator as generator_module
    from specla_compile.runtime.drafters import EagleConfig, EagleDrafter, EagleHead
    from specla_compile.runtime.engine import StaticEngine

    events: list[str] = []
    for owner, name in ((StaticEngine, "launch"), (StaticEngine, "collect"), (generator_module._StaticRun, "_conclude")):
        def logged(*args, real=getattr(owner, name), name=name, **kwargs):
            events.append(name)
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, logged)

    model = tiny_model("fla")
    torch.manual_seed(7)
    head = EagleHead(EagleConfig.for_target(model))
    prompts, input_ids, mask = left_padded_batch((4, 7), seed=5)
    refs = [plain(model, p, 12)[0][0, p.numel() :].tolist() for p in prompts]
    eos = refs[1][5]
    expected = [plain(model, p, 12, eos)[0][0, p.numel() :].tolist() for p in prompts]
    for pipelined in (None, False):
        events.clear()
        drafter = EagleDrafter(head, model, static_shapes=True, compiled=False)
        calls = {"commit": 0, "after": 0}
        real_commit, real_after = drafter.commit, drafter.propose_after

        def commit(*args, real=real_commit, calls=calls):
            calls["commit"] += 1
            return real(*args)

        def propose_after(*args, real=real_after, calls=calls):
            draft = real(*args)
            calls["after"] += draft is not None
            return draft

        drafter.commit, drafter.propose_after = commit, propose_after
        config = dataclasses.replace(SETTINGS[2], pipelined=pipelined)
        out = SpeculativeGenerator(model, drafter, config, compile_options=COMPILE).generate(
            input_ids, max_new_tokens=12, eos_token_id=eos, attention_mask=mask, pad_token_id=VOCAB + 1)
        for b, exp in enumerate(expected):
            row = out.sequences[b, input_ids.shape[1] :].tolist()
            assert row[: len(exp)] == exp and all(t == VOCAB + 1 for t in row[len(exp) :]), (pipelined, b)
        ours = [s.get() for s in cache_slots(out.past_key_values) if s.kind == "state"]
        for b, p in enumerate(prompts):
            theirs = [s.get() for s in cache_slots(plain(model, p, len(expected[b]), eos)[1]) if s.kind == "state"]
            assert max((mine[b] - ref[0]).abs().max().item() for mine, ref in zip(ours, theirs)) <= 1e-5
        # passes queued before the host did its bookkeeping of the pass before them (all but the first), and some
        # before it even read that pass (where the pass before could not end every row by its budget)
        unread, early = 0, 0
        for event in events:
            unread += (event == "launch") - (event == "collect")
            early += event == "collect" and unread == 1  # (read with the next pass queued behind it)
        late = " ".join(events).count("collect launch _conclude")
        if pipelined is None:
            assert calls["commit"] == 0 and calls["after"] >= out.stats.iterations - 1 > 2, calls
            assert early + late == out.stats.iterations - 1 and early >= 1, events
        else:
            assert calls["after"] == 0 and calls["commit"] == out.stats.iterations, calls
            assert early == late == 0 and events.count("launch") == out.stats.iterations, events


def _drafting_the_targets_rule(model: torch.nn.Module):
    """A target whose next token is mostly a fixed permutation of its current one (``e2e_gpu.peaked_logits``), and
    an EAGLE head whose drafts follow that rule: its fuse passes the next token's embedding through and its layer
    adds little, so the target's LM head maps its output to the permuted token."""
    from e2e_gpu import peaked_logits

    from specla_compile.runtime.drafters import EagleConfig, EagleHead

    peaked_logits(model)
    head = EagleHead(EagleConfig.for_target(model))
    width = head.config.hidden_size
    with torch.no_grad():
        head.fuse.weight.zero_()
        head.fuse.weight[:, :width] = torch.eye(width)  # (the fuse reads the token's embedding first)
        head.fuse.bias.zero_()
        head.o_proj.weight.mul_(0.01)
        head.down_proj.weight.mul_(0.01)
    return head


def test_pipelined_eagle_sampling_emits_what_the_host_loop_emits(monkeypatch):
    """Sampled passes accept on the device too, so an EAGLE drafter drafts from their device outputs as in greedy
    runs: on the same generator, the pipelined run (no commit calls) emits the host loop's tokens, EOS included.
    The head drafts the target's own rule and the temperature is high enough that sampled tokens often leave it:
    passes accept whole drafts, parts of them and none, so the drafter's bookkeeping of sampled paths counts."""
    from specla_compile.runtime.drafters import EagleDrafter

    model = tiny_model("fla")
    head = _drafting_the_targets_rule(model)
    _, input_ids, mask = left_padded_batch((4, 7), seed=6)
    sample = {"max_new_tokens": 12, "attention_mask": mask, "pad_token_id": VOCAB + 1, "do_sample": True, "temperature": 30.0}

    def run(pipelined: bool | None, eos: int | None, commits: list):
        drafter = EagleDrafter(head, model, static_shapes=True, compiled=False)
        real_commit = drafter.commit
        drafter.commit = lambda *args: commits.append(1) or real_commit(*args)
        config = dataclasses.replace(SETTINGS[2], pipelined=pipelined)
        return SpeculativeGenerator(model, drafter, config, compile_options=COMPILE).generate(
            input_ids, eos_token_id=eos, generator=torch.Generator().manual_seed(2), **sample)

    width = input_ids.shape[1]
    eos = run(False, None, []).sequences[0, width + 5].item()  # (row 0's sixth token without EOS)
    commits = {None: [], False: []}
    outs = {pipelined: run(pipelined, eos, commits[pipelined]) for pipelined in (None, False)}
    assert outs[None].sequences.tolist() == outs[False].sequences.tolist()
    assert outs[None].stats.accepted_drafts == outs[False].stats.accepted_drafts
    assert not commits[None] and len(commits[False]) == outs[False].stats.iterations
    accepted = outs[None].stats.accepted_drafts
    assert max(accepted) == SETTINGS[2].depth and 0 in accepted and any(0 < a < SETTINGS[2].depth for a in accepted)
    assert eos in outs[None].sequences[0, width:].tolist()[:-1]  # (row 0 stopped at EOS before its budget)


def test_drafts_over_64_nodes_on_fla():
    """Above 64 tokens fla's layer calls chunk_gated_delta_rule (wrapped in torch.compiler.disable)
    instead of the fused recurrent kernel: the capture must still see it, in the prefill of a long
    prompt and in the verify pass of a 70-node chain."""
    model = tiny_model("fla", layers=2)
    gen = torch.Generator().manual_seed(3)
    for prompt_length in (5, 80):
        prompt = torch.randint(0, VOCAB, (prompt_length,), generator=gen)
        expected, _ = plain(model, prompt, 80)
        reference = expected[0, prompt.numel() :].tolist()
        config = SpecConfig(mode="chain", depth=69, bucket=8)  # 70 nodes with the pending token
        spec = SpeculativeGenerator(model, OracleDrafter([reference + [0] * 80], error_rate=0.01, seed=1), config, compile_options=COMPILE)
        out = spec.generate(prompt[None], max_new_tokens=80)
        assert out.sequences.tolist() == expected.tolist()
        assert out.stats.target_passes < 40  # long drafts were accepted, so verify passes saw > 64 nodes


class _RecordingStreamer:
    """transformers' streamer interface (``put`` and ``end``), recording what it is given."""

    def __init__(self):
        self.puts: list[list[int]] = []
        self.ended = 0

    def put(self, value: torch.Tensor) -> None:
        assert not self.ended and value.dim() == 1 and value.device.type == "cpu"
        self.puts.append(value.tolist())

    def end(self) -> None:
        self.ended += 1


@pytest.mark.parametrize("engine", ["static", "dynamic"])
@pytest.mark.parametrize("call", ["generate", "decode"])
@pytest.mark.parametrize("do_sample", [False, True])
def test_a_streamer_gets_the_prompt_then_each_token_once_as_it_is_emitted(engine, call, do_sample):
    """As transformers streams: the prompt first, then the emitted tokens as the passes commit them (speculative
    passes one put each, the plain device loop a block at a time), nothing past EOS or the budget, then ``end``
    once; what it was given is the output row. A batch of more than one row is refused before any work."""
    model = tiny_model("fla")
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(40))
    truth = plain(model, prompt[0], 24)[0][0, 5:].tolist()
    eos = truth[17] if not do_sample else None  # (greedy: a stop inside the budget)
    gen = SpeculativeGenerator(model, OracleDrafter([truth + [0] * 16], error_rate=0.3, seed=6),
                               SpecConfig(mode="chain", depth=3, bucket=4, engine=engine), compile_options=COMPILE)
    streamer = _RecordingStreamer()
    sample = {"do_sample": True, "temperature": 0.2, "generator": torch.Generator().manual_seed(5)} if do_sample else {}
    out = getattr(gen, call)(prompt, max_new_tokens=20, eos_token_id=eos, streamer=streamer, **sample)
    assert streamer.ended == 1 and streamer.puts[0] == prompt[0].tolist()
    assert [token for put in streamer.puts for token in put] == out.sequences[0].tolist()
    new = out.sequences[0, 5:].tolist()
    assert len(new) == (truth.index(eos) + 1 if eos in truth[:20] else 20)
    assert len(streamer.puts) >= (3 if call == "generate" else 2)  # (tokens came pass by pass, or block by block)
    with pytest.raises(ValueError, match="batch size 1"):
        getattr(gen, call)(prompt.repeat(2, 1), max_new_tokens=4, streamer=_RecordingStreamer())
