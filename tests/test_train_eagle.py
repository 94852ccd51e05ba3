import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch
from tiny_lm import features_of, tiny_lm
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specla_compile.runtime.config import SpecConfig
from specla_compile.runtime.drafters import EagleDrafter
from specla_compile.runtime.drafting import DraftRequest

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "theta", "iota"]


def load_script():
    spec = importlib.util.spec_from_file_location("train_eagle", ROOT / "examples" / "train_eagle.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def workdir(tmp_path):
    """A tiny target saved with a word-level tokenizer, and a corpus of a .txt and a .jsonl file."""
    target = tiny_lm(vocab=300, seed=0)
    target.save_pretrained(tmp_path / "target")
    vocab = {w: i + 2 for i, w in enumerate(WORDS)} | {"[UNK]": 0, "[EOS]": 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="[EOS]").save_pretrained(
        tmp_path / "target"
    )
    rng = random.Random(0)
    text = lambda n: " ".join(rng.choice(WORDS[:5]) if rng.random() < 0.8 else rng.choice(WORDS) for _ in range(n))  # noqa: E731
    (tmp_path / "a.txt").write_text(text(500))
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": text(40)}) + "\n" for _ in range(15)))
    return tmp_path


def args(work, out, steps, *extra):
    return [
        "--target",
        str(work / "target"),
        "--data",
        str(work / "a.txt"),
        str(work / "b.jsonl"),
        "--out",
        str(out),
        "--seq-len",
        "32",
        "--batch-size",
        "8",
        "--steps",
        str(steps),
        "--lr",
        "3e-3",
        "--save-every",
        "15",
        "--device",
        "cpu",
        *extra,
    ]


@pytest.mark.parametrize("tokenizer", [[], ["--tokenizer", "none"]], ids=["target-tokenizer", "bytes"])
def test_training_runs_loss_drops_and_resumes(workdir, tokenizer):
    script = load_script()
    out = workdir / "head"
    first = script.main(args(workdir, out, 30, *tokenizer))
    losses = [r["loss"] for r in first]
    assert [r["step"] for r in first] == list(range(1, 31))
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5, losses
    assert first[-1]["top1"] > first[0]["top1"]

    second = script.main(args(workdir, out, 40, *tokenizer, "--resume"))
    assert [r["step"] for r in second] == list(range(31, 41))
    assert second[0]["loss"] < losses[0], "resumed from the trained head, not from scratch"
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 41))
    assert torch.load(out / "trainer_state.pt")["step"] == 40

    target = tiny_lm(vocab=300, seed=0)
    drafter = EagleDrafter.from_pretrained(out, target)
    seq = torch.randint(2, 10, (12,), generator=torch.Generator().manual_seed(1))
    drafter.begin([seq[:-1]], [features_of(target, seq[:-1])])
    draft = drafter.propose(DraftRequest([0], [seq]), SpecConfig(mode="tree", depth=3, tree_top_k=2, budget=5))
    assert draft.tokens.shape[1] == 6
    # the head keeps the training tokens by frequency: the five common words first (word-level tokenizer)
    ranking = drafter.head.token_ranking
    assert sorted(ranking.tolist()) == list(range(300))
    if not tokenizer:
        assert set(ranking[:5].tolist()) == {2, 3, 4, 5, 6}


def test_bad_corpus_and_resume_errors(workdir):
    script = load_script()
    (workdir / "bad.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(ValueError, match="'text' field"):
        script.read_corpus([str(workdir / "bad.jsonl")])
    with pytest.raises(ValueError, match="not found"):
        script.read_corpus([str(workdir / "missing.txt")])
    with pytest.raises(ValueError, match="no checkpoint"):
        script.main(args(workdir, workdir / "fresh", 5, "--resume"))
    with pytest.raises(ValueError, match="fewer than one block"):
        script.make_blocks(list(range(10)), 32)
    with pytest.raises(ValueError, match=r"--unroll must be in \[1, 30\]"):
        script.parse_args(args(workdir, workdir / "fresh", 5, "--unroll", "31"))


def test_unrolled_training_reports_each_step(workdir):
    """--unroll 2: the head also trains on its own predictions; each step logs the second step's agreement."""
    history = load_script().main(args(workdir, workdir / "head", 4, "--unroll", "2"))
    assert len(history) == 4 and all(0 <= r["top1_2"] <= 1 and r["loss"] > 0 for r in history)


def test_batches_cover_every_block_each_epoch():
    script = load_script()
    seen = torch.cat([script.batch_indices(10, step, 4, seed=3) for step in range(5)])  # 20 samples = 2 epochs
    assert sorted(seen[:10].tolist()) == list(range(10)) and sorted(seen[10:].tolist()) == list(range(10))
    assert torch.equal(script.batch_indices(10, 3, 4, seed=3), seen[12:16])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_train_step_runs_the_head_in_its_precision_and_keeps_fp32_weights(workdir, precision):
    """--head-precision bf16: the head's GEMMs run in bf16 autocast, its weights and gradients stay fp32 and
    the step lowers the loss on a batch it saw (fp32: every GEMM in fp32)."""
    from specla_compile.runtime.drafters import EagleConfig, EagleHead

    script = load_script()
    step_args = script.parse_args(args(workdir, workdir / "head", 1, "--head-precision", precision))
    target = tiny_lm(vocab=300, seed=0)
    torch.manual_seed(0)
    head = EagleHead(EagleConfig.for_target(target))
    optimizer = script.head_optimizer(head, 3e-3)
    seen = []
    head.q_proj.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    ids = torch.randint(2, 300, (4, 32), generator=torch.Generator().manual_seed(0))
    losses = [script.train_step(head, target, optimizer, ids, step_args)[0].item() for _ in range(5)]
    assert set(seen) == {torch.bfloat16 if precision == "bf16" else torch.float32}
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in head.parameters() if p.grad is not None)
    assert losses[-1] < losses[0], losses


def test_cached_features_give_the_step_of_the_target_run_on_every_row(workdir):
    """--cache-features: with the last rows' features known, the target runs on the other rows and the LM head
    gives the known rows' logits; the step's loss, statistics and updated head equal the uncached step's."""
    from specla_compile.runtime.drafters import EagleConfig, EagleHead

    script = load_script()
    step_args = script.parse_args(args(workdir, workdir / "head", 1, "--unroll", "2"))
    target = tiny_lm(vocab=300, seed=0)
    ids = torch.randint(2, 300, (4, 32), generator=torch.Generator().manual_seed(0))
    heads, results = [], []
    for rows in (0, 3, 4):  # known rows: none, the last three, all
        torch.manual_seed(0)
        head = EagleHead(EagleConfig.for_target(target))
        known = script.block_features(target, ids[4 - rows :], step_args) if rows else None
        results.append(script.train_step(head, target, script.head_optimizer(head, 3e-3), ids, step_args, known))
        heads.append(head)
    for (loss, stats), head in zip(results[1:], heads[1:]):
        assert torch.allclose(loss, results[0][0], rtol=1e-5) and stats == pytest.approx(results[0][1], rel=1e-5)
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(head.parameters(), heads[0].parameters()))
    with pytest.raises(ValueError, match="needs --distill-blocks"):
        script.parse_args(args(workdir, workdir / "head", 1, "--cache-features"))


def test_cached_features_refuse_a_target_whose_logits_are_not_its_lm_head_over_the_last_state(workdir):
    script = load_script()
    target = tiny_lm(vocab=300, seed=0)
    forward = target.forward

    def soft_capped(*args, **kwargs):  # (as Gemma's final logit soft cap: logits past the LM head)
        out = forward(*args, **kwargs)
        out.logits = 30 * torch.tanh(out.logits / 30) + 1
        return out

    target.forward = soft_capped
    with pytest.raises(ValueError, match="not its LM head over its last hidden state"):
        script.block_features(target, torch.randint(2, 300, (2, 8)), script.parse_args(args(workdir, workdir / "h", 1)))
