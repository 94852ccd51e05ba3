import pytest
import torch
from tiny_lm import tiny_lm

from specla_compile.runtime.config import SpecConfig
from specla_compile.runtime.drafters import ModelDrafter
from specla_compile.runtime.drafting import DraftRequest, output_vocab_size
from specla_compile.runtime.topology import PAD
from specla_compile.runtime.tree_builder import build_draft

VOCAB = 300


def recompute_step(model, sequences):
    """Oracle step function: no cache, every frontier node's full token sequence re-run from scratch."""
    state = {}

    def step(frontier):
        if frontier.depth == 0:
            state["paths"] = [[seq.tolist()] for seq in sequences]
        else:
            state["paths"] = [
                [row[s] + [t] for s, t in zip(slots, toks)]
                for row, slots, toks in zip(state["paths"], frontier.parent_slots.tolist(), frontier.tokens.tolist())
            ]
        with torch.no_grad():
            return torch.stack([model(input_ids=torch.tensor(row)).logits[:, -1] for row in state["paths"]])

    return step


def simulate(drafter, model, config, rounds=4, seed=0):
    """Run propose/commit rounds on two rows with random committed lengths; after each propose compare
    with the oracle. Returns the number of comparisons."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (5, 9)]
    drafter.begin(seqs)
    for _ in range(rounds):
        seqs = [torch.cat([s, torch.randint(0, VOCAB, (1,), generator=gen)]) for s in seqs]  # the pending token
        draft = drafter.propose(DraftRequest([0, 1], seqs), config)
        expected = build_draft(recompute_step(model, seqs), torch.stack([s[-1] for s in seqs]), config)
        assert torch.equal(draft.tokens, expected.tokens) and torch.equal(draft.parents, expected.parents)
        assert draft.probs is None
        # Commit a random accepted prefix: part of the draft chain or random tokens (rejections).
        accepted = [
            torch.randint(0, VOCAB, (int(torch.randint(0, 3, (1,), generator=gen)),), generator=gen) for _ in seqs
        ]
        drafter.commit([0, 1], [torch.cat([s[-1:], a]) for s, a in zip(seqs, accepted)])
        seqs = [torch.cat([s, a]) for s, a in zip(seqs, accepted)]
    return rounds


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_chain_is_the_small_models_greedy_chain(kind):
    model = tiny_lm(kind, vocab=VOCAB, seed=1)
    drafter = ModelDrafter(model)
    config = SpecConfig(mode="chain", depth=4)
    gen = torch.Generator().manual_seed(2)
    seq = torch.randint(0, VOCAB, (7,), generator=gen)
    drafter.begin([seq[:-1]])
    draft = drafter.propose(DraftRequest([0], [seq]), config)
    with torch.no_grad():
        greedy = model.generate(seq[None], max_new_tokens=4, do_sample=False, pad_token_id=0)[0, len(seq) - 1 :]
    assert draft.tokens[0].tolist() == greedy.tolist()
    assert simulate(drafter, model, config, seed=3)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_tree_matches_recomputation_across_rounds(kind):
    model = tiny_lm(kind, vocab=VOCAB, seed=4)
    assert simulate(ModelDrafter(model), model, SpecConfig(mode="tree", depth=3, tree_top_k=3, budget=7, tau=3.0), seed=5)


def test_only_requested_rows_are_drafted_and_errors():
    model = tiny_lm(vocab=VOCAB)
    drafter = ModelDrafter(model)
    drafter.begin([torch.tensor([1, 2, 3]), torch.tensor([4, 5])])
    draft = drafter.propose(DraftRequest([1], [torch.tensor([4, 5, 6])]), SpecConfig(mode="chain", depth=2))
    assert draft.tokens.shape == (1, 3) and drafter._rows[0] == (None, 0, None)
    again = drafter.propose(DraftRequest([1], [torch.tensor([4, 5, 6])]), SpecConfig(mode="chain", depth=2))
    assert torch.equal(draft.tokens, again.tokens), "re-drafting the same sequence is idempotent"
    with pytest.raises(ValueError, match="shorter"):
        drafter.propose(DraftRequest([1], [torch.tensor([4, 5])]), SpecConfig(mode="chain", depth=2))
    with pytest.raises(ValueError, match="begin"):
        drafter.propose(DraftRequest([5], [torch.tensor([4, 5, 6])]), SpecConfig())


def test_vocabulary_check():
    drafter = ModelDrafter(tiny_lm(vocab=VOCAB))
    drafter.check_vocab(output_vocab_size(tiny_lm(vocab=VOCAB, seed=9)))
    with pytest.raises(ValueError, match="vocabulary of 300 tokens but the target has 301"):
        drafter.check_vocab(output_vocab_size(tiny_lm(vocab=301)))


def test_from_pretrained(tmp_path):
    model = tiny_lm(vocab=VOCAB, seed=6)
    model.save_pretrained(tmp_path)
    loaded = ModelDrafter.from_pretrained(tmp_path)
    seq = torch.tensor([3, 1, 4, 1, 5])
    drafters = (ModelDrafter(model), loaded)
    for d in drafters:
        d.begin([seq[:-1]])
    config = SpecConfig(mode="tree", depth=2, tree_top_k=2, budget=4)
    a, b = (d.propose(DraftRequest([0], [seq]), config) for d in drafters)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.parents, b.parents)


@pytest.mark.parametrize("family", ["fla", "qwen3_5", "qwen3_next"])
def test_gdn_drafter_rolls_back_by_drafting_on_a_copy(family):
    """A GDN drafter's recurrent state cannot be cropped: drafts must still match recomputation after
    commits. Uses the shared tiny GDN models (skipped where that module is absent)."""
    models = pytest.importorskip("models")
    model = models.tiny_model(family, layers=2)
    vocab = models.VOCAB
    drafter = ModelDrafter(model)
    gen = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in (4, 7)]
    drafter.begin(seqs)
    for config in (SpecConfig(mode="chain", depth=3), SpecConfig(mode="tree", depth=3, tree_top_k=2, budget=5)):
        for _ in range(2):
            seqs = [torch.cat([s, torch.randint(0, vocab, (1,), generator=gen)]) for s in seqs]
            draft = drafter.propose(DraftRequest([0, 1], seqs), config)
            expected = build_draft(recompute_step(model, seqs), torch.stack([s[-1] for s in seqs]), config)
            assert torch.equal(draft.tokens, expected.tokens) and torch.equal(draft.parents, expected.parents)
            accepted = [draft.tokens[0, 1:3], draft.tokens[1, 1:1]]
            drafter.commit([0, 1], [torch.cat([s[-1:], a]) for s, a in zip(seqs, accepted)])
            seqs = [torch.cat([s, a]) for s, a in zip(seqs, accepted)]


@pytest.mark.parametrize("kind", ["llama", "qwen3_5", "fla"])
def test_ragged_batch_is_drafted_together_and_equals_each_row_alone(kind):
    """Rows of different lengths committing different numbers of tokens: the batched drafts equal each
    row drafted as a batch of one, with one forward per draft level plus one per distinct count of new
    tokens (catch-up)."""
    if kind == "llama":
        model, vocab = tiny_lm(vocab=VOCAB, seed=8, init_std=0.3), VOCAB
    else:
        models = pytest.importorskip("models")
        model, vocab = models.tiny_model(kind, layers=2, seed=8), models.VOCAB
    forwards = []
    model.register_forward_hook(lambda *_: forwards.append(1))
    gen = torch.Generator().manual_seed(9)
    seqs = [torch.randint(0, vocab, (n,), generator=gen) for n in (3, 8, 5, 6)]
    rows = list(range(len(seqs)))
    batched, alone = ModelDrafter(model), [ModelDrafter(model) for _ in seqs]
    batched.begin(seqs)
    for drafter, seq in zip(alone, seqs):
        drafter.begin([seq])
    committed = [0] * len(seqs)
    for config in (SpecConfig(mode="chain", depth=3), SpecConfig(mode="tree", depth=3, tree_top_k=2, budget=6)):
        for _ in range(2):
            seqs = [torch.cat([s, torch.randint(0, vocab, (1,), generator=gen)]) for s in seqs]
            forwards.clear()
            draft = batched.propose(DraftRequest(rows, seqs), config)
            new_counts = {len(s) - c for s, c in zip(seqs, committed)}
            assert len(forwards) == len(new_counts) + config.depth - 1
            for b, (drafter, seq) in enumerate(zip(alone, seqs)):
                one = drafter.propose(DraftRequest([0], [seq]), config)
                n = one.tokens.shape[1]
                assert torch.equal(draft.tokens[b, :n], one.tokens[0])
                assert torch.equal(draft.parents[b, :n], one.parents[0])
                assert (draft.parents[b, n:] == PAD).all()
            committed = [len(s) for s in seqs]
            # Commit 0 to 2 more tokens per row, so the next propose has ragged new tokens.
            counts = torch.randint(0, 3, (len(rows),), generator=gen).tolist()
            accepted = [torch.randint(0, vocab, (n,), generator=gen) for n in counts]
            batched.commit(rows, [torch.cat([s[-1:], a]) for s, a in zip(seqs, accepted)])
            for drafter, s, a in zip(alone, seqs, accepted):
                drafter.commit([0], [torch.cat([s[-1:], a])])
            seqs = [torch.cat([s, a]) for s, a in zip(seqs, accepted)]
