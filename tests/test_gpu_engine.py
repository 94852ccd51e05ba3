"""The static engine with CUDA graphs on a GPU: captured passes give the tokens and the cache of the
same engine run eagerly and of plain eager decoding (small fp32 models of the three families, chains
and trees, a batch with EOS). Skipped without CUDA."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from models import FAMILIES, VOCAB, left_padded_batch, tiny_model
from test_generator import COMPILE, OracleDrafter, plain

from specla_compile import SpecConfig, SpeculativeGenerator
from specla_compile.kernels import pdl, triton_verify
from specla_compile.runtime.cache_layout import cache_slots
from specla_compile.runtime.drafters import ModelDrafter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("family", FAMILIES)
def test_graphed_passes_equal_eager_passes_and_plain_decoding(family, mode, monkeypatch):
    """(On Hopper the captured passes' recurrent launches commit before their PDL wait: the engine names its cache's
    states, and the ops receive those, not copies.)"""
    early, pending_args = [], triton_verify._pending_args

    def recorded(*args):
        out = pending_args(*args)
        early.append(out[3])
        return out

    monkeypatch.setattr(triton_verify, "_pending_args", recorded)
    model = tiny_model(family).cuda()
    prompts = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(21)).cuda()
    refs = [plain(model, p, 20)[0][0, 6:].tolist() for p in prompts]
    eos = refs[1][9]
    base = SpecConfig(mode=mode, depth=4, tree_top_k=2, budget=7, bucket=8)
    outs = {}
    for graphs in (True, False):
        config = SpecConfig(**{**base.__dict__, "cuda_graphs": graphs})
        gen = SpeculativeGenerator(model, OracleDrafter([r + [0] * 16 for r in refs], error_rate=0.25, seed=2), config)
        outs[graphs] = gen.generate(prompts, max_new_tokens=20, eos_token_id=eos, pad_token_id=VOCAB + 1)
        if graphs:
            assert all(bucket.graph is not None for bucket in gen.engine(prompts.device, False).buckets.values())
            plain_out = gen.decode(prompts, max_new_tokens=20, eos_token_id=eos, pad_token_id=VOCAB + 1)
    assert outs[True].sequences.tolist() == outs[False].sequences.tolist() == plain_out.sequences.tolist()
    assert any(early) == pdl.enabled(prompts.device)
    stats = outs[True].stats  # phase times from CUDA events: each positive, together within the call's time
    phases = [stats.prefill_seconds, stats.draft_seconds, stats.verify_seconds, stats.commit_seconds]
    assert all(t > 0 for t in phases) and sum(phases) <= stats.seconds
    for b in range(2):
        expected = plain(model, prompts[b], 20, eos)[0][0, 6:].tolist()
        assert outs[True].sequences[b, 6 : 6 + len(expected)].tolist() == expected
    ours = [s.get() for s in cache_slots(outs[True].past_key_values) if s.kind == "state"]
    theirs = [s.get() for s in cache_slots(outs[False].past_key_values) if s.kind == "state"]
    assert max((a - b).abs().max().item() for a, b in zip(ours, theirs)) <= 1e-5


@pytest.mark.parametrize("family", ["fla", "qwen3_5"])
def test_graphed_sampling_equals_uncaptured_sampling_and_the_dynamic_path(family):
    """Sampled passes accept inside the captured step (rejection sampling on the uniforms drawn before each pass):
    on the same CUDA generator, the tokens of the same engine run uncaptured and of the dynamic path, whose host
    walks the acceptance level by level; the drafts are the target's own (a copy of it drafts). Plain sampling's
    device loop, graphed, gives its uncaptured tokens (the dynamic path draws a block's uniforms in other calls,
    which on CUDA give other numbers)."""
    model = tiny_model(family).cuda()
    prompts = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(22)).cuda()
    base = SpecConfig(mode="tree", depth=4, tree_top_k=2, budget=7, bucket=8)
    outs, plains = {}, {}
    for name, change in {"graphed": {}, "uncaptured": {"cuda_graphs": False}, "dynamic": {"engine": "dynamic"}}.items():
        gen = SpeculativeGenerator(model, ModelDrafter(tiny_model(family).cuda()), SpecConfig(**{**base.__dict__, **change}))
        outs[name] = gen.generate(prompts, max_new_tokens=20, do_sample=True, temperature=0.5, top_k=3,
                                  generator=torch.Generator("cuda").manual_seed(3))
        plains[name] = gen.decode(prompts, max_new_tokens=20, do_sample=True, temperature=0.5, top_k=3,
                                  generator=torch.Generator("cuda").manual_seed(4))  # (the device loop, sampled)
        if name == "graphed":
            assert all(bucket.graph is not None for bucket in gen.engine(prompts.device, False).buckets.values())
    assert outs["graphed"].sequences.tolist() == outs["uncaptured"].sequences.tolist() == outs["dynamic"].sequences.tolist()
    assert plains["graphed"].sequences.tolist() == plains["uncaptured"].sequences.tolist()
    assert outs["graphed"].stats.mean_accepted > 0.2


def test_sampled_passes_compile_and_sample_over_a_32000_token_vocabulary():
    """At a real vocabulary the sampled acceptance's cumulative sums are long scans over few rows, which inductor on
    CUDA split into a kernel whose codegen failed in torch 2.11 (a 16-node pass of the 1.3B shape, H200): a 16-node
    sampled tree and chain over 32,000 tokens compile, capture and give the dynamic path's tokens (top-p on, so
    both cumulative sums run)."""
    model = tiny_model("fla", layers=2, vocab=32000).cuda()
    prompts = torch.randint(0, 32000, (1, 6), generator=torch.Generator().manual_seed(24)).cuda()
    for config in (SpecConfig(mode="tree", depth=4, tree_top_k=4, budget=15, bucket=16), SpecConfig(mode="chain", depth=15, bucket=16)):
        outs = {}
        for engine in ("static", "dynamic"):
            gen = SpeculativeGenerator(model, ModelDrafter(tiny_model("fla", layers=2, vocab=32000).cuda()),
                                       SpecConfig(**{**config.__dict__, "engine": engine}))
            outs[engine] = gen.generate(prompts, max_new_tokens=12, do_sample=True, temperature=0.8, top_p=0.9,
                                        generator=torch.Generator("cuda").manual_seed(5)).sequences.tolist()
        assert outs["static"] == outs["dynamic"], config.mode


def test_graphed_prefill_chunks_give_plain_eager_decoding():
    """Prompts of 300 and 170 tokens through the engine's prefill: 128 and 32 tokens of both as replays of the
    model's own forward captured as CUDA graphs, the rest as chain passes; the tokens of each row's plain eager
    decoding, twice in a row (the second call replays the captured chunks), speculative and plain alike. (The
    passes' inner compiler is aot_eager: the chunks are the subject, and inductor's compile took this test past a
    90 s timeout on a fresh machine.)"""
    model = tiny_model("fla").cuda()
    prompts, input_ids, mask = left_padded_batch((300, 170), seed=12)
    refs = [plain(model, p.cuda(), 12)[0][0, p.numel() :].tolist() for p in prompts]
    gen = SpeculativeGenerator(model, OracleDrafter([r + [0] * 16 for r in refs], error_rate=0.25, seed=3),
                               SpecConfig(mode="chain", depth=4, prefill="engine"), compile_options=COMPILE)
    for _ in range(2):
        for call in (gen.generate, gen.decode):
            out = call(input_ids.cuda(), max_new_tokens=12, attention_mask=mask.cuda(), pad_token_id=VOCAB + 1)
            assert [row[-12:] for row in out.sequences.tolist()] == refs
    chunks = gen.engine(torch.device("cuda"), False).chunks
    assert sorted(chunks) == [32, 128] and all(chunk.graph is not None for chunk in chunks.values())


@pytest.mark.parametrize(
    "config", [SpecConfig(mode="chain", depth=4), SpecConfig(mode="tree", depth=3, tree_top_k=3, budget=8, tau=3.0)]
)
def test_graphed_eagle_propose_equals_the_uncaptured_one(config):
    """An EAGLE propose replayed from its CUDA graph drafts what the same fixed shapes draft uncaptured
    (``cuda_graphs=False``), over propose/commit rounds that accept different lengths, and two rows drafted
    alone (other keys); then on new prompts, whose catch-up at ``begin`` replays a captured graph where the
    last propose replayed graphs, and captures nothing where it was told not to."""
    from tiny_lm import features_of, tiny_lm

    from specla_compile.runtime.drafters import EagleConfig, EagleDrafter, EagleHead
    from specla_compile.runtime.drafting import DraftRequest

    target = tiny_lm(vocab=VOCAB, seed=2).cuda()
    torch.manual_seed(3)
    head = EagleHead(EagleConfig.for_target(target, intermediate_size=48)).cuda()
    graphed, uncaptured = EagleDrafter(head, target), EagleDrafter(head, target, static_shapes=True)
    off = dataclasses.replace(config, cuda_graphs=False)
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).cuda() for n in (12, 7)]
    for d in (graphed, uncaptured):
        d.begin(seqs, [features_of(target, s) for s in seqs])
    for round in range(6):
        rows = [0, 1] if round < 4 else [round - 4]
        for b in rows:  # the pending tokens
            seqs[b] = torch.cat([seqs[b], torch.randint(0, VOCAB, (1,), generator=gen).cuda()])
        request = DraftRequest(rows, [seqs[b] for b in rows])
        draft, expected = graphed.propose(request, config), uncaptured.propose(request, off)
        assert torch.equal(draft.tokens, expected.tokens) and torch.equal(draft.parents, expected.parents)
        kept = round % (config.depth + 1)
        for b, i in zip(rows, range(len(rows))):
            new = torch.cat([seqs[b], draft.tokens[i, 1 : 1 + kept] if config.mode == "chain" else draft.tokens[i, 1:2]])
            for d in (graphed, uncaptured):
                d.commit([b], [new[len(seqs[b]) - 1 :]], [features_of(target, new)[len(seqs[b]) - 1 :]])
            seqs[b] = new
    assert graphed.captured_graphs and not graphed.graph_error, "the proposes were replayed from captured graphs"
    assert uncaptured.captured_graphs == 0
    for lengths in ((70, 40), (72, 45)):  # (one 128-wide catch-up graph: captured, then replayed on new prompts)
        seqs = [torch.randint(0, VOCAB, (n,), generator=gen).cuda() for n in lengths]
        for d in (graphed, uncaptured):
            d.begin([s[:-1] for s in seqs], [features_of(target, s[:-1]) for s in seqs])
        assert ("catch_up", (0, 1), 128) in graphed._graphs and graphed.catch_up_graphs == 1 and not graphed.catch_up_error
        assert uncaptured.captured_graphs == 0 and uncaptured.catch_up_graphs == 0
        torch.testing.assert_close(graphed._last_hidden, uncaptured._last_hidden)
        request = DraftRequest([0, 1], seqs)
        draft, expected = graphed.propose(request, config), uncaptured.propose(request, off)
        assert torch.equal(draft.tokens, expected.tokens) and torch.equal(draft.parents, expected.parents)


def test_a_half_precision_eagle_head_drafts_with_int8_weights_by_default(caplog):
    """On CUDA a bf16 EAGLE drafter streams its head's weights as int8 unless told not to (``quantize="none"``),
    an fp32 one keeps its own; generation with the int8 drafter gives plain decoding's tokens."""
    from specla_compile.runtime.drafters import EagleConfig, EagleDrafter, EagleHead

    model = tiny_model("fla").cuda().to(torch.bfloat16)
    torch.manual_seed(8)
    head = EagleHead(EagleConfig.for_target(model)).cuda().to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="specla_compile"):
        drafter = EagleDrafter(head, model)
    assert drafter.quantize == "int8" and drafter._lm_weight.dtype == torch.int8
    assert "drafting with int8 copies" in caplog.text
    assert EagleDrafter(head, model, quantize="none")._int8 is None
    fp32_model = tiny_model("fla").cuda()
    assert EagleDrafter(EagleHead(EagleConfig.for_target(fp32_model)).cuda(), fp32_model).quantize == "none"
    prompts = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(6)).cuda()
    gen = SpeculativeGenerator(model, drafter, SpecConfig(mode="tree", depth=4, tree_top_k=2, budget=7, bucket=8))
    out = gen.generate(prompts, max_new_tokens=16).sequences.tolist()
    assert drafter.captured_graphs and not drafter.graph_error
    assert out == gen.decode(prompts, max_new_tokens=16).sequences.tolist()


def test_bf16_experts_keep_grouped_mm_inside_the_cuda_graphs():
    """Qwen3-Next in bf16 keeps torch's grouped GEMM (its offsets stay on the device): the passes are
    captured and give the tokens of the same engine run uncaptured."""
    model = tiny_model("qwen3_next").cuda().to(torch.bfloat16)
    prompts = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(22)).cuda()
    refs = [plain(model, p, 16)[0][0, 6:].tolist() for p in prompts]
    outs = {}
    for graphs in (True, False):
        gen = SpeculativeGenerator(model, OracleDrafter([r + [0] * 16 for r in refs], error_rate=0.25, seed=3),
                                   SpecConfig(mode="chain", depth=4, cuda_graphs=graphs))
        outs[graphs] = gen.generate(prompts, max_new_tokens=16).sequences
        if graphs:
            assert all(bucket.graph is not None for bucket in gen.engine(prompts.device, False).buckets.values())
    assert model.config._experts_implementation == "grouped_mm"
    assert outs[True].tolist() == outs[False].tolist()


def test_graphed_pipelined_eagle_drafting_equals_the_host_loop_and_plain_decoding():
    """With CUDA graphs, an EAGLE drafter's pipelined drafts (each queued behind the pass it drafts from,
    the host reading that pass meanwhile) give the host loop's tokens and plain decoding's, on a ragged
    batch with a row stopping at EOS; the proposes replay captured graphs."""
    from specla_compile.runtime.drafters import EagleConfig, EagleDrafter, EagleHead

    model = tiny_model("fla").cuda()
    torch.manual_seed(7)
    head = EagleHead(EagleConfig.for_target(model)).cuda()
    prompts = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5)).cuda()
    eos = plain(model, prompts[1], 16)[0][0, 6:].tolist()[7]
    outs = {}
    for pipelined in (None, False):
        drafter = EagleDrafter(head, model)
        config = SpecConfig(mode="tree", depth=4, tree_top_k=2, budget=7, bucket=8, pipelined=pipelined)
        gen = SpeculativeGenerator(model, drafter, config)
        outs[pipelined] = gen.generate(prompts, max_new_tokens=16, eos_token_id=eos, pad_token_id=VOCAB + 1).sequences.tolist()
        assert drafter.captured_graphs and not drafter.graph_error
        assert (drafter._device_cached is not None) == (pipelined is None)
    plain_out = gen.decode(prompts, max_new_tokens=16, eos_token_id=eos, pad_token_id=VOCAB + 1).sequences.tolist()
    assert outs[None] == outs[False] == plain_out


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_graphed_decoding_through_the_folds_not_yet_timed_equals_plain_eager_decoding(mode, caplog):
    """The backend's ``fold_convs`` and ``fold_gates_drafted`` (``fold_swiglu`` too, which folds bf16 MLPs only) on a
    small fp32 fla model in CUDA graphs, two rows, one stopping at EOS: the one-node twin runs each layer's convs,
    gates and recurrence in one launch, the 8-node and 16-node twins their gates in the parallel route's; drafted and
    plain decoding give plain eager decoding's tokens."""
    model = tiny_model("fla").cuda()
    prompts = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(23)).cuda()
    refs = [plain(model, p, 20)[0][0, 6:].tolist() for p in prompts]
    eos = refs[1][9]
    config = SpecConfig(mode=mode, depth=7 if mode == "chain" else 4, tree_top_k=2, budget=15, bucket=8 if mode == "chain" else 16)
    options = {**COMPILE, "inner": "inductor", "fold_convs": True, "fold_gates_drafted": True, "fold_swiglu": True}
    gen = SpeculativeGenerator(model, OracleDrafter([r + [0] * 16 for r in refs], error_rate=0.25, seed=3), config,
                               compile_options=options)
    with caplog.at_level(logging.INFO, logger="specla_compile"):
        drafted = gen.generate(prompts, max_new_tokens=20, eos_token_id=eos, pad_token_id=VOCAB + 1)
        decoded = gen.decode(prompts, max_new_tokens=20, eos_token_id=eos, pad_token_id=VOCAB + 1)
    assert "q/k/v convs folded into their recurrence" in caplog.text
    assert "gates folded into their parallel verify" in caplog.text
    for b in range(2):
        expected = plain(model, prompts[b], 20, eos)[0][0, 6:].tolist()
        assert drafted.sequences[b, 6 : 6 + len(expected)].tolist() == expected
        assert decoded.sequences[b, 6 : 6 + len(expected)].tolist() == expected


@pytest.mark.skipif(__import__("specla_compile.kernels.cuda_gemv").kernels.cuda_gemv.nvcc() is None, reason="needs nvcc")
def test_plain_decoding_through_cuda_gemvs_gives_the_defaults_tokens(caplog):
    """The backend's ``cuda_gemvs`` at the GDN-1.3B shape (2 layers, bf16, the peaked output of ``e2e_gpu.build``):
    each layer's packed q/k/v/gates, its o_proj with the gated norm and its down projection with the MLP's product
    (the one-token twin's folds) and gate/up, and the LM head, run as the CUDA C GEMV, every one but the first
    q/k/v/gates with the residual add and RMS norm before it in its prologue, and graphed plain decoding gives the
    defaults' tokens."""
    from e2e_gpu import build

    from specla_compile.runtime.drafters import NgramDrafter

    prompts = torch.randint(0, 32000, (1, 8), generator=torch.Generator().manual_seed(25)).cuda()
    outs = {}
    for name, options in {"defaults": {}, "cuda_gemvs": {"cuda_gemvs": True}}.items():
        gen = SpeculativeGenerator(build("fla", torch.bfloat16, layers=2), NgramDrafter(), SpecConfig(mode="chain", depth=4),
                                   compile_options=options)  # (a model each: one compiled per option set)
        with caplog.at_level(logging.INFO, logger="specla_compile"):
            outs[name] = gen.decode(prompts, max_new_tokens=32).sequences.tolist()
    assert "4 residual adds and norms folded into the CUDA C GEMV" in caplog.text  # (2 MLPs, layer 2, the LM head)
    assert "5 GEMMs routed to the CUDA C GEMV" in caplog.text  # (the first q/k/v/gates, 2 o_proj, 2 down)
    assert outs["cuda_gemvs"] == outs["defaults"]


@pytest.mark.parametrize("option, kernel_name", [("fold_gated_norms_drafted", "gated_norm_linear"),
                                                 ("fold_swiglu_drafted", "swiglu_linear")])
@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_drafted_decoding_through_a_drafted_fold_gives_the_defaults_tokens(mode, option, kernel_name, monkeypatch):
    """The backend's few-row folds at the GDN-1.3B shape (2 layers, bf16, the peaked output of ``e2e_gpu.build``):
    with ``fold_gated_norms_drafted`` the draft bucket's twin (and the engine's 16-node prefill pass) runs each layer's
    gated output norm and o_proj as one launch of the few-row kernel, with ``fold_swiglu_drafted`` its MLP product and
    down projection (their launches, before and while the graphs are captured, counted by their rows), and graphed
    drafted decoding gives the tokens of graphed plain decoding with the defaults."""
    from e2e_gpu import build

    from specla_compile.kernels import triton_linear
    from specla_compile.runtime.engine import PREFILL_NODES

    prompts = torch.randint(0, 32000, (1, 8), generator=torch.Generator().manual_seed(26)).cuda()
    expected = SpeculativeGenerator(build("fla", torch.bfloat16, layers=2), OracleDrafter([[0] * 40]),
                                    SpecConfig(mode="chain", depth=4)).decode(prompts, max_new_tokens=32).sequences
    config = SpecConfig(mode=mode, depth=7 if mode == "chain" else 4, tree_top_k=2, budget=15,
                        bucket=8 if mode == "chain" else 16)
    drafter = OracleDrafter([expected[0, 8:].tolist() + [0] * 16], error_rate=0.25, seed=5)
    gen = SpeculativeGenerator(build("fla", torch.bfloat16, layers=2), drafter, config, compile_options={option: True})
    rows, kernel = [], getattr(triton_linear, kernel_name)
    monkeypatch.setattr(triton_linear, kernel_name, lambda x, *a, **kw: rows.append(x.shape[0]) or kernel(x, *a, **kw))
    drafted = gen.generate(prompts, max_new_tokens=32).sequences
    assert config.bucket in rows and set(rows) <= {config.bucket, PREFILL_NODES}  # (the prompt: one 16-node pass)
    assert drafted.tolist() == expected.tolist()
