"""The static engine (static buffers, device-side acceptance and commit) against the dynamic path and
plain decoding, on the three families (CPU, fp32; CUDA graphs are exercised by the GPU tests)."""

from __future__ import annotations

import pytest
import torch
from cache_utils import max_cache_diff
from models import FAMILIES, VOCAB, left_padded_batch, tiny_model
from test_generator import COMPILE, OracleDrafter, plain

from specla_compile import SpecConfig, SpeculativeGenerator
from specla_compile.runtime.cache_layout import cache_slots, zeroed_copy
from specla_compile.runtime.drafters import ModelDrafter
from specla_compile.runtime.drafting import Draft

CONFIGS = {
    "chain": SpecConfig(mode="chain", depth=5, bucket=8),
    "tree": SpecConfig(mode="tree", depth=3, tree_top_k=2, budget=7, bucket=8),
}


def _states(cache) -> list[torch.Tensor]:
    return [s.get() for s in cache_slots(cache) if s.kind == "state"]


@pytest.mark.parametrize("mode", CONFIGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_static_engine_gives_the_dynamic_paths_tokens_and_cache(family, mode):
    model = tiny_model(family)
    prompts, input_ids, mask = left_padded_batch((4, 1, 6), seed=11)
    refs = [plain(model, p, 14)[0][0, p.numel() :].tolist() for p in prompts]
    eos = refs[0][5]  # row 0 stops inside a draft; other rows may meet it too
    runs = {}
    for engine in ("static", "dynamic"):
        config = SpecConfig(**{**CONFIGS[mode].__dict__, "engine": engine})
        drafter = OracleDrafter([r + [0] * 16 for r in refs], error_rate=0.25, seed=3)
        gen = SpeculativeGenerator(model, drafter, config, compile_options=COMPILE)
        runs[engine] = gen.generate(input_ids, max_new_tokens=14, eos_token_id=eos, attention_mask=mask, pad_token_id=VOCAB + 1)
    static, dynamic = runs["static"], runs["dynamic"]
    assert static.sequences.tolist() == dynamic.sequences.tolist()
    assert static.stats.iterations == dynamic.stats.iterations
    assert max((a - b).abs().max().item() for a, b in zip(_states(static.past_key_values), _states(dynamic.past_key_values))) <= 1e-5
    width = input_ids.shape[1]
    for b, p in enumerate(prompts):  # and both equal each row's own plain decoding with EOS
        expected = plain(model, p, 14, eos)[0][0, p.numel() :].tolist()
        assert static.sequences[b, width : width + len(expected)].tolist() == expected


class _SelfDrafter(ModelDrafter):
    """The target's own top-k drafts (a copy of it drafts), with, where ``with_probs``, a draft distribution at
    every node (most of its mass on the drafted child's token), as a sampling drafter hands them over."""

    def __init__(self, model, with_probs: bool):
        super().__init__(model)
        self.with_probs = with_probs

    def propose(self, request, config):
        draft = super().propose(request, config)
        if not self.with_probs:
            return draft
        logits = torch.randn(*draft.tokens.shape, VOCAB, generator=torch.Generator().manual_seed(len(request.sequences[0])))
        logits.scatter_add_(-1, draft.tokens.roll(-1, 1)[..., None], torch.full((*draft.tokens.shape, 1), 3.0))
        return Draft(draft.tokens, draft.parents, logits.softmax(-1), draft.chain)


@pytest.mark.parametrize(("mode", "with_probs"), [("chain", True), ("tree", False)])
@pytest.mark.parametrize("family", FAMILIES)
def test_sampling_through_the_engine_gives_the_dynamic_paths_tokens(family, mode, with_probs):
    """Sampled passes accept on the device, inside the step (rejection sampling over the static uniforms and
    draft distributions, the cut at EOS and budget): on the same generator the engine emits the dynamic path's
    tokens, whose acceptance the host walks level by level, and leaves the same cache."""
    model = tiny_model(family)
    prompts, input_ids, mask = left_padded_batch((4, 6), seed=21)
    eos = plain(model, prompts[0], 12)[0][0, prompts[0].numel() + 4].item()  # row 0 may stop there
    runs, gens = {}, {}
    for engine in ("static", "dynamic"):
        config = SpecConfig(**{**CONFIGS[mode].__dict__, "engine": engine})
        drafter = _SelfDrafter(tiny_model(family), with_probs)
        gen = gens[engine] = SpeculativeGenerator(model, drafter, config, compile_options=COMPILE)
        runs[engine] = gen.generate(input_ids, max_new_tokens=12, attention_mask=mask, do_sample=True, temperature=0.5,
                                    top_k=3, top_p=0.95, eos_token_id=eos, pad_token_id=VOCAB + 1,
                                    generator=torch.Generator().manual_seed(8))
    static, dynamic = runs["static"], runs["dynamic"]
    assert static.sequences.tolist() == dynamic.sequences.tolist()
    assert static.stats.iterations == dynamic.stats.iterations and static.stats.mean_accepted > 0.2
    assert max((a - b).abs().max().item() for a, b in zip(_states(static.past_key_values), _states(dynamic.past_key_values))) <= 1e-5
    keys = gens["static"].engine(input_ids.device, features=False).buckets
    assert [key[3] for key in keys if key[2] == "accept"] == [(0.5, 3, 0.95, with_probs)]  # one sampling bucket


def test_sampling_settings_keep_at_most_sampling_buckets_and_stay_exact(monkeypatch):
    """Each temperature captures its own sampled graphs; past ``SAMPLING_BUCKETS`` the least recently used bucket
    goes, and a setting used again gets a fresh bucket that samples what the dynamic path samples."""
    from specla_compile.runtime import engine as engine_module

    monkeypatch.setattr(engine_module, "SAMPLING_BUCKETS", 2)
    model = tiny_model("fla")
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(24))
    static = SpeculativeGenerator(model, OracleDrafter([[0] * 40]), CONFIGS["chain"], compile_options=COMPILE)
    dynamic = SpeculativeGenerator(model, OracleDrafter([[0] * 40]), SpecConfig(**{**CONFIGS["chain"].__dict__, "engine": "dynamic"}),
                                   compile_options=COMPILE)
    engine = static.engine(prompt.device, features=False)
    for temperature in (0.5, 0.6, 0.7, 0.5):
        sample = {"do_sample": True, "temperature": temperature, "max_new_tokens": 6}
        ours = static.generate(prompt, generator=torch.Generator().manual_seed(1), **sample)
        theirs = dynamic.generate(prompt, generator=torch.Generator().manual_seed(1), **sample)
        assert ours.sequences.tolist() == theirs.sequences.tolist(), temperature
        sampled = [key[3][0] for key in engine.buckets if key[3] is not None]
        assert len(sampled) <= 2 and temperature in sampled, (temperature, sampled)
    assert sorted(sampled) == [0.5, 0.7]  # (0.5 came back; 0.6 was the least recently used)


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_sampling_loops_on_the_device_and_gives_the_dynamic_paths_tokens(family):
    """Plain sampling through the engine runs the device loop (a sampled 1-node bucket, the uniforms of each
    block written into its ring before the block): on the same generator it emits the dynamic path's tokens,
    which draws them pass by pass, and stops a row at EOS."""
    model = tiny_model(family)
    prompts, input_ids, mask = left_padded_batch((5, 3), seed=23)
    eos = plain(model, prompts[1], 8)[0][0, prompts[1].numel() + 3].item()
    runs, gens = {}, {}
    for engine in ("static", "dynamic"):
        gen = gens[engine] = SpeculativeGenerator(model, OracleDrafter([[0] * 40]), SpecConfig(engine=engine), compile_options=COMPILE)
        runs[engine] = gen.decode(input_ids, max_new_tokens=21, attention_mask=mask, do_sample=True, temperature=0.7,
                                  top_p=0.9, eos_token_id=eos, pad_token_id=VOCAB + 1, generator=torch.Generator().manual_seed(4))
    assert runs["static"].sequences.tolist() == runs["dynamic"].sequences.tolist()
    assert list(gens["static"].engine(input_ids.device, features=False).buckets)[-1] == (1, True, "loop", (0.7, None, 0.9, False))
    assert runs["static"].stats.iterations == runs["dynamic"].stats.iterations


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_decoding_through_the_engine_equals_eager_decoding(family, caplog):
    model = tiny_model(family)
    prompt = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(12))
    expected, expected_cache = plain(model, prompt[0], 9)
    gen = SpeculativeGenerator(model, OracleDrafter([[0] * 16]), CONFIGS["chain"], compile_options=COMPILE)
    out = gen.decode(prompt, max_new_tokens=9)
    assert caplog.text.count("compiling the 1-chain pass (bucket 1") == 1  # the wait is explained, once
    assert out.sequences.tolist() == expected.tolist()
    assert out.stats.iterations == 8 and out.stats.mean_accepted == 0  # one token per pass
    assert max_cache_diff(out.past_key_values, expected_cache) <= 1e-5
    engine = gen.engine(prompt.device, features=False)
    assert list(engine.buckets) == [(1, True, "loop", None)]


@pytest.mark.parametrize("family", ["fla", "qwen3_5"])  # (Qwen3-Next decodes one token through the same routed conv update)
def test_plain_decoding_loops_on_the_device_and_stops_rows_at_eos(family, monkeypatch):
    """Greedy plain decoding reads PLAIN_STEPS passes per synchronisation, with PLAIN_LOOKAHEAD more queued
    behind them; a row that emits EOS inside a block, or as the prefill's token, commits nothing more, so
    tokens and final cache equal the host loop's (dynamic engine) and the stopped rows' own plain decoding."""
    from specla_compile.runtime.engine import PLAIN_LOOKAHEAD, PLAIN_STEPS, StaticEngine

    model = tiny_model(family)
    prompts, input_ids, mask = left_padded_batch((5, 2, 7), seed=21)
    new = PLAIN_STEPS + 6  # two blocks
    refs = [plain(model, p, new)[0][0, p.numel() :].tolist() for p in prompts]
    eos = [refs[1][3], refs[2][0]]  # row 1 stops inside the first block, row 2 at the prefill's token
    blocks, queued = [], []
    read, queue = StaticEngine.read_steps, StaticEngine.queue_steps
    monkeypatch.setattr(StaticEngine, "read_steps", lambda self, steps: blocks.append(steps) or read(self, steps))
    monkeypatch.setattr(StaticEngine, "queue_steps", lambda self, steps, uniforms=None: queued.append(steps) or queue(self, steps, uniforms))
    runs = {}
    for engine in ("static", "dynamic"):
        gen = SpeculativeGenerator(model, OracleDrafter([[0] * 40]), SpecConfig(engine=engine), compile_options=COMPILE)
        runs[engine] = gen.decode(input_ids, max_new_tokens=new, eos_token_id=eos, attention_mask=mask, pad_token_id=VOCAB + 1)
    static, dynamic = runs["static"], runs["dynamic"]
    assert static.sequences.tolist() == dynamic.sequences.tolist()
    assert max((a - b).abs().max().item() for a, b in zip(_states(static.past_key_values), _states(dynamic.past_key_values))) <= 1e-5
    width = input_ids.shape[1]
    for b, p in enumerate(prompts):
        expected, expected_cache = plain(model, p, new, eos)
        expected = expected[0, p.numel() :].tolist()
        assert static.sequences[b, width : width + len(expected)].tolist() == expected
        if b in (1, 2):  # the rows that stopped early: the passes after their EOS left their states alone
            assert max((a[b] - e[0]).abs().max().item() for a, e in zip(_states(static.past_key_values), _states(expected_cache))) <= 1e-5
    still_running = not all(set(eos) & set(r[: new - 1]) for r in refs)
    rest = new - 1 - PLAIN_STEPS  # (the prefill gave token 1)
    assert blocks == ([PLAIN_STEPS, rest] if still_running else [PLAIN_STEPS])
    assert queued[:3] == [PLAIN_STEPS, PLAIN_LOOKAHEAD, rest - PLAIN_LOOKAHEAD]  # (never past the token budget)
    assert sum(queued) == new - 1


def test_plain_decoding_whose_rows_all_end_leaves_the_passes_queued_behind_them_harmless():
    """Every row emits EOS in the first block: the lookahead passes queued behind it run with no active row.
    They change no state and no later call: the cache equals plain decoding's and the next call decodes from
    its own prompt."""
    model = tiny_model("fla")
    prompts, input_ids, mask = left_padded_batch((3, 5), seed=4)
    new = 12
    refs = [plain(model, p, new)[0][0, p.numel() :].tolist() for p in prompts]
    eos = [refs[0][2], refs[1][4]]
    gen = SpeculativeGenerator(model, OracleDrafter([[0] * 40]), SpecConfig(), compile_options=COMPILE)
    out = gen.decode(input_ids, max_new_tokens=new, eos_token_id=eos, attention_mask=mask, pad_token_id=VOCAB + 1)
    width = input_ids.shape[1]
    for b, p in enumerate(prompts):
        expected, expected_cache = plain(model, p, new, eos)
        expected = expected[0, p.numel() :].tolist()
        assert len(expected) < new  # (each row stopped at EOS)
        assert out.sequences[b, width : width + len(expected)].tolist() == expected
        assert max((a[b] - e[0]).abs().max().item() for a, e in zip(_states(out.past_key_values), _states(expected_cache))) <= 1e-5
    again = gen.decode(input_ids[1:], max_new_tokens=new, attention_mask=mask[1:], pad_token_id=VOCAB + 1)
    assert again.sequences[0, width:].tolist() == refs[1]


def test_the_device_loop_refuses_misuse_in_one_line():
    from specla_compile.runtime.engine import LOG_SLOTS, PLAIN_STEPS

    model = tiny_model("fla")
    gen = SpeculativeGenerator(model, OracleDrafter([[0] * 40]), SpecConfig(), compile_options=COMPILE)
    prompt = torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(2))
    cache = gen.decode(prompt, max_new_tokens=3).past_key_values
    engine = gen.engine(prompt.device, features=False)
    with torch.no_grad():  # (as generate() runs the engine)
        engine.start(cache, torch.tensor([6]), None)
        with pytest.raises(RuntimeError, match="begin_decoding"):
            engine.queue_steps(2)
        engine.begin_decoding(torch.tensor([1]))
        with pytest.raises(ValueError, match=r"steps must be in \[1, 16\]"):
            engine.queue_steps(PLAIN_STEPS + 1)
        engine.queue_steps(3)
        engine.queue_steps(2)
        with pytest.raises(ValueError, match="does not end where a queued block ends"):
            engine.read_steps(4)
        engine.begin_decoding(torch.tensor([1]))
        for _ in range(LOG_SLOTS // PLAIN_STEPS):
            engine.queue_steps(PLAIN_STEPS)
        with pytest.raises(RuntimeError, match="read_steps"):
            engine.queue_steps(1)
        tokens, counts = engine.read_steps(PLAIN_STEPS)
    assert tokens.shape == counts.shape == (1, PLAIN_STEPS) and counts.tolist() == [[1] * PLAIN_STEPS]


def test_more_eos_ids_than_the_device_checks_decode_without_the_engine(caplog):
    """Greedy passes stop rows at EOS on the device, which checks EOS_SLOTS ids: with more, generate() says so
    in one line and decodes on the dynamic path, still stopping at every EOS id."""
    from specla_compile.runtime.engine import EOS_SLOTS

    model = tiny_model("fla")
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(6))
    ref = plain(model, prompt[0], 10)[0][0, 5:].tolist()
    eos = [ref[4]] + [t for t in range(VOCAB) if t not in ref][:EOS_SLOTS]  # the one met first, then ids never met
    config = SpecConfig(**{**CONFIGS["chain"].__dict__, "engine": "static"})
    gen = SpeculativeGenerator(model, OracleDrafter([ref + [0] * 16], error_rate=0.25, seed=3), config, compile_options=COMPILE)
    out = gen.generate(prompt, max_new_tokens=10, eos_token_id=eos)
    assert f"{EOS_SLOTS + 1} EOS ids, more than the {EOS_SLOTS}" in caplog.text
    assert out.sequences[0, 5:].tolist() == ref[: ref.index(ref[4]) + 1]


def test_a_bucket_captured_while_a_pass_is_in_flight_keeps_that_pass_s_attention_columns(monkeypatch):
    """With CUDA graphs a new bucket is captured at its first pass; with device drafts a pass may still be in flight
    then, its attention columns not yet counted by the host: the capture must leave them be. (CPU: a capture that
    runs the step, as graphs do at warm-up; the device drafts are flagged as trees, so the second pass opens a new
    bucket; hybrid model.)"""
    import e2e_gpu

    from specla_compile.runtime import engine as engine_module
    from specla_compile.runtime.baseline import autoregressive_generate
    from specla_compile.runtime.drafting import Draft
    from specla_compile.runtime.engine import StaticEngine, accept_pass_

    class Replayed:
        def __init__(self, step):
            self.replay = step

    def capture(step, warmups=2):
        for _ in range(warmups):
            step()
        return Replayed(step), step()

    class TreesOnTheDevice(e2e_gpu.OracleDrafter):
        def propose_after(self, last, config, max_length):
            draft = super().propose_after(last, config, max_length)
            return Draft(draft.tokens, draft.parents, chain=False)

    monkeypatch.setattr(engine_module, "capture", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
    model = tiny_model("qwen3_5")
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    truth = autoregressive_generate(model, prompt, 20)[0][0, 6:].tolist()
    config = SpecConfig(mode="chain", depth=3, bucket=4, engine="static")
    gen = SpeculativeGenerator(model, TreesOnTheDevice([truth], 1.0, 3, vocab=VOCAB, device=True), config, compile_options=COMPILE)
    gen._engines[False] = engine = StaticEngine(gen.compiled, model.config, graphs=True)
    engine.accept_pass = accept_pass_  # (inductor's program is what graphs replay on CUDA; eager here)
    assert gen.generate(prompt, max_new_tokens=20).sequences[0, 6:].tolist() == truth
    assert {key[1] for key in engine.buckets} == {True, False}  # the chain's bucket, then the trees'


def test_room_in_the_attention_cache_counts_each_pass_in_flight_by_its_own_nodes():
    """An early launch must fit behind the passes in flight, whatever their sizes (a 16-node pass then a 9-node one)."""
    from types import SimpleNamespace

    from specla_compile.runtime.engine import StaticEngine, _Launched

    def engine(columns, capacity, in_flight):
        launched = [_Launched(SimpleNamespace(nodes=n), None, None, None) for n in in_flight]
        return SimpleNamespace(kv_valid=torch.ones(1, capacity, dtype=torch.bool), columns=columns, capacity=capacity,
                               launched=launched)

    assert StaticEngine.has_room(engine(100, 125, [16]), 9)
    assert not StaticEngine.has_room(engine(101, 125, [16]), 9)  # (two 9-node passes would fit: 101 + 18 <= 125)
    assert StaticEngine.has_room(engine(100, 125, []), 25)
    assert not StaticEngine.has_room(engine(100, 125, [9, 9]), 8)
    no_attention = engine(10**6, 0, [16])
    no_attention.kv_valid = None
    assert StaticEngine.has_room(no_attention, 32)


def test_chain_and_tree_drafts_of_one_size_use_separate_buckets_and_stay_exact():
    """A tree drafter whose drafts are sometimes chains: chain drafts take the chain bucket (prefix
    acceptance, no gather), trees the tree bucket; switching flushes the other bucket's pending records."""
    model = tiny_model("fla")
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(13))
    expected, expected_cache = plain(model, prompt[0], 24)
    truth = expected[0, 5:].tolist()
    gen = SpeculativeGenerator(model, OracleDrafter([truth + [0] * 16], error_rate=0.3, seed=5), CONFIGS["tree"], compile_options=COMPILE)
    out = gen.generate(prompt, max_new_tokens=24)
    assert out.sequences.tolist() == expected.tolist()
    assert max_cache_diff(out.past_key_values, expected_cache) <= 1e-5
    assert set(gen.engine(prompt.device, features=False).buckets) == {(8, True, "accept", None), (8, False, "accept", None)}


def test_engine_reuses_its_static_buffers_across_calls_and_leaves_callers_caches_alone():
    model = tiny_model("qwen3_5")
    gen = SpeculativeGenerator(model, OracleDrafter([[0] * 40], error_rate=1.0), CONFIGS["chain"], compile_options=COMPILE)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(14))
    first = gen.generate(prompt, max_new_tokens=5)
    engine = gen.engine(prompt.device, features=False)
    static = [s.get().data_ptr() for s in cache_slots(engine.cache)]
    kept = [t.clone() for t in _states(first.past_key_values)]
    second = gen.generate(prompt, max_new_tokens=5)
    assert [s.get().data_ptr() for s in cache_slots(engine.cache)] == static  # same buffers, no re-allocation
    assert all(torch.equal(a, b) for a, b in zip(kept, _states(first.past_key_values)))  # first result untouched
    assert second.sequences.tolist() == first.sequences.tolist()


def test_a_failed_call_leaves_nothing_pending_for_the_next():
    model = tiny_model("fla")
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(15))
    expected, _ = plain(model, prompt[0], 12)
    truth = expected[0, 5:].tolist() + [0] * 16

    class FailsOnSecondDraft(OracleDrafter):
        calls = 0

        def propose(self, request, config):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("drafter failed")
            return super().propose(request, config)

    drafter = FailsOnSecondDraft([truth], error_rate=0.0)
    gen = SpeculativeGenerator(model, drafter, CONFIGS["chain"], compile_options=COMPILE)
    with pytest.raises(RuntimeError, match="drafter failed"):
        gen.generate(prompt, max_new_tokens=12)  # the first pass left accepted records pending
    assert gen.generate(prompt, max_new_tokens=12).sequences.tolist() == expected.tolist()


@pytest.fixture
def compiles(monkeypatch) -> list[int]:
    """One entry per graph the specla backend compiles (a verification twin included) from now on."""
    import specla_compile.backend as backend

    compiled = []

    class Counted(backend.SpeculativeGraph):
        def __init__(self, *args, **kwargs):
            compiled.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(backend, "SpeculativeGraph", Counted)
    return compiled


def test_one_trace_serves_every_bucket_size_with_a_static_twin_per_size(compiles, monkeypatch):
    """The engine marks the node dimension dynamic from the first pass (size 1 included), so Dynamo traces
    the model once for plain decoding's 1-node pass and the drafts' 8-node bucket, and stays exact. The
    backend compiles one twin per size from that graph, with static fake inputs in a mode that has a shape
    env (as Dynamo hands them over: AOTAutograd's and inductor's caches bypass a graph without one).
    (Hybrids compile the 1-node pass apart: see StaticEngine._forward. Twins compiled whole here: a regional
    twin's regions compile from real inputs at their first call, ``test_regions.py``.)"""
    from specla_compile import backend

    inner = backend._inner_compiler
    twin_inputs = []

    def recording(*args):
        compile_inner = inner(*args)

        def compile_and_record(gm, example_inputs):
            if any("gdn_commit_verify_" in str(n.target) for n in gm.graph.nodes):
                twin_inputs.append((list(example_inputs), torch._guards.TracingContext.try_get()))
            return compile_inner(gm, example_inputs)

        return compile_and_record

    monkeypatch.setattr(backend, "_inner_compiler", recording)
    torch._dynamo.reset()
    model = tiny_model("fla")
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(16))
    expected, _ = plain(model, prompt[0], 12)
    truth = expected[0, 5:].tolist() + [0] * 16
    gen = SpeculativeGenerator(model, OracleDrafter([truth], error_rate=0.3, seed=7), CONFIGS["chain"],
                               compile_options={**COMPILE, "regional": False})
    assert gen.decode(prompt, max_new_tokens=12).sequences.tolist() == expected.tolist()
    assert gen.generate(prompt, max_new_tokens=12).sequences.tolist() == expected.tolist()
    assert len(compiles) == 1, f"{len(compiles)} Dynamo graphs for two bucket sizes"
    node_counts = [next(x.shape[1] for x in inputs if isinstance(x, torch.Tensor) and x.dtype == torch.long and x.dim() == 2)
                   for inputs, _ in twin_inputs]  # (input_ids [B, N], the first such input)
    assert node_counts == [1, 8]  # one twin per node count
    for inputs, context in twin_inputs:
        tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
        assert all(isinstance(x, torch._subclasses.FakeTensor) and x.fake_mode.shape_env is not None for x in tensors)
        assert all(type(size) is int for x in tensors for size in x.shape)  # static shapes
        assert context is not None and context.fake_mode is tensors[0].fake_mode


def test_a_growing_cache_keeps_one_dynamic_twin(monkeypatch):
    """The dynamic engine calls the model on its own growing cache (a new attention length every pass):
    its graphs keep one twin compiled with the graph, not one per size (a compile per pass)."""
    from specla_compile import backend

    graphs = []

    class Recorded(backend.SpeculativeGraph):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            graphs.append(self)

    monkeypatch.setattr(backend, "SpeculativeGraph", Recorded)
    torch._dynamo.reset()
    model = tiny_model("qwen3_5")
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(17))
    expected, _ = plain(model, prompt[0], 12)
    config = SpecConfig(**{**CONFIGS["chain"].__dict__, "engine": "dynamic"})
    gen = SpeculativeGenerator(model, OracleDrafter([expected[0, 5:].tolist() + [0] * 16], error_rate=0.3, seed=5), config,
                               compile_options=COMPILE)
    assert gen.generate(prompt, max_new_tokens=12).sequences.tolist() == expected.tolist()
    verifying = [g for g in graphs if g.program is not None]
    assert verifying and all(g.verify_fn is not None and not g.twins for g in verifying)


def test_shared_features_engine_serves_every_route_with_one_compile(compiles):
    """With ``shared_features`` an EAGLE route, a drafter that reads no features and plain decoding run
    through one engine and one Dynamo graph for every node count (as the trained benchmark swaps them), all
    exact; the featureless drafter is handed no features. Without it, the featureless routes compile again."""
    from specla_compile.runtime.drafters import EagleConfig, EagleDrafter, EagleHead
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(15))
    handed = []
    for shared, engines, compiled in ((True, {True}, 1), (False, {True, False}, 2)):  # one Dynamo graph per engine
        torch._dynamo.reset()
        compiles.clear()
        model = tiny_model("fla")
        expected = plain(model, prompt[0], 10)[0].tolist()
        torch.manual_seed(16)
        eagle = EagleDrafter(EagleHead(EagleConfig.for_target(model)), model)
        oracle = OracleDrafter([expected[0][5:] + [0] * 16], error_rate=0.3, seed=6)
        real_commit = oracle.commit
        oracle.commit = lambda rows, tokens, features=None, real=real_commit: handed.append(features) or real(rows, tokens, features)
        gen = SpeculativeGenerator(model, eagle, CONFIGS["chain"], compile_options=COMPILE, shared_features=shared)
        assert gen.generate(prompt, max_new_tokens=10).sequences.tolist() == expected
        gen.drafter = oracle
        assert gen.generate(prompt, max_new_tokens=10).sequences.tolist() == expected
        assert gen.decode(prompt, max_new_tokens=10).sequences.tolist() == expected
        assert set(gen._engines) == engines and len(compiles) == compiled, (shared, len(compiles))
        if shared:  # one engine: the EAGLE route's bucket (its pass, its CUDA graph) served the oracle too
            assert list(gen._engines[True].buckets) == [(8, True, "accept", None), (1, True, "loop", None)]
    assert handed and all(f is None for f in handed)


def test_a_mixture_of_experts_model_gets_experts_a_cuda_graph_can_hold(caplog):
    """Qwen3-Next's fp32 experts (grouped_mm, whose fallback reads offsets on the host) become batched_mm,
    with the same logits and a warning; bf16 grouped_mm and models without experts are left alone."""
    from specla_compile.runtime.graph_capture import capturable_experts

    model = tiny_model("qwen3_next")
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    assert model.config._experts_implementation == "grouped_mm"
    with torch.no_grad():
        before = model(ids).logits
        with caplog.at_level("WARNING", logger="specla_compile"):
            capturable_experts(model)
        after = model(ids).logits
    assert model.config._experts_implementation == "batched_mm" and "batched_mm" in caplog.text
    assert (after - before).abs().max() <= 1e-5
    bf16 = tiny_model("qwen3_next").to(torch.bfloat16)
    capturable_experts(bf16)
    assert bf16.config._experts_implementation == "grouped_mm"
    dense = tiny_model("qwen3_5")
    implementation = dense.config._experts_implementation
    capturable_experts(dense)
    assert dense.config._experts_implementation == implementation


class _FeatureRecorder(OracleDrafter):
    """An oracle drafter that asks for the target's features and keeps those of the prompts."""

    needs_features = True

    def begin(self, sequences, features=None):
        super().begin(sequences, features)
        self.prompt_features = features


@pytest.mark.parametrize(("lengths", "chunks", "passes"), [((20, 3, 33), [], 3), ((100, 45), [32], 6), ((97,), [64, 32], 3)])
def test_engine_prefill_gives_the_eager_prefills_tokens_cache_and_features(lengths, chunks, passes):
    """Prompts of ragged lengths run through the engine from a zeroed cache: the tokens every row has as chunks
    through the model's own forward (none while a row has at most 32 tokens; 45 and 100 tokens: one of 32; 97
    tokens: 64 and 32), the rest as 16-token chain passes (rows ending in different passes): the same tokens and
    final cache as each row's eager plain decoding, and the drafter receives the features the eager model
    computes."""
    from specla_compile.runtime.engine import PREFILL_NODES

    model = tiny_model("fla")
    prompts, input_ids, mask = left_padded_batch(lengths, seed=31)
    refs = [plain(model, p, 10)[0][0, p.numel() :].tolist() for p in prompts]
    drafter = _FeatureRecorder([r + [0] * 16 for r in refs], error_rate=0.25, seed=4)
    gen = SpeculativeGenerator(model, drafter, SpecConfig(**{**CONFIGS["chain"].__dict__, "prefill": "engine"}),
                               compile_options=COMPILE)
    out = gen.generate(input_ids, max_new_tokens=10, attention_mask=mask, pad_token_id=VOCAB + 1)
    assert out.stats.prefill_passes == passes
    engine = gen.engine(input_ids.device, features=True)
    assert (PREFILL_NODES, True, "host", None) in engine.buckets and sorted(engine.chunks) == sorted(chunks)
    width = input_ids.shape[1]
    for b, p in enumerate(prompts):
        assert out.sequences[b, width:].tolist() == refs[b]
        eager = model(input_ids=p[None], output_hidden_states=True).hidden_states[-1][0]
        assert drafter.prompt_features[b].shape == eager.shape
        assert (drafter.prompt_features[b] - eager).abs().max().item() <= 1e-5
    decoded = gen.decode(input_ids, max_new_tokens=10, attention_mask=mask, pad_token_id=VOCAB + 1)
    assert decoded.sequences.tolist() == out.sequences.tolist()
    for b, p in enumerate(prompts):  # the cache a plain decode leaves: every prompt and new token but the last
        _, expected_cache = plain(model, p, 10)
        assert max((a[b] - e[0]).abs().max().item() for a, e in zip(_states(decoded.past_key_values), _states(expected_cache))) <= 1e-5


def test_zeroed_copy_has_the_layout_and_zero_states_and_shares_nothing_with_its_template():
    """The cache an engine prefill starts from: a copy of a used cache's layout (not a deepcopy) with zero
    states; writing into either leaves the other alone. Hybrids are refused."""
    model = tiny_model("fla")
    with torch.no_grad():
        template = model(input_ids=torch.randint(0, VOCAB, (2, 5)), use_cache=True).past_key_values
    before = [t.clone() for t in _states(template)]
    fresh = zeroed_copy(template)
    assert [(t.shape, t.dtype) for t in _states(fresh)] == [(t.shape, t.dtype) for t in before]
    assert all(not t.any() for t in _states(fresh)) and all(t.abs().sum() > 0 for t in before)
    for mine, theirs in zip(fresh.layers, template.layers):  # no container shared (an update to one is not the other's)
        assert not any(v is vars(theirs)[k] for k, v in vars(mine).items() if isinstance(v, (dict, list)))
    pointers = {t.data_ptr() for t in _states(template)}
    assert not pointers & {t.data_ptr() for t in _states(fresh)}
    for slot in cache_slots(fresh):  # new tensors in the copy's containers: the template keeps its own
        slot.set(torch.ones_like(slot.get()))
    assert all(torch.equal(a, b) for a, b in zip(_states(template), before))
    assert all(torch.equal(t, torch.ones_like(t)) for t in _states(fresh))
    with torch.no_grad():
        hybrid = tiny_model("qwen3_5")(input_ids=torch.randint(0, VOCAB, (1, 3)), use_cache=True).past_key_values
    with pytest.raises(NotImplementedError, match="without attention layers"):
        zeroed_copy(hybrid)


def test_engine_prefill_leaves_hybrids_and_continued_caches_to_the_eager_model(monkeypatch):
    """A hybrid (attention layers) and a call that continues a cache prefill eagerly, whatever the config."""
    from specla_compile.runtime.engine import StaticEngine

    prefills = []
    real = StaticEngine.prefill
    monkeypatch.setattr(StaticEngine, "prefill", lambda self, rows: prefills.append(len(rows)) or real(self, rows))
    config = SpecConfig(**{**CONFIGS["chain"].__dict__, "prefill": "engine"})
    hybrid = tiny_model("qwen3_5")
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(32))
    gen = SpeculativeGenerator(hybrid, OracleDrafter([[0] * 40], error_rate=1.0), config, compile_options=COMPILE)
    assert gen.decode(prompt, max_new_tokens=5).sequences.tolist() == plain(hybrid, prompt[0], 5)[0].tolist()
    assert prefills == [] and all(key[2] != "host" for key in gen.engine(prompt.device, features=False).buckets)

    model = tiny_model("fla")
    expected, _ = plain(model, prompt[0], 8)
    gen = SpeculativeGenerator(model, OracleDrafter([[0] * 40], error_rate=1.0), config, compile_options=COMPILE)
    first = gen.decode(prompt, max_new_tokens=4)
    more = gen.decode(first.sequences[:, -1:], max_new_tokens=4, past_key_values=first.past_key_values)
    assert prefills == [1]  # the first call's, not the continuation's
    assert torch.cat([first.sequences, more.sequences[:, 1:]], 1).tolist() == expected.tolist()


@pytest.mark.parametrize("shape", ["loop", "chain", "tree", "tree_with_ancestors", "tree_sampled", "chain_sampled",
                                   "tree_sampled_deterministic"])
def test_the_compiled_acceptance_writes_what_the_eager_one_writes(shape):
    """Graphed engines run a pass's acceptance and bookkeeping as one inductor program: on random drafts that
    match the target in part, with a row not active, an EOS, a budget and the log's ring wrapping, it returns
    and writes what the eager ops do, and cuts each row where the host's bookkeeping would (hybrids pass the
    ancestor mask they built; sampled passes accept by rejection sampling on static uniforms and draft
    distributions, as the host's walk does on the same ones)."""
    from specla_compile.runtime.acceptance import draw_uniforms, greedy_accept, sample_accept, warp_probs
    from specla_compile.runtime.engine import LOG_SLOTS, Sampling, accept_pass_
    from specla_compile.tree import PAD, ancestor_mask_device

    gen = torch.Generator().manual_seed(17)
    batch, n, vocab = 4, 1 if shape == "loop" else 8, 40
    logits = torch.randn(batch, n, vocab, generator=gen)
    best = logits.argmax(-1)
    parents = torch.arange(-1, n - 1).repeat(batch, 1)
    if shape.startswith("tree"):
        for j in range(2, n):
            parents[:, j] = torch.randint(0, j, (batch,), generator=gen)
        parents[2, 6:] = PAD  # a smaller tree in its bucket
    tokens = torch.randint(0, vocab, (batch, n), generator=gen)
    take = torch.rand(batch, n, generator=gen) < 0.8
    tokens = torch.where(take & (parents >= 0), best.gather(1, parents.clamp(min=0)), tokens)
    draft = torch.stack([tokens, parents])
    sampling = None
    if "sampled" in shape:  # (draft distributions that put most mass on the drafted tokens, or none: deterministic)
        draft_probs = (torch.randn(batch, n, vocab, generator=gen) + 4 * torch.nn.functional.one_hot(tokens.roll(-1, 1), vocab)).softmax(-1)
        deterministic = shape.endswith("deterministic")  # (then a peaked target, so that some drafts are accepted)
        sampling = Sampling((0.25 if deterministic else 0.7, 5, 0.95), draw_uniforms(batch, n, gen), None if deterministic else draft_probs)
    # what each row emits, by the host's rules: the accepted drafts, then the target's token
    if sampling is None:
        host = greedy_accept(tokens, parents, logits)
    else:
        host = sample_accept(tokens, parents, warp_probs(logits, *sampling.warp), sampling.draft_probs, uniforms=sampling.uniforms)
    emitted = [[tokens[b, j].item() for j in host.path[b, 1 : host.num_accepted[b]]] + [host.next_token[b].item()] for b in range(batch)]
    eos = torch.full((8,), -1)
    eos[0] = emitted[0][-1] if n == 1 else emitted[0][0]  # row 0 stops at EOS (inside its draft, unless a loop)
    remaining = torch.tensor([50, 50, 2, 50])  # row 2 at its budget (when it accepted more), row 1 not active
    active = torch.tensor([True, False, True, True])
    committed = torch.randint(0, 50, (batch,), generator=gen)
    summary = torch.zeros(batch, n + 4, dtype=torch.long)
    loop = None
    if shape == "loop":
        loop = (torch.randint(0, vocab, (2, batch, LOG_SLOTS), generator=gen), torch.tensor([LOG_SLOTS - 1]))

    def run(fn):
        state = [t.clone() for t in (draft, active, committed, remaining, summary)]
        ring = None if loop is None else tuple(t.clone() for t in loop)
        ancestors = ancestor_mask_device(parents) if shape == "tree_with_ancestors" else None
        path, counts = fn(state[0], logits, ancestors, state[1], state[2], state[3], eos, state[4], ring, sampling)
        return [path, counts, *state, *(ring or ())]

    eager = run(accept_pass_)
    compiled = run(torch.compile(accept_pass_, backend="inductor", dynamic=False, fullgraph=True))
    assert len(eager) == len(compiled) and all(torch.equal(a, b) for a, b in zip(eager, compiled))
    path, counts, _, active_after, committed_after, remaining_after, written = eager[:7]
    for b in range(batch):
        row = emitted[b][: int(remaining[b])]
        row = row[: row.index(eos[0].item()) + 1] if eos[0].item() in row else row
        kept = len(row) if active[b] else 0
        assert counts[b] == kept and written[b, n] == kept and committed_after[b] == committed[b] + kept, b
        assert remaining_after[b] == remaining[b] - kept, b
        ends = bool(row) and (row[-1] == eos[0].item() or len(row) == remaining[b])
        assert bool(active_after[b]) == bool(written[b, n + 2]) == (bool(active[b]) and not ends), b
        if kept:
            assert written[b, n + 1] == row[-1], b  # the next pending token: the last one kept
        assert written[b, n + 3] == host.num_accepted[b], b  # what was accepted before the cut (the stats')
    assert counts[1] == 0 and not active_after[0]  # row 1 was not active; row 0 emitted EOS and stopped
    if n > 1 and sampling is None:  # row 0 cut inside its draft at EOS; row 2 ends at its budget
        assert counts[0] == 1 < host.num_accepted[0] and counts[2] == 2 and not active_after[2]
    if shape == "loop":
        assert eager[-1].item() == 0  # the ring wrapped
