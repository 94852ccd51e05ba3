import importlib.util
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import specla_compile  # noqa: F401  (routes fla's GPU entry points to the references on CPU)
from specla_compile.kernels.reference import gdn_chain_reference
from specla_compile.training import TRAINER_STATE
from specla_compile.training import corpus as C
from specla_compile.training.chunked_gdn import (
    ChunkFactors,
    chunk_factors,
    chunked_gdn,
    sequential_pass,
    torch_chunk_gdn,
    unit_lower_inverse,
    written_scan,
)
from specla_compile.training.self_distill import DISTILL_BLOCKS
from specla_compile.training.tokenizer import token_byte_lengths, train_bpe_tokenizer

ROOT = Path(__file__).resolve().parents[1]
WORDS = "the a cat dog sat on mat ran fast slow big small red blue über naïve 東京".split()


def load_script(name: str = "train_target"):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return load_script()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def write_corpus(root: Path) -> Path:
    """A ShareGPT-shaped JSON file cut off mid-record (like the packaged one) and a folder of code."""
    rng = random.Random(0)
    records = [
        {
            "id": f"conv{i // 2}_{i % 2}",
            "conversations": [
                {"from": "human", "value": sentence(rng, 12)},
                {"from": "gpt", "value": sentence(rng, 30)},
            ],
        }
        for i in range(240)
    ]
    text = json.dumps(records, indent=1)
    (root / "sharegpt.json").write_text(text[: len(text) - 40])  # truncated inside the last record
    (root / "prompts.jsonl").write_text(
        json.dumps({"turns": [records[5]["conversations"][0]["value"].upper() + "?"]})
        + "\n"
        + json.dumps({"prompt": "too short"})
        + "\n"
    )
    code = root / "code"
    for i in range(40):
        sub = code / f"pkg{i % 3}"
        sub.mkdir(parents=True, exist_ok=True)
        body = "\n".join(
            f"def f{j}(x):\n    return x * {rng.randint(0, 99)} + {j}\n" for j in range(rng.randint(3, 12))
        )
        (sub / f"mod{i}.py").write_text(body)
    (code / "pkg0" / "copy.py").write_text((code / "pkg0" / "mod0.py").read_text())  # a duplicate file
    return root


def corpus_args(corpus_dir: Path) -> list[str]:
    """The corpus options both training scripts take (same corpus, same split)."""
    files = ["--sharegpt", str(corpus_dir / "sharegpt.json"), "--code-dirs", str(corpus_dir / "code")]
    return [*files, "--heldout-fraction", "0.1", "--exclude-prompts", str(corpus_dir / "prompts.jsonl")]


def train_args(corpus_dir: Path, out: Path, steps: int, *extra: str) -> list[str]:
    tiny = "--vocab-size 300 --hidden-size 32 --num-layers 1 --num-heads 2 --head-dim 16 --seq-len 32 --batch-size 4"
    schedule = "--lr 1e-2 --warmup 2 --eval-every 1000 --eval-blocks 2 --gdn-chunk 8"
    return [
        "--out",
        str(out),
        *corpus_args(corpus_dir),
        *tiny.split(),
        *schedule.split(),
        "--steps",
        str(steps),
        *extra,
    ]


# --- corpus and split --------------------------------------------------------------------------------


def test_truncated_sharegpt_reads_complete_records_in_turn_format(corpus_dir):
    docs = C.read_sharegpt(corpus_dir / "sharegpt.json")
    assert len(docs) == 239  # the cut-off last record is dropped, the others all read
    assert docs[0].text.startswith("USER: ") and "\nASSISTANT: " in docs[0].text and docs[0].text.endswith("\n")
    assert docs[0].group == docs[1].group != docs[2].group  # parts _0 and _1 of one conversation
    prompt = C.format_prompt("hi there", history=[("human", "a"), ("gpt", "b")])
    assert prompt == "USER: a\nASSISTANT: b\nUSER: hi there\nASSISTANT:"
    # a prompt is a prefix of the training text of the conversation it starts
    assert C.format_conversation([("human", "hi there"), ("gpt", "hello")]).startswith(C.format_prompt("hi there"))


def test_heldout_split_is_deterministic_disjoint_and_keeps_groups_together(corpus_dir):
    docs = C.read_sharegpt(corpus_dir / "sharegpt.json") + C.read_python_sources([corpus_dir / "code"])
    assert sum(d.group.startswith("code:") for d in docs) == 40  # the duplicate file is read once
    train, heldout = C.split_documents(docs, 0.2)
    again = C.split_documents(list(reversed(docs)), 0.2)
    assert {d.text for d in again[1]} == {d.text for d in heldout}  # order-independent
    assert heldout and train and len(train) + len(heldout) == len(docs)
    assert not {d.group for d in train} & {d.group for d in heldout}
    assert not {d.text for d in train} & {d.text for d in heldout}
    share = np.mean([C.is_heldout(f"g{i}", 0.2) for i in range(4000)])
    assert 0.17 < share < 0.23


def test_training_documents_containing_a_benchmark_prompt_are_dropped(script, corpus_dir, tmp_path):
    prompts = C.read_prompts([corpus_dir / "prompts.jsonl"])
    docs = [
        C.Document("Intro. " + prompts[0].lower().replace(" ", " , ") + " and more", "a"),
        C.Document(" ".join(prompts[0].split()[:-1]), "b"),  # only a part of the prompt
        C.Document("it is too short, really", "c"),
    ]
    kept, dropped = C.decontaminate(docs, prompts)
    assert dropped == 1 and kept == docs[1:]
    args = script.parse_args(train_args(corpus_dir, tmp_path, 1, "--heldout-fraction", "0.01"))
    train, heldout = C.read_corpus(args)["sharegpt"]
    contaminated = C.read_sharegpt(corpus_dir / "sharegpt.json")[5]
    assert contaminated not in train and len(train) + len(heldout) == 239 - 1 + (contaminated in heldout)


def test_tokenizer_round_trips_and_counts_bytes(tmp_path):
    rng = random.Random(1)
    texts = [sentence(rng, 40) for _ in range(50)] + ["def f(x):\n\treturn  x  # ünïcode ✓\n"]
    tok = train_bpe_tokenizer(texts, vocab_size=300)
    tok.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.eos_token == "<|endoftext|>" and loaded.pad_token == "<|pad|>" and len(loaded) == 300
    lengths = token_byte_lengths(loaded)
    for text in [*texts[-3:], "unseen: Zürich 🙂 \r\n\x00 tabs\t\tand  spaces"]:
        ids = loaded(text, add_special_tokens=False)["input_ids"]
        assert loaded.decode(ids) == text
        assert lengths[ids].sum() == len(text.encode("utf-8"))
    merged = loaded("the cat sat", add_special_tokens=False)["input_ids"]
    assert len(merged) < len("the cat sat")  # BPE learned merges from the corpus
    stream = C.encode_documents(tok.backend_tokenizer, texts[:3], tok.eos_token_id)
    assert (stream == tok.eos_token_id).sum() == 3 and stream[-1] == tok.eos_token_id


def test_unigram_baseline_matches_the_entropy_formula(script):
    lengths = np.array([1, 2, 3, 0])
    train = np.array([0, 0, 1, 2])
    out = script.unigram_baseline(train, {"s": torch.tensor([[0, 1, 2]])}, lengths)
    entropy = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert out["entropy_nats_per_token"] == pytest.approx(entropy)
    assert out["entropy_bits_per_byte"] == pytest.approx(entropy / math.log(2) / (0.5 * 1 + 0.25 * 2 + 0.25 * 3))
    heldout = -(math.log(2 / 8) + math.log(2 / 8)) / 2  # add-one smoothed: counts 1 + 1 of 4 + 4, targets 1 and 2
    assert out["heldout_s"]["nats_per_token"] == pytest.approx(heldout)


# --- the chunked recurrence --------------------------------------------------------------------------


def gdn_inputs(b, n, h, hv, dk, dv, seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return (
        r(b, n, h, dk),
        r(b, n, h, dk),
        r(b, n, hv, dv),
        -torch.rand(b, n, hv, generator=g, dtype=dtype) * 2,
        torch.rand(b, n, hv, generator=g, dtype=dtype),
        r(b, hv, dk, dv),
    )


@pytest.mark.parametrize("n,chunk", [(1, 4), (13, 4), (16, 16), (37, 8), (50, 64)])
def test_chunked_gdn_matches_reference_in_fp64(n, chunk):
    q, k, v, g, beta, state = gdn_inputs(2, n, 2, 4, 8, 6, seed=n)
    for s0, l2 in ((state, True), (None, False)):
        o, final = chunked_gdn(q, k, v, g, beta, s0, use_qk_l2norm=l2, chunk_size=chunk, scale=0.3)
        ref_o, ref_final = gdn_chain_reference(q, k, v, g, beta, s0, use_qk_l2norm=l2, scale=0.3)
        torch.testing.assert_close(o, ref_o, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(final, ref_final, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("n,chunk", [(11, 4), (24, 8)])
def test_chunked_gdn_gradients_match_reference(n, chunk):
    inputs = [t.requires_grad_() for t in gdn_inputs(1, n, 1, 2, 8, 4, seed=100 + n)]
    weights = torch.randn(1, n, 2, 4, dtype=torch.float64), torch.randn(1, 2, 8, 4, dtype=torch.float64)
    grads = []
    for fn in (
        lambda *a: chunked_gdn(*a, use_qk_l2norm=True, chunk_size=chunk),
        lambda *a: gdn_chain_reference(*a, use_qk_l2norm=True),
    ):
        o, final = fn(*inputs)
        grads.append(torch.autograd.grad((o * weights[0]).sum() + (final * weights[1]).sum(), inputs))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


def test_compiled_chunked_gdn_and_its_compiled_scan_match_the_eager_one_with_gradients():
    """Inductor compiles the chunk-parallel part (``compile``, with either triangular form) and the pass over chunks
    (``scan="compiled"``, unrolled), and the pass with its backward written out (``scan="written"``): the same
    outputs, final state and gradients in fp64 as eager PyTorch with autograd through the loop."""
    inputs = [t.requires_grad_() for t in gdn_inputs(2, 21, 1, 2, 8, 4, seed=21)]
    weights = torch.randn(2, 21, 2, 4, dtype=torch.float64), torch.randn(2, 2, 8, 4, dtype=torch.float64)
    found = []
    for options in ({}, {"scan": "written"}, {"compile": True}, {"compile": True, "scan": "compiled"},
                    {"compile": True, "triangular": "inverse"}):
        o, final = chunked_gdn(*inputs, use_qk_l2norm=True, chunk_size=8, **options)
        found.append((o, final, *torch.autograd.grad((o * weights[0]).sum() + (final * weights[1]).sum(), inputs)))
    for compiled in found[1:]:
        for got, want in zip(compiled, found[0]):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("c,block", [(64, 16), (24, 16), (13, 16), (5, 2)])
def test_unit_lower_inverse_inverts_by_blocks_in_fp64(c, block):
    """(I + L)^-1 from forward substitution in diagonal blocks and block rows joined below (a divisor of C as the
    block: 8 for 24, the whole 13 for a prime, 1 for 5 at block 2), against the identity, in fp64."""
    g = torch.Generator().manual_seed(c)
    strict = torch.randn(3, 2, c, c, generator=g, dtype=torch.float64).tril(-1) * 0.5
    eye = torch.eye(c, dtype=torch.float64)
    inverse = unit_lower_inverse(strict, block)
    torch.testing.assert_close(inverse @ (eye + strict), eye.expand_as(strict), rtol=0, atol=1e-10)
    torch.testing.assert_close(inverse, torch.linalg.inv(eye + strict), rtol=1e-10, atol=1e-10)


def test_chunked_gdn_through_the_inverse_matches_the_solve_with_gradients():
    """``triangular="inverse"`` (matmuls) computes the same outputs, final state and gradients as the triangular
    solve, in fp64 (chunks of 24 tokens: two diagonal blocks of 12, the second chunk's tail padded)."""
    inputs = [t.requires_grad_() for t in gdn_inputs(2, 29, 1, 2, 8, 4, seed=29)]
    weights = torch.randn(2, 29, 2, 4, dtype=torch.float64), torch.randn(2, 2, 8, 4, dtype=torch.float64)
    found = []
    for triangular in ("solve", "inverse"):
        o, final = chunked_gdn(*inputs, use_qk_l2norm=True, chunk_size=24, triangular=triangular)
        found.append((o, final, *torch.autograd.grad((o * weights[0]).sum() + (final * weights[1]).sum(), inputs)))
    for got, want in zip(found[1], found[0]):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="triangular must be one of"):
        chunked_gdn(*inputs, triangular="lu")
    with pytest.raises(ValueError, match="scan must be one of"):
        chunked_gdn(*inputs, scan="python")


@pytest.mark.parametrize("chunks", [1, 3])
def test_the_written_scan_backward_is_the_gradient_in_fp64(chunks):
    """The pass over chunks with its backward written out, against finite differences (gradcheck, fp64) for every
    factor and the entering state, with the outputs and the final state both used."""
    g = torch.Generator().manual_seed(chunks)
    shapes = {"w": (4,), "u0": (3,), "qk": (5,), "q_decayed": (4,), "k_to_end": (4,)}
    factors = [torch.randn(chunks, 2, 2, 5, *shapes[name], generator=g, dtype=torch.float64) for name in shapes]
    factors.append(torch.rand(chunks, 2, 2, generator=g, dtype=torch.float64))  # end_decay
    state = torch.randn(2, 2, 4, 3, generator=g, dtype=torch.float64)
    inputs = [t.requires_grad_() for t in (*factors, state)]
    assert torch.autograd.gradcheck(lambda *t: written_scan(ChunkFactors(*t[:-1]), t[-1]), inputs)
    for got, want in zip(written_scan(ChunkFactors(*factors), state), sequential_pass(ChunkFactors(*factors), state)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_pass_over_chunks_backward_costs_linear_not_quadratic_work_in_the_chunk_count():
    """Per-chunk slices of the chunk factors are taken by one unbind, not by indexing in the loop: the backward of
    ``x[:, :, c]`` writes a zero tensor as large as all of x and adds it to x's gradient, once per chunk (on an H100 that
    was most of the 24-layer target's training step). So the backward holds one stack per factor, whatever the
    number of chunks, and no select or slice backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorded(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    stacks = []
    for n in (16, 64):  # 4 and 16 chunks
        q, k, v, g, beta, state = gdn_inputs(1, n, 1, 2, 8, 4, seed=n)
        factors = ChunkFactors(*(t.requires_grad_() for t in chunk_factors(q, k, v, g, beta, 0.3, True, 4)))
        o, final = sequential_pass(factors, state.requires_grad_())
        with Recorded() as recorded:
            (o.square().sum() + final.square().sum()).backward()
        assert not {"select_backward", "slice_backward"} & set(recorded.ops), recorded.ops
        stacks.append(recorded.ops.count("stack"))
    assert stacks[0] == stacks[1] == len(ChunkFactors._fields)


def test_chunked_gdn_gradcheck():
    inputs = [t.requires_grad_() for t in gdn_inputs(1, 6, 1, 2, 3, 2, seed=7)]
    assert torch.autograd.gradcheck(lambda *a: chunked_gdn(*a, use_qk_l2norm=True, chunk_size=4), inputs)


def test_torch_backend_swaps_the_recurrence_inside_fla_layers_only_within_the_block(monkeypatch):
    import fla.layers.gated_deltanet as layer_module
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    from specla_compile.training import chunked_gdn as module

    calls = []
    monkeypatch.setattr(module, "chunked_gdn", lambda *a, **kw: calls.append(kw["chunk_size"]) or chunked_gdn(*a, **kw))

    torch.manual_seed(0)
    config = GatedDeltaNetConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_heads=2,
        head_dim=16,
        expand_v=1.0,
        vocab_size=50,
        fuse_cross_entropy=False,
    )
    model = GatedDeltaNetForCausalLM(config).train()
    ids = torch.randint(0, 50, (2, 21))
    before = layer_module.chunk_gated_delta_rule
    ref = model(input_ids=ids).logits  # the specla CPU route: the sequential reference
    ref_grad = torch.autograd.grad(ref.square().sum(), model.model.layers[0].attn.A_log)[0]
    with torch_chunk_gdn(chunk_size=8):
        assert layer_module.chunk_gated_delta_rule is not before
        out = model(input_ids=ids).logits
        grad = torch.autograd.grad(out.square().sum(), model.model.layers[0].attn.A_log)[0]
    assert layer_module.chunk_gated_delta_rule is before
    assert calls == [8, 8]  # both layers' forward passes ran the chunked recurrence, and only inside the block
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("length", [80, 5], ids=["chunk-mode", "fused-recurrent-mode"])
def test_plain_torch_fla_calls_no_fla_kernel_and_gives_the_model_forward(monkeypatch, length):
    """The EAGLE head's features path: inside plain_torch_fla an fla GDN model's hidden states and logits
    are those of its plain forward, and none of fla's own (Triton) functions runs even where the capture
    would hand them the call (as on CUDA)."""
    import fla.layers.gated_deltanet as layer_module
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    from specla_compile.lowering import capture
    from specla_compile.training.chunked_gdn import plain_torch_fla

    torch.manual_seed(0)
    config = GatedDeltaNetConfig(hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16, expand_v=1.0,
                                 vocab_size=50, fuse_cross_entropy=False)
    assert config.fuse_norm and config.fuse_swiglu and config.use_short_conv  # fla's fused modules are in the model
    model = GatedDeltaNetForCausalLM(config).eval()
    ids = torch.randint(0, 50, (2, length))
    names = ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d")
    before = [getattr(layer_module, n) for n in names]
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True)  # CPU: the capture's sequential references
        monkeypatch.setattr(capture, "use_specla_path", lambda x: False)  # every wrapper now calls fla's original
        with pytest.raises(Exception):  # (which cannot run here: proof that the originals are reached)
            model(input_ids=ids)
        with plain_torch_fla(chunk_size=16):
            out = model(input_ids=ids, output_hidden_states=True)
    assert [getattr(layer_module, n) for n in names] == before  # restored
    torch.testing.assert_close(out.hidden_states[-1], ref.hidden_states[-1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-5)
    assert not torch.equal(out.hidden_states[-1], out.hidden_states[0])  # (the layers did something)


def test_checkpointed_layers_run_twice_a_step_and_give_the_same_gradients(script):
    """``--gradient-checkpointing``: each layer's forward runs again in the backward pass (its activations were not
    kept), the gradients are those of the plain step, and a no-grad call runs each layer once."""
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    config = GatedDeltaNetConfig(hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16, expand_v=1.0,
                                 vocab_size=50, fuse_cross_entropy=False)
    torch.manual_seed(0)
    plain = GatedDeltaNetForCausalLM(config).train()
    checkpointed = GatedDeltaNetForCausalLM(config).train()
    checkpointed.load_state_dict(plain.state_dict())
    script.checkpoint_layers(checkpointed)
    block = torch.randint(0, 50, (2, 25))
    grads, calls = {}, {}
    for name, model in (("plain", plain), ("checkpointed", checkpointed)):
        calls[name] = []
        for layer in model.model.layers:
            layer.attn.register_forward_hook(lambda *args, name=name: calls[name].append(1))
        with torch_chunk_gdn(chunk_size=8):
            script.lm_loss(model, block).backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters()}
    assert (len(calls["plain"]), len(calls["checkpointed"])) == (2, 4)  # (each layer recomputed once)
    for n, g in grads["plain"].items():
        torch.testing.assert_close(grads["checkpointed"][n], g, rtol=1e-5, atol=1e-7)
    calls["checkpointed"].clear()
    with torch.no_grad():
        script.lm_loss(checkpointed, block)
    assert len(calls["checkpointed"]) == 2


# --- the training script -----------------------------------------------------------------------------


def test_bad_cli_input_fails_fast_with_one_line(script, corpus_dir, tmp_path, capsys):
    good = train_args(corpus_dir, tmp_path / "out", 1)
    for bad, message in (
        (["--code-dirs", str(tmp_path / "missing")], "--code-dirs: directory not found"),
        (["--sharegpt", "none", "--code-dirs", "none"], "leave no corpus"),
        (["--heldout-fraction", "1.5"], "--heldout-fraction"),
        (["--seq-len", "0"], "--seq-len must be positive"),
        (["--device", "cuda"] if not torch.cuda.is_available() else ["--lr", "0"], "--"),
    ):
        with pytest.raises(ValueError, match=message):
            script.parse_args(good + bad)
    with pytest.raises(SystemExit, match="^error: --seq-len"):
        script.main(good + ["--seq-len", "-3"])
    assert not (tmp_path / "out").exists()  # nothing was prepared


@pytest.fixture(scope="module")
def trained(script, corpus_dir, tmp_path_factory):
    """Three runs: 12 steps straight; 7 steps then resumed to 12."""
    base = tmp_path_factory.mktemp("runs")
    straight = script.main(train_args(corpus_dir, base / "straight", 12))
    script.main(train_args(corpus_dir, base / "split", 12, "--stop-after", "7"))
    first_log = (base / "split" / script.LOG_NAME).read_text()
    resumed = script.main(train_args(corpus_dir, base / "split", 12))
    return base, straight, resumed, first_log


def test_training_lowers_the_loss_and_reports(trained, script):
    base, report, _, _ = trained
    out = base / "straight"
    losses = [json.loads(line)["loss"] for line in (out / script.LOG_NAME).read_text().splitlines() if '"loss"' in line]
    assert len(losses) == 12
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.3
    assert report["heldout"]["all"]["nats_per_token"] < math.log(300)  # better than uniform over the vocabulary
    assert report["tokens_seen"] == 12 * 4 * 32 and report["complete"] and report["gdn_backend"] == "torch"
    saved = json.loads((out / script.REPORT_NAME).read_text())
    assert set(saved["heldout"]) == {"sharegpt", "code", "all"} and saved["unigram"]["entropy_bits_per_byte"] > 0
    if importlib.util.find_spec("matplotlib") is not None:  # (the plot is skipped, with a note, without it)
        assert (out / script.PLOT_NAME).stat().st_size > 1000


def test_resume_continues_from_the_saved_step(trained, script):
    base, straight, resumed, first_log = trained
    log = (base / "split" / script.LOG_NAME).read_text()
    steps = [json.loads(line)["step"] for line in log.splitlines() if '"loss"' in line]
    assert steps == list(range(1, 13))  # 1-7, then 8-12: nothing repeated, nothing skipped
    assert log.startswith(first_log)
    assert torch.load(base / "split" / TRAINER_STATE, weights_only=False)["step"] == 12
    # the same batches, optimizer moments and schedule: the same weights as without the interruption
    a, b = load_file(base / "straight" / "model.safetensors"), load_file(base / "split" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6)
    assert resumed["steps"] == straight["steps"] == 12


def test_gradient_checkpointing_trains_the_same_weights(trained, script, corpus_dir):
    """The option through the script: the 12 steps give the plain run's weights, and the report says it was on."""
    base, straight, _, _ = trained
    report = script.main(train_args(corpus_dir, base / "checkpointed", 12, "--gradient-checkpointing"))
    assert report["gradient_checkpointing"] and not straight["gradient_checkpointing"]
    a, b = load_file(base / "straight" / "model.safetensors"), load_file(base / "checkpointed" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6)


def test_a_step_out_of_gpu_memory_stops_with_one_line_of_advice(script, corpus_dir, tmp_path, monkeypatch):
    def out_of_memory(model, block):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.95 GiB.")

    monkeypatch.setattr(script, "lm_loss", out_of_memory)
    with pytest.raises(SystemExit, match=r"^error: step 1 ran out of GPU memory \(1 layers at hidden 32, --batch-size 4 "
                       r"x --seq-len 32\): pass --gradient-checkpointing or a smaller --batch-size$"):
        script.main(train_args(corpus_dir, tmp_path / "out", 3))
    with pytest.raises(SystemExit, match=r"pass a smaller --batch-size$"):
        script.main(train_args(corpus_dir, tmp_path / "out", 3, "--gradient-checkpointing"))


def test_save_pretrained_output_loads_with_identical_logits(trained, script):
    import fla  # noqa: F401  (registers fla's classes with the Auto classes)
    from fla.models import GatedDeltaNetForCausalLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = trained[0] / "straight"
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert isinstance(model, GatedDeltaNetForCausalLM)
    assert model.config.eos_token_id == tokenizer.eos_token_id and model.config.vocab_size == len(tokenizer)
    layer = model.model.layers[0].attn
    assert (layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, layer.conv_size) == (2, 16, 16, 4)
    ids = tokenizer(C.format_prompt("the cat sat on"), return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        model.save_pretrained(out / "again")
        again = AutoModelForCausalLM.from_pretrained(out / "again").eval()(input_ids=ids).logits
    assert torch.equal(logits, again)
    assert torch.isfinite(logits).all() and logits.shape == (1, ids.shape[1], len(tokenizer))


def test_default_model_has_the_paper_layer_shape(script, corpus_dir, tmp_path):
    args = script.parse_args(["--out", str(tmp_path), "--sharegpt", str(corpus_dir / "sharegpt.json")])
    tokenizer = type("Tok", (), {"__len__": lambda self: args.vocab_size, "eos_token_id": 0, "pad_token_id": 1})()
    from fla.models import GatedDeltaNetForCausalLM

    with torch.device("meta"):
        model = GatedDeltaNetForCausalLM(script.model_config(args, tokenizer))
    layer = model.model.layers[0].attn
    assert (layer.num_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, layer.conv_size) == (
        8,
        8,
        256,
        256,
        4,
    )
    counts = script.parameter_counts(model)
    assert counts["total"] - counts["non_embedding"] == 2 * args.vocab_size * args.hidden_size  # untied embeddings


def test_eagle_head_trains_on_the_target_corpus_and_reports_heldout_agreement(trained, corpus_dir, tmp_path):
    eagle = load_script("train_eagle")
    target_dir, out = trained[0] / "straight", tmp_path / "eagle"
    options = "--seq-len 32 --batch-size 4 --steps 16 --lr 5e-3 --eval-every 8 --eval-blocks 2 --device cpu"
    argv = ["--target", str(target_dir), "--out", str(out), *corpus_args(corpus_dir), *options.split()]
    history = eagle.main(argv)
    assert [r["step"] for r in history] == list(range(1, 17))
    assert not (out / C.STREAMS_DIR).exists()  # the target's cached streams of the same corpus were reused
    report = json.loads((out / eagle.REPORT_NAME).read_text())
    evals = [json.loads(line) for line in (out / eagle.LOG_NAME).read_text().splitlines() if "heldout" in line]
    assert [e["step"] for e in evals] == [8, 16] and report["heldout_top1"] == evals[-1]["heldout"]
    assert set(report["heldout_top1"]) == {"sharegpt", "code", "all"}

    # the reported agreement is the trained head's, and training raised it above a fresh head's
    from transformers import AutoModelForCausalLM

    from specla_compile.runtime.drafters.eagle_head import EagleConfig, EagleHead

    args = eagle.parse_args(argv)
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    streams = C.load_streams(target_dir, C.corpus_signature(args))
    blocks = C.heldout_blocks(streams, 32, 2)
    trained_head = eagle.heldout_agreement(EagleHead.from_pretrained(out, dtype=torch.float32), target, blocks, args)
    assert trained_head["all"]["top1"] == pytest.approx(report["heldout_top1"]["all"]["top1"], abs=1e-6)
    torch.manual_seed(0)
    fresh = eagle.heldout_agreement(EagleHead(EagleConfig.for_target(target)), target, blocks, args)
    assert trained_head["all"]["top1"] > fresh["all"]["top1"]
    args.unroll = 2  # (--unroll: the second step's agreement too, the first unchanged)
    unrolled = eagle.heldout_agreement(EagleHead.from_pretrained(out, dtype=torch.float32), target, blocks, args)
    assert unrolled["all"]["top1"] == pytest.approx(trained_head["all"]["top1"]) and 0 <= unrolled["all"]["top1_2"] <= 1


# --- self-distillation: the head also trains on the target's own greedy text ---------------------------


def test_distill_contexts_end_at_assistant_turns_and_mix_sources_by_size():
    from specla_compile.training.self_distill import distill_contexts, marker_ends

    marker = [7, 8, 9]
    chat = np.array([1, 7, 8, 9, 2, 3, 7, 8, 7, 8, 9, 4, 5, 6, 7, 8, 9] * 6)
    assert marker_ends(chat[:17], marker).tolist() == [4, 11, 17]  # (a partial 7, 8 is no marker; one at the very end)
    assert marker_ends(chat[:2], marker).size == 0 and marker_ends(chat, []).size == 0
    code = np.concatenate([np.arange(100, 200), marker, np.arange(200, 297)])  # no turns: contexts anywhere
    streams, ends_with = {"sharegpt": chat, "code": code}, {"sharegpt": marker}
    contexts = distill_contexts(streams, 60, 5, seed=0, ends_with=ends_with)
    assert contexts.shape == (60, 5) and contexts.dtype == torch.int64
    from_chat = [row for row in contexts.tolist() if max(row) < 100]
    assert all(row[-3:] == marker for row in from_chat)
    assert 60 * 102 / 302 - 2 <= len(from_chat) <= 60 * 102 / 302 + 2  # the sources' shares: their stream lengths
    code_rows = [row for row in contexts.tolist() if max(row) >= 100]
    assert len({row[-1] for row in code_rows}) > 10  # anywhere, not at the marker the code stream happens to hold
    assert all(any(row == code[i : i + 5].tolist() for i in range(len(code) - 4)) for row in code_rows)
    assert torch.equal(contexts, distill_contexts(streams, 60, 5, seed=0, ends_with=ends_with))
    with pytest.raises(ValueError, match="no stream is longer than a 500-token context"):
        distill_contexts({"code": code}, 4, 500, seed=0)
    with pytest.raises(ValueError, match=r"no \[7, 8, 9\]"):
        distill_contexts({"sharegpt": np.arange(10, 40)}, 4, 5, seed=0, ends_with=ends_with)


def test_greedy_continuations_are_plain_decoding_without_fla_kernels(monkeypatch):
    """The distilled blocks: each context and the target's greedy tokens, decoded in batches under plain_torch_fla
    (its cache's decoding steps included) with none of fla's own (Triton) functions reachable."""
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

    from specla_compile.lowering import capture
    from specla_compile.runtime.baseline import autoregressive_generate
    from specla_compile.training.chunked_gdn import plain_torch_fla
    from specla_compile.training.self_distill import greedy_continuations

    torch.manual_seed(0)
    config = GatedDeltaNetConfig(hidden_size=32, num_hidden_layers=2, num_heads=2, head_dim=16, expand_v=1.0,
                                 vocab_size=50, fuse_cross_entropy=False)
    model = GatedDeltaNetForCausalLM(config).eval()
    contexts = torch.randint(0, 50, (5, 9))
    expected = [autoregressive_generate(model, row[None], 6)[0][0] for row in contexts]  # the capture's references
    monkeypatch.setattr(capture, "use_specla_path", lambda x: False)  # fla's originals would now be called (and fail)
    with plain_torch_fla(chunk_size=4):
        blocks = greedy_continuations(model, contexts, 6, batch_rows=2)
        first = greedy_continuations(model, contexts, 6, batch_rows=2, max_seconds=0.0)  # the cap: one batch only
    assert blocks.shape == (5, 15) and torch.equal(blocks[:, :9], contexts)
    assert all(torch.equal(block, want) for block, want in zip(blocks, expected))
    assert torch.equal(first, blocks[:2])
    with pytest.raises(ValueError, match="new_tokens and batch_rows"):
        greedy_continuations(model, contexts, 0, batch_rows=2)


def test_eagle_head_trains_on_the_targets_own_continuations(trained, corpus_dir, tmp_path):
    eagle = load_script("train_eagle")
    target_dir, out = trained[0] / "straight", tmp_path / "eagle"
    options = ("--seq-len 32 --batch-size 4 --steps 6 --lr 5e-3 --eval-every 100 --eval-blocks 2 --device cpu "
               "--distill-blocks 6 --distill-new-tokens 8 --distill-batch 4 --distill-share 0.5")
    argv = ["--target", str(target_dir), "--out", str(out), *corpus_args(corpus_dir), *options.split()]
    history = eagle.main(argv)
    assert [r["step"] for r in history] == list(range(1, 7))
    report = json.loads((out / eagle.REPORT_NAME).read_text())
    assert report["self_distillation"]["blocks"] == 6 and report["self_distillation"]["new_tokens"] == 8
    assert 0 <= report["heldout_top1_distilled"]["top1"] <= 1 and set(report["heldout_top1"]) == {"sharegpt", "code", "all"}
    # the acceptance temperature: fitted on the held-out continuations, saved with the head, and no worse a
    # predictor of the target's greedy tokens than the raw probabilities (T = 1)
    calibration = report["acceptance_temperature"]
    saved = json.loads((out / "config.json").read_text())["acceptance_temperature"]
    assert calibration["sources"] == ["distilled"] and saved == pytest.approx(calibration["temperature"], abs=1e-4)
    assert calibration["greedy_token_nll"]["calibrated"] <= calibration["greedy_token_nll"]["raw"] and saved != 1.0

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specla_compile.runtime.baseline import autoregressive_generate
    from specla_compile.training.self_distill import TURN_MARKER

    blocks = torch.load(out / DISTILL_BLOCKS)["blocks"]
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    assert blocks.shape == (6, 32)
    for block in blocks[:2]:  # each block: a context of 24 training tokens, then the target's 8 greedy tokens
        assert torch.equal(autoregressive_generate(target, block[None, :24], 8)[0][0], block)
    marker = AutoTokenizer.from_pretrained(target_dir)(TURN_MARKER, add_special_tokens=False)["input_ids"]
    assert any(block[24 - len(marker) : 24].tolist() == marker for block in blocks)  # conversation contexts
    # --resume trains on the saved blocks (here replaced by three others), not on new ones
    torch.save({"blocks": blocks[:3].flip(0), "new_tokens": 8}, out / DISTILL_BLOCKS)
    # (and with their features cached: the target runs on the corpus rows only)
    again = eagle.main([*argv, "--resume", "--steps", "7", "--cache-features"])
    report = json.loads((out / eagle.REPORT_NAME).read_text())
    resumed = report["self_distillation"]
    assert [r["step"] for r in again] == [7] and resumed["blocks"] == 3 and resumed["reused"] and report["cache_features"]
    with pytest.raises(ValueError, match="ending in 8 greedy ones, not --seq-len 32 and --distill-new-tokens 4"):
        eagle.main([*argv, "--resume", "--steps", "8", "--distill-new-tokens", "4"])
    for bad, message in ((["--distill-share", "0"], "--distill-share in"), (["--distill-new-tokens", "32"], r"\[1, 31\]")):
        with pytest.raises(ValueError, match=message):
            eagle.parse_args([*argv, *bad])
    with pytest.raises(ValueError, match="needs --batch-size >= 2"):
        eagle.parse_args([*argv, "--batch-size", "1"])
    with pytest.raises(ValueError, match="needs the shared corpus"):
        eagle.parse_args([*argv, "--data", str(corpus_dir / "sharegpt.json")])


def test_prepared_data_is_reused_and_a_time_budget_stops_after_saving(script, corpus_dir, tmp_path):
    out = tmp_path / "run"
    prepared = script.main(train_args(corpus_dir, out, 5, "--prepare-only"))
    assert not (out / TRAINER_STATE).exists() and (out / "tokenizer.json").is_file()
    stamp = (out / C.STREAMS_DIR / "code_train.npy").stat().st_mtime_ns
    report = script.main(train_args(corpus_dir, out, 5, "--no-resume", "--max-wall-minutes", "1e-6"))
    assert (out / C.STREAMS_DIR / "code_train.npy").stat().st_mtime_ns == stamp  # not tokenized again
    assert report["corpus_tokens"] == prepared["corpus"]
    assert report["steps"] == 1 and not report["complete"]  # the wall cap counts everything, the first step too
    assert torch.load(out / TRAINER_STATE, weights_only=False)["step"] == 1
    # --max-minutes starts after the first (compiling) step: one step more, however short the budget
    report = script.main(train_args(corpus_dir, out, 5, "--no-resume", "--max-minutes", "1e-6"))
    assert report["steps"] == 2 and not report["complete"]
    assert report["time_budget"]["first_step_seconds"] > 0 and report["time_budget"]["seconds_after_first_step"] > 0
    assert torch.load(out / TRAINER_STATE, weights_only=False)["step"] == 2
    with pytest.raises(ValueError, match="another corpus or tokenizer"):  # a checkpoint of other options
        script.main(train_args(corpus_dir, out, 5, "--vocab-size", "290"))


def test_fit_steps_ends_the_schedule_within_the_time_limit(script, corpus_dir, tmp_path):
    fit = ("--fit-steps", "--max-minutes", "0.3", "--stop-after", "12")
    report = script.main(train_args(corpus_dir, tmp_path / "fit", 100000, *fit))
    planned = report["steps_planned"]
    assert 12 < planned < 100000 and report["steps"] == 12  # fitted at step 10 to the 18 s
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "fit" / script.LOG_NAME).read_text().splitlines() if '"lr"' in line]
    # from step 10 on, the schedule is the one of the fitted length: it decays to 0.1 of the peak at `planned`
    assert lrs[-1] == pytest.approx(1e-2 * script.lr_factor(len(lrs), 2, planned, 0.1))
    assert script.fitted_steps(10, 0.5, 4.9) == 19 and script.fitted_steps(10, 0.5, 0.0) == 11
    with pytest.raises(SystemExit, match="^error: --fit-steps needs --max-minutes"):
        script.main(train_args(corpus_dir, tmp_path / "bad", 5, "--fit-steps"))


def test_eagle_time_budget_stops_after_saving(trained, corpus_dir, tmp_path):
    eagle = load_script("train_eagle")
    options = "--seq-len 32 --batch-size 4 --steps 50 --eval-every 40 --eval-blocks 2 --device cpu".split()
    for cap, steps in (("--max-wall-minutes", 1), ("--max-minutes", 2)):  # --max-minutes: after the first step
        out = tmp_path / cap
        history = eagle.main(["--target", str(trained[0] / "straight"), "--out", str(out), *corpus_args(corpus_dir),
                              *options, cap, "1e-6"])
        report = json.loads((out / eagle.REPORT_NAME).read_text())
        assert len(history) == steps and report["steps"] == steps and not report["complete"]
        assert report["heldout_top1"]["all"]["positions"] > 0 and report["features_backend"] == "torch"
        assert torch.load(out / TRAINER_STATE)["step"] == steps


def test_time_budget_starts_its_training_clock_after_the_first_step():
    from specla_compile.training.budget import TimeBudget

    now = [100.0]
    budget = TimeBudget(minutes=1.0, wall_minutes=5.0, launched=0.0, clock=lambda: now[0])
    assert budget.left() == 60.0 and not budget.out_of_time()
    now[0] = 220.0  # a first step of 120 s (compilation): the training minute is still whole
    line = budget.step_done(120.0)
    assert "took 120 s" in line and "training for 1 min from now" in line
    assert budget.left() == 60.0 and not budget.out_of_time()
    now[0] = 250.0
    assert budget.step_done(30.0) is None and budget.left() == 30.0 and not budget.out_of_time()
    now[0] = 280.0
    assert budget.out_of_time() and "--max-minutes" in budget.reason()
    # the wall cap counts from launch, the first step included, and wins when it comes first
    budget = TimeBudget(minutes=10.0, wall_minutes=5.0, launched=0.0, clock=lambda: now[0])
    budget.step_done(280.0)
    assert budget.left() == 20.0 and not budget.out_of_time()
    now[0] = 300.0
    assert budget.out_of_time() and "--max-wall-minutes" in budget.reason()
