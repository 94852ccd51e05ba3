import functools
import itertools
import json
import os
import re
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file
from tiny_lm import features_of, tiny_lm
from torch.utils._python_dispatch import TorchDispatchMode

from specla_compile.kernels import ops
from specla_compile.runtime.config import SpecConfig
from specla_compile.runtime.drafters import EagleConfig, EagleDrafter, EagleHead
from specla_compile.runtime.drafters.eagle_head import HEAD_GEMMS, causal_mask, eagle_loss, unrolled_predictions
from specla_compile.runtime.drafting import Draft, DraftRequest, PassOutputs
from specla_compile.runtime.tree_builder import build_draft
from specla_compile.tree import PAD

VOCAB = 300


def make(seed: int = 0, dtype=torch.float64):
    target = tiny_lm(vocab=VOCAB, seed=seed, dtype=dtype)
    torch.manual_seed(seed + 1)
    head = EagleHead(EagleConfig.for_target(target, intermediate_size=48)).to(dtype)
    return target, head


def test_head_shapes_and_cache_consistency():
    target, head = make()
    cfg = head.config
    assert (cfg.hidden_size, cfg.vocab_size, cfg.num_heads) == (32, VOCAB, 4)
    feats, embeds = torch.randn(2, 7, 32, dtype=torch.float64), torch.randn(2, 7, 32, dtype=torch.float64)
    pos = torch.arange(7).expand(2, 7)
    hidden, k, v = head(feats, embeds, pos, causal_mask(7))
    assert hidden.shape == (2, 7, 32) and k.shape == v.shape == (2, 4, 7, 8)
    # The same pairs fed as 4 cached + 3 new (project, then attend over the cached keys too: the
    # drafter's path) give the same outputs.
    h1, k1, v1 = head(feats[:, :4], embeds[:, :4], pos[:, :4], causal_mask(4))
    x, q, k2, v2 = head.project(feats[:, 4:], embeds[:, 4:], pos[:, 4:])
    tail_mask = torch.ones(3, 7, dtype=torch.bool).tril(4)[None]
    h2 = head.attend(x, q, torch.cat([k1, k2], 2), torch.cat([v1, v2], 2), tail_mask)
    torch.testing.assert_close(torch.cat([h1, h2], 1), hidden)


def test_token_table_projects_token_ids_as_their_embeddings():
    """pack_projections(embed): project() takes token ids and gives what it gives for their embeddings (the
    fuse split into its feature half and a table of every token through its embedding half); without the
    table token ids are refused; packing again without the embedding drops the table."""
    target, head = make(seed=2)
    embed = target.get_input_embeddings()
    tokens = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    feats, pos = torch.randn(2, 5, 32, dtype=torch.float64), torch.arange(5).expand(2, 5)
    head.pack_projections()
    with pytest.raises(ValueError, match="pack_projections"):
        head.project(feats, tokens, pos)
    expected = head.project(feats, embed(tokens), pos)
    head.pack_projections(embed)
    for got, want in zip(head.project(feats, tokens, pos), expected):
        torch.testing.assert_close(got, want)
    head.pack_projections()
    assert head.token_fuse is None


def test_drafts_with_and_without_the_token_table_agree(monkeypatch):
    """A drafter whose vocabulary is too large for the token table (TOKEN_FUSE_BYTES) embeds the tokens
    instead, and drafts the same tree."""
    from specla_compile.runtime.drafters import eagle

    target, head = make(seed=3)
    seq = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(4))
    config = SpecConfig(mode="tree", depth=3, tree_top_k=2, budget=6)
    drafts = []
    for limit in (eagle.TOKEN_FUSE_BYTES, 0):
        monkeypatch.setattr(eagle, "TOKEN_FUSE_BYTES", limit)
        drafter = EagleDrafter(head, target)
        assert (head.token_fuse is not None) == (limit > 0)
        drafter.begin([seq[:-1]], [features_of(target, seq)[:-1]])
        drafts.append(drafter.propose(DraftRequest([0], [seq]), config))
    assert_same_draft(*drafts)


def test_unrolled_training_steps_see_what_draft_levels_see():
    """unrolled_predictions (EAGLE-3's training-time test): step s at position t equals the head run the way a
    drafter runs it, one level at a time: the real pairs 0..t cached (a causal run over them), then per level
    one pair (the previous level's predicted feature, the next token) attending to the cache, its ancestors'
    pairs and itself."""
    _, head = make()
    rows, length, steps = 2, 9, 3
    feats, embeds = (torch.randn(rows, length, 32, dtype=torch.float64) for _ in range(2))
    predictions = unrolled_predictions(head, feats, embeds, steps)
    assert [p.shape for p in predictions] == [(rows, length - s, 32) for s in range(steps)]
    pos = torch.arange(length).expand(rows, length)
    for t in range(length - steps + 1):
        hidden, keys, values = head(feats[:, : t + 1], embeds[:, : t + 1], pos[:, : t + 1], causal_mask(t + 1))
        predicted = hidden[:, -1:]
        torch.testing.assert_close(predicted[:, 0], predictions[0][:, t])
        for s in range(2, steps + 1):
            x, q, k, v = head.project(predicted, embeds[:, t + s - 1 : t + s], pos[:, t : t + 1] + s - 1)
            keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
            predicted = head.attend(x, q, keys, values, torch.ones(1, 1, keys.shape[2], dtype=torch.bool))
            torch.testing.assert_close(predicted[:, 0], predictions[s - 1][:, t])
    with pytest.raises(ValueError, match="unrolled steps"):
        unrolled_predictions(head, feats, embeds, length)


def test_unrolled_loss_trains_every_step():
    """eagle_loss(unroll=2): the mean of the two steps' losses, each step's top-1 agreement reported, the
    second step's loss trains the head; unroll=1 is the plain loss (step 1 of the unrolled one)."""
    target, head = make()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    out = target(input_ids=ids, output_hidden_states=True)
    feats, logits = out.hidden_states[-1].detach(), out.logits.detach()
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    one, stats_one = eagle_loss(head, embed, lm_head, ids, feats, logits)
    two, stats_two = eagle_loss(head, embed, lm_head, ids, feats, logits, unroll=2)
    assert set(stats_one) == {"reg", "cls", "top1"} and set(stats_two) == {"reg", "cls", "top1", "top1_2"}
    assert stats_one == {k: stats_two[k] for k in stats_one}  # (step 1 is the same computation)
    second = 2 * two - one  # the second step's loss alone
    assert second.item() > 0
    second.backward()
    assert head.fuse.weight.grad.abs().sum() > 0


def test_packed_projections_give_the_same_outputs_and_are_never_saved():
    """The drafter packs q/k/v and gate/up into one weight each (one GEMM per group at a draft level, which
    the fused ops run with the norms, residual and gate around it): the same outputs in fp64."""
    _, head = make()
    feats, embeds = torch.randn(2, 7, 32, dtype=torch.float64), torch.randn(2, 7, 32, dtype=torch.float64)
    args = (feats, embeds, torch.arange(7).expand(2, 7), causal_mask(7))
    keys = set(head.state_dict())
    unpacked = head(*args)
    head.pack_projections()
    assert head.qkv_weight.shape == (96, 32) and head.gate_up_weight.shape == (96, 32)
    for a, b in zip(head(*args), unpacked):
        torch.testing.assert_close(a, b)
    assert set(head.state_dict()) == keys


def test_config_validation():
    with pytest.raises(ValueError, match="even size"):
        EagleConfig(hidden_size=30, vocab_size=10, num_heads=4, intermediate_size=8)
    with pytest.raises(ValueError, match="vocab_size"):
        EagleConfig(hidden_size=32, vocab_size=0, num_heads=4, intermediate_size=8)


def scratch_step(drafter: EagleDrafter, target, sequences, record: list):
    """Oracle: every frontier node's whole pair sequence (real features of the committed pairs, then the
    head's own predictions along its draft path) re-run through the head from scratch, no cache.
    Appends the logits of every level to ``record``."""
    head = drafter.head
    state = {}

    def run(pairs):
        feats = torch.stack([f for f, _ in pairs])[None]
        tokens = torch.tensor([t for _, t in pairs])[None]
        n = len(pairs)
        hidden, _, _ = head(feats, drafter.embed(tokens), torch.arange(n)[None], causal_mask(n))
        return hidden[0, -1]

    def step(frontier):
        with torch.no_grad():
            if frontier.depth == 0:
                rows = []
                for seq in sequences:
                    f = features_of(target, seq[:-1])
                    pairs = [(f[t], int(seq[t + 1])) for t in range(len(seq) - 1)]
                    rows.append([(pairs, run(pairs))])
            else:
                rows = [
                    [(row[s][0] + [(row[s][1], t)], None) for s, t in zip(slots, toks)]
                    for row, slots, toks in zip(state["rows"], frontier.parent_slots.tolist(), frontier.tokens.tolist())
                ]
                rows = [[(pairs, run(pairs)) for pairs, _ in row] for row in rows]
            state["rows"] = rows
            record.append(torch.stack([torch.stack([target.get_output_embeddings()(h) for _, h in row]) for row in rows]))
            return record[-1]

    return step


def assert_same_draft(draft, expected):
    """Equal drafts, where ``draft`` may carry extra padding nodes (static shapes: ``budget + 1`` nodes)."""
    n = expected.tokens.shape[1]
    assert torch.equal(draft.tokens[:, :n], expected.tokens) and torch.equal(draft.parents[:, :n], expected.parents)
    assert (draft.parents[:, n:] == PAD).all()


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize(
    "config", [SpecConfig(mode="chain", depth=4), SpecConfig(mode="tree", depth=3, tree_top_k=3, budget=8, tau=3.0)]
)
def test_cache_rollback_matches_recomputing_from_scratch(config, static):
    """Static shapes (new pairs padded to depth + 1, the tree to budget + 1 nodes: what the CUDA graph
    of a propose runs; a longer prompt's pairs cached first, but for the last depth + 1) draft the same
    trees."""
    target, head = make(seed=2)
    drafter = EagleDrafter(head, target, static_shapes=static)
    seen = []  # each level's scores (a tree's levels call top_k, which gets them recorded too)
    drafter.logits = lambda hidden: seen.append(EagleDrafter.logits(drafter, hidden)) or seen[-1]

    def recorded_top_k(hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        drafter.logits(hidden)
        return EagleDrafter.top_k(drafter, hidden, k)

    drafter.top_k = recorded_top_k
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (11, 3)]
    drafter.begin(seqs, [features_of(target, s) for s in seqs])
    for _ in range(4):
        seqs = [torch.cat([s, torch.randint(0, VOCAB, (1,), generator=gen)]) for s in seqs]  # pending tokens
        seen.clear()
        draft = drafter.propose(DraftRequest([0, 1], seqs), config)
        oracle = []
        expected = build_draft(scratch_step(drafter, target, seqs, oracle), torch.stack([s[-1] for s in seqs]), config)
        assert_same_draft(draft, expected)
        if static:
            assert draft.tokens.shape[1] == (config.depth if config.mode == "chain" else config.budget) + 1
        assert len(seen) == len(oracle) == config.depth
        for got, want in zip(seen, oracle):
            torch.testing.assert_close(got, want)
        # Nothing speculative stays cached: one pair per committed token but the first.
        assert [drafter._cached[b] for b in (0, 1)] == [len(s) - 1 for s in seqs]
        # Accept part of the draft's first branch for row 0, reject everything for row 1.
        kept = int(torch.randint(0, draft.tokens.shape[1], (1,), generator=gen))
        accepted = [
            draft.tokens[0, 1 : 1 + kept] if config.mode == "chain" else draft.tokens[0, 1:2],
            torch.tensor([], dtype=torch.long),
        ]
        new = [torch.cat([s, a]) for s, a in zip(seqs, accepted)]
        drafter.commit(
            [0, 1],
            [n[len(s) - 1 :] for s, n in zip(seqs, new)],
            [features_of(target, n)[len(s) - 1 :] for s, n in zip(seqs, new)],
        )
        seqs = new


def test_compiled_propose_asks_inductor_for_the_drafters_options(monkeypatch):
    """The propose compiles with the drafter's ``inductor_options``: inductor's defaults off CUDA unless given
    (on CUDA combo kernels and PDL, as the backend's passes), and the entries given otherwise."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: seen.append(kwargs["options"]) or fn)
    target, head = make(seed=4)
    seq = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(1))
    for options in (None, {"combo_kernels": False, "max_autotune": True}):
        drafter = EagleDrafter(head, target, static_shapes=True, compiled=True, inductor_options=options)
        drafter.begin([seq], [features_of(target, seq)])
        drafter.propose(DraftRequest([0], [seq]), SpecConfig(mode="chain", depth=2))
    assert seen == [{}, {"combo_kernels": False, "max_autotune": True}]


@pytest.mark.parametrize(
    "config", [SpecConfig(mode="chain", depth=4), SpecConfig(mode="tree", depth=3, tree_top_k=3, budget=8, tau=3.0)]
)
def test_compiled_propose_drafts_what_the_eager_one_drafts(config):
    """A fixed-shape propose compiled by inductor as one program (no graph break in the catch-up, the
    draft levels or the tree's selection) drafts what it drafts eagerly, and keeps the same cache, over
    rounds that accept different lengths and draft one row of two alone. The first propose too: the
    prompt's pairs beyond the fixed shape are cached before it."""
    from torch._dynamo.utils import counters

    counters.clear()
    target, head = make(seed=4)
    compiled, eager = (EagleDrafter(head, target, static_shapes=True, compiled=c) for c in (True, False))
    runs = []
    run = compiled._device_propose
    compiled._device_propose = lambda *args: runs.append(args[-1]) or run(*args)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (7, 4)]
    for d in (compiled, eager):
        d.begin(seqs, [features_of(target, s) for s in seqs])
    for round in range(5):
        rows = [0, 1] if round < 3 else [round - 3]
        for b in rows:  # the pending tokens
            seqs[b] = torch.cat([seqs[b], torch.randint(0, VOCAB, (1,), generator=gen)])
        request = DraftRequest(rows, [seqs[b] for b in rows])
        draft, expected = compiled.propose(request, config), eager.propose(request, config)
        assert torch.equal(draft.tokens, expected.tokens) and torch.equal(draft.parents, expected.parents)
        kept = round % (config.depth + 1) if config.mode == "chain" else 1
        for i, b in enumerate(rows):
            new = torch.cat([seqs[b], draft.tokens[i, 1 : 1 + kept]])
            for d in (compiled, eager):
                d.commit([b], [new[len(seqs[b]) - 1 :]], [features_of(target, new)[len(seqs[b]) - 1 :]])
            seqs[b] = new
    assert runs == [True] * 5 and eager._compiled_propose is None
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(compiled._buffers.keys, eager._buffers.keys, rtol=1e-12, atol=1e-12)


def test_one_drafter_serves_a_chain_and_a_tree_without_new_buffer_shapes():
    """The study's routes share one drafter: a chain of 8 and a tree of depth 6 and width 4 (7 and 20
    scratch columns) draft in buffers of one shape, so neither recompiles nor recaptures the other's
    propose; a longer sequence grows the capacity to the next power of two."""
    target, head = make(seed=6)
    drafter = EagleDrafter(head, target, static_shapes=True)
    gen = torch.Generator().manual_seed(7)
    seq = torch.randint(0, VOCAB, (20,), generator=gen)
    drafter.begin([seq[:-1]], [features_of(target, seq[:-1])])
    shapes = []
    for config in (SpecConfig(mode="chain", depth=8), SpecConfig(mode="tree", depth=6, tree_top_k=4, budget=15)):
        drafter.propose(DraftRequest([0], [seq]), config)
        shapes.append(drafter._buffers.keys.shape)
    assert shapes[0] == shapes[1] and shapes[0][2] == 256 + 32
    long = torch.randint(0, VOCAB, (300,), generator=gen)
    drafter.begin([long[:-1]], [features_of(target, long[:-1])])
    drafter.propose(DraftRequest([0], [long]), SpecConfig(mode="chain", depth=8))
    assert drafter._buffers.keys.shape[2] == 512 + 32


def test_drafting_some_rows_of_a_batch_equals_drafting_them_alone():
    """Rows left out of a request (finished rows) keep their cache; the others draft as if alone."""
    target, head = make(seed=2)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (6, 9)]
    config = SpecConfig(mode="tree", depth=3, tree_top_k=3, budget=8, tau=3.0)
    both, alone = EagleDrafter(head, target), EagleDrafter(head, target)
    both.begin(seqs, [features_of(target, s) for s in seqs])
    alone.begin(seqs[1:], [features_of(target, seqs[1])])
    seq = torch.cat([seqs[1], torch.tensor([5])])
    for _ in range(3):
        draft = both.propose(DraftRequest([1], [seq]), config)
        expected = alone.propose(DraftRequest([0], [seq]), config)
        assert torch.equal(draft.tokens, expected.tokens) and torch.equal(draft.parents, expected.parents)
        new = torch.cat([seq, draft.tokens[0, 1:2]])
        for drafter, row in ((both, 1), (alone, 0)):
            drafter.commit([row], [new[len(seq) - 1 :]], [features_of(target, new)[len(seq) - 1 :]])
        seq = torch.cat([new, torch.tensor([7])])
    first = EagleDrafter(head, target)
    first.begin(seqs[:1], [features_of(target, seqs[0])])
    seq = torch.cat([seqs[0], torch.tensor([3])])
    draft, expected = both.propose(DraftRequest([0], [seq]), config), first.propose(DraftRequest([0], [seq]), config)
    assert torch.equal(draft.tokens, expected.tokens) and torch.equal(draft.parents, expected.parents)


def _accepted_path(parents: torch.Tensor, length: int) -> list[int]:
    """Node 0, then up to ``length - 1`` nodes down the tree, each the last child of the node before."""
    path = [0]
    while len(path) < length:
        children = (parents == path[-1]).nonzero().flatten().tolist()
        if not children:
            break
        path.append(children[-1])
    return path


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
@pytest.mark.parametrize(
    "config", [SpecConfig(mode="chain", depth=4), SpecConfig(mode="tree", depth=3, tree_top_k=3, budget=8, tau=3.0)]
)
def test_propose_after_a_pass_drafts_what_commit_then_propose_drafts(config, device):
    """Pipelined drafting: from a pass's device outputs alone (the verified draft, the accepted paths and
    counts, the new pending tokens, the target's features at every node, in buffers wider than the draft,
    refilled in place each round as the engine's are) the drafter drafts what its twin drafts from the host's
    commit and the grown sequences, round after round with different accepted lengths; a finished row
    (count 0) keeps its cache. On CUDA both replay captured graphs, the pipelined one reading the pass's
    buffers in place. Afterwards the host path is refused until begin()."""
    target, head = (m.to(device) for m in make(seed=8))
    twin, piped = (EagleDrafter(head, target, static_shapes=True, compiled=False) for _ in range(2))
    gen = torch.Generator().manual_seed(9)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (6, 10)]
    for d in (twin, piped):
        d.begin(seqs, [features_of(target, s.to(device)) for s in seqs])
    seqs = [torch.cat([s, torch.randint(0, VOCAB, (1,), generator=gen)]) for s in seqs]  # the pending tokens
    drafts = [d.propose(DraftRequest([0, 1], seqs), config) for d in (twin, piped)]
    assert_same_draft(*drafts)
    width = drafts[0].tokens.shape[1] + 3  # the engine's bucket: wider than the draft
    buffers = [torch.zeros(shape, dtype=torch.long, device=device) for shape in ((2, width), (2, width), 2, 2)]
    buffers.append(torch.zeros(2, width, 32, dtype=torch.float64, device=device))
    outputs = PassOutputs(*buffers)
    for round, lengths in enumerate([(3, 1), (1, 2), (2, 3), (config.depth + 1, 0)]):  # (0: a row that finished)
        draft = Draft(drafts[0].tokens.cpu(), drafts[0].parents.cpu())
        tokens = torch.nn.functional.pad(draft.tokens, (0, 3))
        paths = [_accepted_path(draft.parents[b], n) for b, n in enumerate(lengths)]
        path = torch.full((2, width), -1)
        for b, p in enumerate(paths):
            path[b, : len(p)] = torch.tensor(p)
        counts = torch.tensor([len(p) if n else 0 for p, n in zip(paths, lengths)])
        next_token = torch.randint(0, VOCAB, (2,), generator=gen)
        hidden = torch.randn(2, width, 32, dtype=torch.float64, generator=gen)
        rows = [b for b in (0, 1) if counts[b]]
        committed = [tokens[b, path[b, : counts[b]]] for b in rows]
        twin.commit(rows, committed, [hidden[b, path[b, : counts[b]]].to(device) for b in rows])
        for b, c in zip(rows, committed):
            seqs[b] = torch.cat([seqs[b][:-1], c, next_token[b : b + 1]])
        expected = twin.propose(DraftRequest(rows, [seqs[b] for b in rows]), config)
        for buffer, value in zip(buffers, (tokens, path, counts, next_token, hidden)):
            buffer.copy_(value)
        got = piped.propose_after(outputs, config, max_length=64)
        assert_same_draft(Draft(got.tokens[rows].cpu(), got.parents[rows].cpu()),
                          Draft(expected.tokens.cpu(), expected.parents.cpu()))
        drafts = [got]
        assert piped._device_cached.tolist() == [len(s) - 1 for s in seqs], f"round {round}"
    if device == "cuda":  # (from the second pipelined propose on the same buffers: replays of its own graph)
        assert [key[0] for key in piped._graphs].count("after") == 1 and not piped.graph_error
    else:  # (no CUDA graphs on the CPU, and no capture error for having none)
        assert piped.captured_graphs == 0 and piped.graph_error == ""
    torch.testing.assert_close(piped._last_hidden, twin._last_hidden)
    with pytest.raises(RuntimeError, match="call begin"):
        piped.propose(DraftRequest([0], seqs[:1]), config)
    piped.begin([s[:-1] for s in seqs], [features_of(target, s[:-1].to(device)) for s in seqs])
    piped.propose(DraftRequest([0, 1], seqs), config)


def test_save_load_round_trip(tmp_path):
    target, head = make(seed=4, dtype=torch.float32)
    drafter = EagleDrafter(head, target)
    drafter.save_pretrained(tmp_path)
    stored = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert set(stored) == set(head.state_dict()), "only the head's own weights are stored"
    assert json.load(open(tmp_path / "config.json"))["hidden_size"] == 32
    loaded = EagleDrafter.from_pretrained(tmp_path, target)
    seq = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(5))
    config = SpecConfig(mode="tree", depth=3, tree_top_k=2, budget=6)
    drafts = []
    for d in (drafter, loaded):
        d.begin([seq[:-1]], [features_of(target, seq[:-1])])
        drafts.append(d.propose(DraftRequest([0], [seq]), config))
    assert torch.equal(drafts[0].tokens, drafts[1].tokens) and torch.equal(drafts[0].parents, drafts[1].parents)
    again = loaded.propose(DraftRequest([0], [seq]), config)
    assert torch.equal(again.tokens, drafts[1].tokens), "re-drafting the same sequence is idempotent"
    for a, b in zip(drafter.head.state_dict().values(), loaded.head.state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="hidden_size=32"):
        EagleDrafter.from_pretrained(tmp_path, tiny_lm(vocab=VOCAB, hidden=48))
    with pytest.raises(ValueError, match="vocab_size=300"):
        EagleDrafter.from_pretrained(tmp_path, tiny_lm(vocab=VOCAB + 1))
    with pytest.raises(ValueError, match="not an EAGLE head checkpoint"):
        EagleHead.from_pretrained(tmp_path / "missing")


def test_feature_bookkeeping_errors():
    target, head = make()
    drafter = EagleDrafter(head, target)
    seq = torch.randint(0, VOCAB, (5,), generator=torch.Generator().manual_seed(6))
    with pytest.raises(ValueError, match="features over every prompt"):
        drafter.begin([seq])
    drafter.begin([seq], [features_of(target, seq)[:2]])
    with pytest.raises(ValueError, match="target features"):
        drafter.propose(DraftRequest([0], [torch.cat([seq, seq[:1]])]), SpecConfig())
    with pytest.raises(ValueError, match=r"\[positions, 32\]"):
        drafter.begin([seq], [torch.randn(5, 31, dtype=torch.float64)])


class _Dispatches(TorchDispatchMode):
    """Counts aten ops by name and records the (query, key) shapes of every attention call."""

    def __init__(self):
        super().__init__()
        self.ops, self.attention = Counter(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        if "scaled_dot_product" in str(func):
            self.attention.add((tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize(
    "config", [SpecConfig(mode="chain", depth=5), SpecConfig(mode="tree", depth=4, tree_top_k=3, budget=8)]
)
def test_propose_cost_does_not_grow_with_the_sequence(config, static):
    """Past the first propose (the prompt's pairs), a propose runs the same ops at any sequence length,
    reads at most one number back from the device (a tree's width; none with static shapes, whose
    device work is then one CUDA graph), and its attention keeps its shapes from one iteration to the
    next (on H100/H200 each new masked attention shape is a cuDNN plan build of tens of ms)."""
    target, head = make(seed=5)
    drafter = EagleDrafter(head, target, static_shapes=static)
    gen = torch.Generator().manual_seed(6)
    ops, shapes = {}, {}
    for length in (12, 150):
        seq = torch.randint(0, VOCAB, (length,), generator=gen)
        drafter.begin([seq[:-1]], [torch.randn(length - 1, 32, dtype=torch.float64, generator=gen)])
        for step in range(4):
            counter = _Dispatches()
            with counter:
                draft = drafter.propose(DraftRequest([0], [seq]), config)
            ops[length, step], shapes[length, step] = counter.ops, counter.attention
            committed = torch.cat([seq[-1:], draft.tokens[0, 1:2]])  # the pending token and one draft
            drafter.commit([0], [committed], [torch.randn(2, 32, dtype=torch.float64, generator=gen)])
            seq = torch.cat([seq, draft.tokens[0, 1:3]])
    steady = [(length, step) for length in (12, 150) for step in (1, 2, 3)]
    assert all(ops[key] == ops[steady[0]] for key in steady), "ops per propose depend on the sequence length"
    assert ops[steady[0]]["aten._local_scalar_dense"] == (config.mode == "tree" and not static)
    for length in (12, 150):
        assert shapes[length, 1] == shapes[length, 2] == shapes[length, 3], "attention shapes changed"


def test_a_prompt_catch_up_has_one_attention_shape_per_power_of_two():
    """With static shapes, ``begin`` caches the prompt's pairs (queued behind the target's prefill, before the
    host reads the first token) in one uncaptured head call padded to a power of two from 64: prompts of 20
    and 60 tokens give its attention one query shape and a prompt of 100 the next (on the H200 each new masked
    attention shape is a cuDNN plan of tens of ms, which a per-length shape paid at almost every new prompt).
    The first propose then runs only its fixed shapes. The drafts are checked against the scratch oracle in
    test_cache_rollback_matches_recomputing_from_scratch."""
    target, head = make(seed=5)
    drafter = EagleDrafter(head, target, static_shapes=True, compiled=False)
    config = SpecConfig(mode="chain", depth=4)
    gen = torch.Generator().manual_seed(6)
    queries = {}
    for length in (20, 60, 100):
        seq = torch.randint(0, VOCAB, (length,), generator=gen)
        begun, proposed = _Dispatches(), _Dispatches()
        with begun:
            drafter.begin([seq[:-1]], [torch.randn(length - 1, 32, dtype=torch.float64, generator=gen)])
        assert drafter._cached == [length - 2]  # every pair the prompt holds
        with proposed:
            drafter.propose(DraftRequest([0], [seq]), config)
        queries[length] = ({q[2] for q, _ in begun.attention}, {q[2] for q, _ in proposed.attention})
    # the catch-up's; then the propose's (its one new pair padded to depth + 1) and its levels (one node each)
    assert queries == {20: ({64}, {5, 1}), 60: ({64}, {5, 1}), 100: ({128}, {5, 1})}


def test_a_graphed_catch_up_replays_one_graph_per_width_and_caches_what_the_eager_one_does(monkeypatch):
    """Where graphs are on, ``begin``'s catch-up is captured once per rows and padded width over buffers a propose
    has sized, and replayed over those same buffers with each new prompt's inputs copied in: the first prompt (new
    buffers) runs eagerly, prompts of 50 and 60 tokens share a 64-wide graph, 100 tokens capture the 128-wide one,
    and 300 tokens grow the buffers: a 512-wide graph over the new ones, and the next 64-wide prompt captures again;
    the cached pairs, the head's last hidden state and the drafts that follow equal an eager drafter's. A capture
    that fails leaves that catch-up and the later ones eager, says why, and leaves the proposes' graphs alone.
    (A stand-in for CUDA graphs: its capture runs the step, its replay runs it again on the static inputs.)"""
    from specla_compile.runtime.drafters import eagle

    target, head = make(seed=5)
    eager = EagleDrafter(head, target, static_shapes=True, compiled=False)
    graphed = EagleDrafter(head, target, static_shapes=True, compiled=False)

    def addresses(drafter):
        return drafter._buffers.keys.data_ptr(), drafter._buffers.values.data_ptr(), drafter._last_hidden.data_ptr()

    class Graph:
        def __init__(self, step):
            self.step, self.replays, self.addresses = step, 0, addresses(graphed)

        def replay(self):
            assert addresses(graphed) == self.addresses, "a graph replayed over buffers it was not captured over"
            self.replays += 1
            self.step()

    graphs = []

    def fake_capture(step, warmups=2):
        for _ in range(warmups):
            step()
        graphs.append(Graph(step))
        return graphs[-1], step()

    monkeypatch.setattr(eagle, "capture", fake_capture)
    monkeypatch.setattr(graphed, "_graphs_on", lambda config: config is None)  # (at begin only: the proposes eager)
    config = SpecConfig(mode="tree", depth=3, tree_top_k=2, budget=6)
    gen = torch.Generator().manual_seed(6)

    def begin_and_compare(drafter, length):
        seq = torch.randint(0, VOCAB, (length,), generator=gen)
        feats = torch.randn(length - 1, 32, dtype=torch.float64, generator=gen)
        for d in (eager, drafter):
            d.begin([seq[:-1]], [feats])
        assert drafter._cached == eager._cached == [length - 2]
        cached = slice(0, length - 2)
        torch.testing.assert_close(drafter._buffers.keys[..., cached, :], eager._buffers.keys[..., cached, :])
        torch.testing.assert_close(drafter._buffers.values[..., cached, :], eager._buffers.values[..., cached, :])
        torch.testing.assert_close(drafter._last_hidden, eager._last_hidden)
        drafts = [d.propose(DraftRequest([0], [seq]), config) for d in (eager, drafter)]
        assert_same_draft(*drafts)

    for length in (20, 50, 100, 60, 300, 40):
        begin_and_compare(graphed, length)
    assert [g.replays for g in graphs] == [2, 1, 1, 1]  # (64 wide: 50 and 60 tokens; 128; 512; 64 again: 40)
    assert {key[2] for key in graphed._graphs if key[0] == "catch_up"} == {64, 512}
    assert graphed.catch_up_graphs == 2 and graphed.catch_up_error == ""
    assert graphed.captured_graphs == 0  # (the proposes ran uncaptured; catch-up graphs are not counted)

    attempts = []

    def failing_capture(step, warmups=2):
        attempts.append(step)
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(eagle, "capture", failing_capture)
    failing = EagleDrafter(head, target, static_shapes=True, compiled=False)
    monkeypatch.setattr(failing, "_graphs_on", lambda config: config is None)
    for length in (30, 40, 70):  # (eager: new buffers; the capture fails; eager without trying again)
        begin_and_compare(failing, length)
    assert len(attempts) == 1 and failing.catch_up_error == "operation not permitted when stream is capturing"
    assert failing.catch_up_graphs == 0 and failing.graph_error == ""


def test_attention_choice_changes_the_kernel_not_the_draft():
    """``attention="math"`` runs the head's attention as matrix products (``"pytorch"``, the default on a
    CPU, is PyTorch's fused flash kernel there) and ``"specla"`` as ``specla::draft_attention``, in the prompt's catch-up and
    in every level, uncaptured, and in the program inductor compiles (no SDPA call in its code, where the
    default's has one), and drafts what the default drafts; an unknown name is refused at construction."""
    from torch._inductor.utils import run_and_get_code

    target, head = make(seed=6)
    config = SpecConfig(mode="tree", depth=3, tree_top_k=2, budget=6)
    gen = torch.Generator().manual_seed(8)
    seq = torch.randint(0, VOCAB, (30,), generator=gen)
    feats = features_of(target, seq)[:-1]
    drafts = {}
    assert EagleDrafter(head, target).attention == "pytorch"  # (the default off CUDA)
    for attention, compiled in itertools.product(("pytorch", "math", "specla"), (False, True)):
        drafter = EagleDrafter(head, target, static_shapes=True, compiled=compiled, attention=attention)
        drafter.begin([seq[:-1]], [feats])
        propose = functools.partial(drafter.propose, DraftRequest([0], [seq]), config)
        if compiled:  # (a dispatch mode would make Dynamo skip the frame: read the generated code instead)
            drafts[attention, compiled], code = run_and_get_code(propose)
            # (calls only: inductor's comments name the source nodes, SDPA's among them when it was decomposed)
            calls = [line for c in code for line in c.splitlines() if not line.lstrip().startswith("#")]
            assert any("scaled_dot_product" in line for line in calls) == (attention == "pytorch")
            assert any("specla.draft_attention" in line for line in calls) == (attention == "specla")
            continue
        counter = _Dispatches()
        with counter:
            drafts[attention, compiled] = propose()
        fused = counter.ops["aten._scaled_dot_product_flash_attention_for_cpu"]
        ours = counter.ops["specla.draft_attention"]
        assert fused > 0 if attention == "pytorch" else (fused == 0 and counter.ops["aten.bmm"] + ours > 0)
        assert (ours > 0) == (attention == "specla")
    for draft in drafts.values():
        assert_same_draft(draft, drafts["pytorch", False])
    with pytest.raises(ValueError, match="attention must be None or one of"):
        EagleDrafter(head, target, attention="flash")


@pytest.mark.parametrize("compiled", [False, True])
def test_head_gemms_choice_changes_the_kernels_not_the_draft(compiled):
    """``head_gemms="specla"`` runs the packed head's GEMMs as the fused specla ops (two
    linear_add, one norm_linear and one norm_gated_linear per head call, and each tree level's LM head with its
    top-k as one linear_top_k), ``"pytorch"`` as PyTorch code with no specla GEMM op (its levels: the framework's
    LM head GEMM, then vocab_top_k), ``"mixed"`` only the fuse's and o_proj's linear_adds as specla ops, ``"triton"`` the linear_adds,
    the bare linear and gated_linear after PyTorch's norms and linear_top_k, uncaptured and in the program
    inductor compiles (the default); all draft the same tree; an unknown name is refused at construction."""
    from torch._inductor.utils import run_and_get_code

    target, head = make(seed=6)
    config = SpecConfig(mode="tree", depth=3, tree_top_k=2, budget=6)
    seq = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(8))
    feats = features_of(target, seq)[:-1]
    drafts, fused_calls, gemm_calls = {}, {}, {}
    ops_counted = ("linear_add", "norm_linear", "norm_gated_linear", "linear_top_k", "linear", "gated_linear", "vocab_top_k")
    for gemms in ("specla", "pytorch", "mixed", "triton"):
        drafter = EagleDrafter(head, target, static_shapes=True, compiled=compiled, head_gemms=gemms)
        drafter.begin([seq[:-1]], [feats])
        propose = functools.partial(drafter.propose, DraftRequest([0], [seq]), config)
        if compiled:
            drafts[gemms], code = run_and_get_code(propose)
            calls = [line for c in code for line in c.splitlines() if not line.lstrip().startswith("#")]
            fused_calls[gemms] = {op: sum(re.search(rf"specla\.{op}\.default\(", line) is not None for line in calls)
                                  for op in ops_counted}  # (calls, not the checks of their outputs' strides)
            gemm_calls[gemms] = sum("extern_kernels." in line for line in calls)
        else:
            counter = _Dispatches()
            with counter:
                drafts[gemms] = propose()
            fused_calls[gemms] = {op: counter.ops[f"specla.{op}"] for op in ops_counted}
            gemm_calls[gemms] = sum(counter.ops[op] for op in ("aten.mm", "aten.addmm", "aten.bmm"))
    # (fused ops in every head call, the catch-up's and each level's; the other way, their GEMMs are the
    # framework's, on top of the down projection and the LM head that both ways share)
    levels = {"vocab_top_k": config.depth, "linear_top_k": 0}
    assert fused_calls["pytorch"] == {op: levels.get(op, 0) for op in ops_counted}
    head_calls = fused_calls["specla"]["norm_linear"]  # (the catch-up's and each later level's)
    assert head_calls >= config.depth and fused_calls["specla"]["norm_gated_linear"] == head_calls
    assert fused_calls["specla"]["linear_add"] == 2 * head_calls  # (the fuse, o_proj: this down projection is PyTorch's)
    assert fused_calls["specla"]["linear"] == fused_calls["specla"]["gated_linear"] == 0
    assert fused_calls["specla"]["linear_top_k"] == config.depth and fused_calls["specla"]["vocab_top_k"] == 0
    assert fused_calls["mixed"] == {"linear_add": 2 * head_calls, "norm_linear": 0,
                                    "norm_gated_linear": 0, "linear": 0, "gated_linear": 0, **levels}
    assert fused_calls["triton"] == {"linear_add": fused_calls["specla"]["linear_add"], "norm_linear": 0,
                                     "norm_gated_linear": 0, "linear": fused_calls["specla"]["norm_linear"],
                                     "gated_linear": fused_calls["specla"]["norm_gated_linear"],
                                     "linear_top_k": config.depth, "vocab_top_k": 0}
    # (the framework's GEMMs: the down projection with specla or triton; with mixed, q/k/v, gate/up and each
    # level's LM head too; with pytorch, the fuse and o_proj as well)
    assert gemm_calls["triton"] == gemm_calls["specla"] == head_calls
    assert gemm_calls["pytorch"] >= gemm_calls["mixed"] + 2 * head_calls
    assert gemm_calls["mixed"] >= 3 * head_calls + config.depth
    assert_same_draft(drafts["specla"], drafts["pytorch"])
    assert_same_draft(drafts["mixed"], drafts["pytorch"])
    assert_same_draft(drafts["triton"], drafts["pytorch"])
    assert EagleDrafter(head, target).head_gemms == "triton"
    with pytest.raises(ValueError, match="head_gemms must be one of"):
        EagleDrafter(head, target, head_gemms="cublas")


def test_a_tree_levels_top_k_follows_the_lm_head_modules_forward():
    """A tree level's children come from the LM head's weight in one op (``top_k``) where the head is an
    ``nn.Linear`` and the head's GEMMs fuse it, the k best of what :meth:`EagleDrafter.logits` scores; from the
    module's own forward where it is not (a subclass whose forward is not ``F.linear`` of its weight), or with
    ``"mixed"`` GEMMs, through the tree builder's scores: the same trees as the uncached oracle, which calls the
    module."""
    class ScaledHead(torch.nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * torch.linspace(1, -1, self.out_features, dtype=x.dtype)

    hidden = torch.randn(2, 3, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    config = SpecConfig(mode="tree", depth=3, tree_top_k=3, budget=8, tau=3.0)
    seqs = [torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(4))]
    for scaled, gemms in ((False, "triton"), (True, "triton"), (False, "mixed")):
        target, head = make(seed=9)
        if scaled:
            plain = target.lm_head
            target.lm_head = ScaledHead(plain.in_features, plain.out_features, bias=False, dtype=torch.float64)
            target.lm_head.weight.data.copy_(plain.weight.data)
        drafter = EagleDrafter(head, target, head_gemms=gemms)
        assert drafter.fuses_top_k() == (not scaled and gemms == "triton")
        if drafter.fuses_top_k():
            log_probs, columns = drafter.top_k(hidden, 4)
            expected = torch.log_softmax(drafter.logits(hidden), -1).topk(4)
            assert torch.equal(columns, expected.indices)
            torch.testing.assert_close(log_probs, expected.values.float())
        else:
            with pytest.raises(ValueError, match="scores through logits"):
                drafter.top_k(hidden, 4)
        drafter.begin([s[:-1] for s in seqs], [features_of(target, s)[:-1] for s in seqs])
        draft = drafter.propose(DraftRequest([0], seqs), config)
        expected = build_draft(scratch_step(drafter, target, seqs, []), torch.stack([s[-1] for s in seqs]), config)
        assert_same_draft(draft, expected)


@pytest.mark.parametrize("gemms", ["specla", "triton"])
def test_down_projection_takes_the_split_kernel_where_its_depth_splits(gemms):
    """The head's down projection with its residual: ``specla::linear_add`` for a weight whose depth the CUDA
    kernel splits ([8, 4096]), PyTorch's GEMM and add for a shallower one ([8, 2048]); the same sums either way."""
    gen = torch.Generator().manual_seed(5)
    for depth, ours in ((4096, 1), (2048, 0)):
        hidden, weight = torch.randn(3, depth, generator=gen), torch.randn(8, depth, generator=gen)
        residual = torch.randn(3, 8, generator=gen)
        counter = _Dispatches()
        with counter:
            out = HEAD_GEMMS[gemms].down_add(hidden, weight, residual)
        assert counter.ops["specla.linear_add"] == ours
        torch.testing.assert_close(out, residual + hidden @ weight.T)


@pytest.mark.parametrize("gemms, compiled", [("triton", False), ("triton", True), ("specla", False)])
def test_int8_weights_draft_what_their_dequantized_weights_draft(gemms, compiled):
    """``quantize="int8"``: each GEMM of the head and the draft levels' LM head rows stream int8 copies, one scale
    per row; a chain and a tree drafted with them, uncaptured and compiled, are those of a float drafter whose
    weights are the integers times their scales (so every GEMM applies its own scale: a scale missed or misplaced
    changes the scores); the float weights are what the tables (the fuse's token half) still use. Anything but
    None, "none" or "int8" is refused, and so are int8 with PyTorch's GEMMs and with an LM head other than an nn.Linear.
    On the CPU the default (None) keeps the head's own weights: int8 is its default on CUDA only (a GPU test)."""
    target, head = make(seed=11)
    seq = torch.randint(0, VOCAB, (30,), generator=torch.Generator().manual_seed(3))
    quantized = EagleDrafter(head, target, static_shapes=True, compiled=compiled, head_gemms=gemms,
                             acceptance_temperature=1.0, quantize="int8")
    assert {name: w.dtype for name, (w, _) in quantized._int8.items()} == dict.fromkeys(
        ("fuse", "qkv", "o", "gate_up", "down"), torch.int8)
    assert quantized._lm_weight.dtype == torch.int8 and quantized._lm_scale.shape == (VOCAB,)
    def wide(name: str) -> torch.Tensor:
        q, scale = quantized._int8[name]
        return q.double() * scale.double()[:, None]

    float_target, float_head = make(seed=11)
    d, i = head.config.hidden_size, head.config.intermediate_size
    with torch.no_grad():
        float_head.fuse.weight[:, d:] = wide("fuse")
        for proj, w in zip((float_head.q_proj, float_head.k_proj, float_head.v_proj), wide("qkv").split(d)):
            proj.weight.copy_(w)
        float_head.gate_proj.weight.copy_(wide("gate_up")[:i])
        float_head.up_proj.weight.copy_(wide("gate_up")[i:])
        float_head.o_proj.weight.copy_(wide("o"))
        float_head.down_proj.weight.copy_(wide("down"))
        float_target.lm_head.weight.copy_(quantized._lm_weight.double() * quantized._lm_scale.double()[:, None])
    dequantized = EagleDrafter(float_head, float_target, static_shapes=True, compiled=compiled, head_gemms=gemms,
                               acceptance_temperature=1.0)
    EagleDrafter(head, target)  # (another drafter of the same head: its float weights leave this one's int8 as they are)
    for drafter in (quantized, dequantized):
        drafter.begin([seq[:-1]], [features_of(target, seq)[:-1]])
    for config in (SpecConfig(mode="tree", depth=3, tree_top_k=3, budget=8), SpecConfig(mode="chain", depth=4)):
        assert_same_draft(quantized.propose(DraftRequest([0], [seq]), config),
                          dequantized.propose(DraftRequest([0], [seq]), config))
    for unquantized in (EagleDrafter(head, target), EagleDrafter(head, target, quantize="none")):
        assert unquantized.quantize == "none" and unquantized._int8 is None and unquantized._lm_scale is None
    with pytest.raises(ValueError, match="quantize must be one of"):
        EagleDrafter(head, target, quantize="fp8")
    with pytest.raises(ValueError, match="takes head_gemms in"):
        EagleDrafter(head, target, quantize="int8", head_gemms="mixed")
    target.lm_head = type("SubclassedHead", (torch.nn.Linear,), {})(32, VOCAB, bias=False, dtype=torch.float64)
    with pytest.raises(ValueError, match="an nn.Linear LM head"):
        EagleDrafter(head, target, quantize="int8")


@pytest.mark.parametrize("config, compiled", [(SpecConfig(mode="chain", depth=4), False),
                                              (SpecConfig(mode="tree", depth=3, tree_top_k=3, budget=8), False),
                                              (SpecConfig(mode="tree", depth=3, tree_top_k=3, budget=8), True)])
def test_a_draft_vocabulary_drafts_what_the_masked_lm_head_drafts(config, compiled):
    """``draft_vocab=N`` (the head's N most frequent tokens; LM head rows copied once) drafts, round after
    round and compiled too, what the whole LM head drafts with every other token's logit at -inf; every
    drafted token lies in the draft vocabulary."""
    target, head = make(seed=7)
    head.set_token_ranking(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2)))
    small = EagleDrafter(head, target, static_shapes=True, compiled=compiled, draft_vocab=40)
    masked = EagleDrafter(head, target, static_shapes=True, compiled=False)
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[head.token_ranking[:40]] = False
    masked.logits = lambda hidden: EagleDrafter.logits(masked, hidden).masked_fill(outside, float("-inf"))
    masked.top_k = lambda hidden, k: tuple(t.view(*hidden.shape[:-1], k)
                                           for t in ops.vocab_top_k(masked.logits(hidden).flatten(0, -2), k))
    assert small._lm_weight.shape == (40, 32) and torch.equal(small._lm_weight, target.lm_head.weight[small.draft_vocab])
    gen = torch.Generator().manual_seed(9)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (12, 6)]
    for d in (small, masked):
        d.begin(seqs, [features_of(target, s) for s in seqs])
    for _ in range(3):
        seqs = [torch.cat([s, torch.randint(0, VOCAB, (1,), generator=gen)]) for s in seqs]
        draft, expected = (d.propose(DraftRequest([0, 1], seqs), config) for d in (small, masked))
        assert torch.equal(draft.tokens, expected.tokens) and torch.equal(draft.parents, expected.parents)
        assert set(draft.tokens[:, 1:][draft.parents[:, 1:] != PAD].tolist()) <= set(small.draft_vocab.tolist())
        new = [torch.cat([s, draft.tokens[b, 1:2]]) for b, s in enumerate(seqs)]
        for d in (small, masked):
            d.commit([0, 1], [n[len(s) - 1 :] for s, n in zip(seqs, new)],
                     [features_of(target, n)[len(s) - 1 :] for s, n in zip(seqs, new)])
        seqs = new


def test_token_ranking_is_saved_checked_and_required_for_a_draft_vocabulary(tmp_path):
    """The trainer's ranking (most frequent first, ties to the lower id) travels with the checkpoint; a
    draft vocabulary needs one and a size within the vocabulary; a ranking must be a permutation."""
    from specla_compile.runtime.drafters.eagle_head import rank_tokens

    target, head = make(seed=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="needs a head with a token ranking"):
        EagleDrafter(head, target, draft_vocab=10)
    corpus = torch.tensor([[5, 7, 7, 2], [7, 5, 9, 2]])
    ranking = rank_tokens(corpus, VOCAB)
    assert ranking[:4].tolist() == [7, 2, 5, 9] and sorted(ranking.tolist()) == list(range(VOCAB))
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 300\)"):
        rank_tokens(torch.tensor([1, VOCAB]), VOCAB)
    with pytest.raises(ValueError, match="each of the 300 token ids once"):
        head.set_token_ranking(torch.zeros(VOCAB, dtype=torch.long))
    head.set_token_ranking(ranking)
    head.save_pretrained(tmp_path)
    loaded = EagleDrafter.from_pretrained(tmp_path, target, dtype=torch.bfloat16, draft_vocab=3)
    assert torch.equal(loaded.head.token_ranking, ranking) and loaded.draft_vocab.tolist() == [7, 2, 5]
    assert loaded.head.fuse.weight.dtype == torch.bfloat16 and loaded.head.token_ranking.dtype == torch.long
    fresh = EagleHead(head.config)
    fresh.load_state_dict(head.state_dict())  # (a head built without a ranking takes one from a state dict)
    assert torch.equal(fresh.token_ranking, ranking)
    assert EagleDrafter(head, target, draft_vocab=VOCAB).draft_vocab is None  # the whole vocabulary: no copy
    for size in (0, VOCAB + 1):
        with pytest.raises(ValueError, match=r"draft_vocab must be in \[1, 300\]"):
            EagleDrafter(head, target, draft_vocab=size)


def test_acceptance_temperature_deepens_the_tree_and_keeps_the_chain(tmp_path):
    """Draft levels score ``logits / T``: a chain drafts the same tokens at any T; a tree ranked by sharpened
    probabilities spends its nodes on depth, down to the whole greedy chain, where the head's flat raw
    probabilities spread them over siblings. The head's calibrated T is the default and is saved with it."""
    from specla_compile.tree import depth

    target, head = make(seed=11)
    gen = torch.Generator().manual_seed(12)
    seq = torch.randint(0, VOCAB, (15,), generator=gen)
    chain, tree = SpecConfig(mode="chain", depth=5), SpecConfig(mode="tree", depth=5, tree_top_k=3, budget=8)
    drafters = {t: EagleDrafter(head, target, static_shapes=False, compiled=False, acceptance_temperature=t)
                for t in (1.0, 0.5, 1e-4)}
    drafts = {}
    for t, d in drafters.items():
        d.begin([seq[:-1]], [features_of(target, seq[:-1])])
        drafts[t] = {mode: d.propose(DraftRequest([0], [seq]), config) for mode, config in (("chain", chain), ("tree", tree))}
    hidden = torch.randn(2, head.config.hidden_size, dtype=torch.float64)
    assert torch.allclose(drafters[0.5].logits(hidden), drafters[1.0].logits(hidden) / 0.5)
    assert drafters[1.0]._lm_weight is None  # (T = 1, every token: the target's LM head itself)
    for t in (0.5, 1e-4):
        assert torch.equal(drafts[t]["chain"].tokens, drafts[1.0]["chain"].tokens)
    deepest = {t: int(depth(d["tree"].parents).max()) for t, d in drafts.items()}
    # (a random head's logits lie within hundredths of each other: a bushy tree at T = 1, depth only when sharpened)
    assert deepest[1e-4] == tree.depth > deepest[1.0]
    sharp = drafts[1e-4]["tree"]
    leaf = int(depth(sharp.parents)[0].argmax())
    path = [leaf]
    while sharp.parents[0, path[-1]] > 0:
        path.append(int(sharp.parents[0, path[-1]]))
    assert sharp.tokens[0, path[::-1]].tolist() == drafts[1.0]["chain"].tokens[0, 1:].tolist()  # the greedy chain

    head.config.acceptance_temperature = 0.25
    assert EagleDrafter(head, target).acceptance_temperature == 0.25
    assert EagleDrafter(head, target, acceptance_temperature=1.0).acceptance_temperature == 1.0
    head.save_pretrained(tmp_path)
    assert EagleDrafter.from_pretrained(tmp_path, target).head.config.acceptance_temperature == 0.25
    with pytest.raises(ValueError, match="acceptance_temperature must be > 0"):
        EagleDrafter(head, target, acceptance_temperature=0.0)
    with pytest.raises(ValueError, match="acceptance_temperature must be > 0"):
        EagleConfig(hidden_size=32, vocab_size=10, num_heads=4, intermediate_size=8, acceptance_temperature=-1.0)


def test_fitted_acceptance_temperature_recovers_the_labels_temperature():
    """Temperature scaling against the target's greedy tokens: labels drawn from ``softmax(z / T0)`` give back
    about T0; labels that are always the argmax drive T to its lower bound (the argmax is certain)."""
    from specla_compile.runtime.drafters.eagle_head import fit_acceptance_temperature

    gen = torch.Generator().manual_seed(3)
    logits = 3 * torch.randn(20000, 40, generator=gen)
    for t0 in (0.3, 1.0, 2.5):
        labels = torch.multinomial(torch.softmax(logits / t0, -1), 1, generator=gen)[:, 0]
        assert fit_acceptance_temperature(logits, labels) == pytest.approx(t0, rel=0.05)
    assert fit_acceptance_temperature(logits, logits.argmax(-1), low=0.05) == pytest.approx(0.05)
    with pytest.raises(ValueError, match=r"logits must be \[N, V\]"):
        fit_acceptance_temperature(logits, logits.argmax(-1)[:5])
