"""The ``specla`` backend on tiny random models of the three families (CPU, fp32)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
import torch.fx as fx
from cache_utils import cache_tensors, max_cache_diff
from models import FAMILIES, VOCAB, left_padded_batch, tiny_model

from specla_compile.lowering.fuse_projections import fuse_projections, pack_projections
from specla_compile.lowering.graph_analysis import (
    INPLACE_WRITE_METHODS,
    RECURRENCE,
    SHORT_CONV,
    depends_on,
    find_gdn_layers,
    getitem_users,
    is_call,
    view_chain,
)
from specla_compile.lowering.rewrite import rewrite_for_verify
from specla_compile.lowering.session import VerifySession
from specla_compile.runtime.topology import PAD, ancestor_mask, depth, path_to

BATCH, PROMPT, NODES = 2, 5, 8
TREES = ([-1, 0, 0, 1, 1, 2, 5, PAD], [-1, 0, 1, 2, 0, 4, 0, 6], [-1, 0, 0, 0, 1, 2, 3, 4])


def gdn_layer_count(model) -> int:
    types = getattr(model.config, "layer_types", None)
    if types is None or getattr(model.config, "model_type", "") == "gated_deltanet":
        return model.config.num_hidden_layers
    return sum(t == "linear_attention" for t in types)


def is_hybrid(family: str) -> bool:
    return family != "fla"


def draft_call_inputs(parents: torch.Tensor, past: int, family: str):
    """Tree attention mask over ``past`` committed positions (hybrid families only: a model without
    attention layers refuses one), and tree position ids."""
    batch, n = parents.shape
    committed = torch.ones(batch, 1, n, past, dtype=torch.bool)
    mask = torch.cat([committed, ancestor_mask(parents, inclusive=True)[:, None]], dim=-1)
    return (mask if is_hybrid(family) else None), past + depth(parents)


def capture_decode_graph(model, fused: bool = False) -> tuple[fx.GraphModule, object]:
    """Dynamo's graph of a cached multi-token call (the shape a verification has); ``fused``: with the
    projections that read one input packed and fused into one GEMM, as the generator compiles models."""
    graphs = []

    def record(gm, example_inputs):
        if fused:
            assert fuse_projections(gm, example_inputs) > 0
        graphs.append(gm)
        return gm.forward

    prompt = torch.randint(0, VOCAB, (BATCH, PROMPT))
    if fused:
        pack_projections(model, prompt)
    with torch.no_grad():
        cache = model(prompt, use_cache=True).past_key_values
        explanation = torch._dynamo.explain(model)(input_ids=prompt[:, :3], past_key_values=cache, use_cache=True)
        torch._dynamo.reset()
        torch.compile(model, backend=record, fullgraph=True)(input_ids=prompt[:, :3], past_key_values=cache, use_cache=True)
    return graphs[0], explanation


@pytest.fixture(params=FAMILIES)
def family(request):
    torch._dynamo.reset()
    return request.param


def test_capture_one_recurrence_node_per_gdn_layer(family):
    model = tiny_model(family)
    gm, explanation = capture_decode_graph(model)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0
    recurrences = [n for n in gm.graph.nodes if is_call(n, RECURRENCE)]
    assert len(recurrences) == gdn_layer_count(model) == len(find_gdn_layers(gm.graph))
    for layer in find_gdn_layers(gm.graph):
        assert layer.state is not None and all(c.state is not None for c in layer.convs)
        assert len(layer.convs) == (3 if family == "fla" else 1)


def _state_outputs(gm: fx.GraphModule) -> list[int]:
    """Output positions holding a new recurrent or conv state (what Dynamo stores back into the cache)."""
    state_values = set()
    for node in gm.graph.nodes:
        if is_call(node, RECURRENCE) or is_call(node, SHORT_CONV):
            state_values.update(getitem_users(node).get(1, []))
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    return [i for i, out in enumerate(outputs) if any(depends_on(out, {s}) and view_chain(out)[0] is None for s in state_values)]


@pytest.mark.parametrize("fused", [False, True], ids=["separate_projections", "fused_projections"])
def test_rewrite_structure_and_durable_writes(family, fused):
    """Both as captured and with the projections fused as the generator compiles models; fla's three
    convs of a layer become one op."""
    model = tiny_model(family)
    gm, _ = capture_decode_graph(model, fused)
    before = len(list(gm.graph.nodes))
    program = rewrite_for_verify(gm)
    assert len(list(gm.graph.nodes)) == before  # the captured graph itself is untouched
    graph = program.graph_module.graph
    graph.lint()
    n_layers = gdn_layer_count(model)
    assert not any(is_call(n, RECURRENCE) for n in graph.nodes)
    verifies = [n for n in graph.nodes if n.op == "call_function" and n.target == torch.ops.specla.gdn_commit_verify_.default]
    assert len(verifies) == n_layers == len(program.layers)
    tree_convs = [n for n in graph.nodes if n.op == "call_function" and n.target == torch.ops.specla.commit_tree_conv_.default]
    three_convs = [n for n in graph.nodes if n.op == "call_function" and n.target == torch.ops.specla.commit_three_tree_convs_.default]
    assert (len(tree_convs), len(three_convs)) == ((0, n_layers) if family == "fla" else (n_layers, 0))

    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    added = [p.name for p in placeholders[program.num_model_inputs :]]
    assert added[:2] == ["specla_parents", "specla_num_pending"]
    assert ("specla_tree_mask" in added) == is_hybrid(family) == program.needs_tree_mask
    records = sum(len(layer.records) for layer in program.layers)
    assert len(added) == 2 + is_hybrid(family) + records
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    assert len(outputs) == program.num_model_outputs + records

    # no durable-state write depends on the draft tokens
    draft = {p for p in placeholders if "input_ids" in p.name}
    assert draft
    durable = {placeholders[i] for layer in program.layers for i in (layer.state_input, *layer.conv_state_inputs)}
    pending = set(placeholders[program.num_model_inputs :]) - {placeholders[program.num_model_inputs]}
    for node in graph.nodes:
        if node.op == "call_method" and node.target in INPLACE_WRITE_METHODS:
            assert view_chain(node.args[0])[0] not in durable, f"model write into durable state: {node.format_node()}"
        if node.op == "call_function" and node.target in (
            torch.ops.specla.gdn_commit_verify_.default,
            torch.ops.specla.commit_tree_conv_.default,
        ):
            assert view_chain(node.args[0])[0] in durable
            committed_from = node.args[1:6] if "gdn" in str(node.target) else node.args[1:3]
            assert all(arg in pending and not depends_on(arg, draft) for arg in committed_from)
        if node.op == "call_function" and node.target == torch.ops.specla.commit_three_tree_convs_.default:
            assert all(view_chain(state)[0] in durable for state in node.args[:3])
            assert all(arg in pending and not depends_on(arg, draft) for arg in node.args[3:7])
    for i in _state_outputs(gm):  # what Dynamo writes back into the cache is the committed state
        assert view_chain(outputs[i])[0] in durable


def test_plain_calls_match_eager(family):
    model = tiny_model(family)
    compiled = torch.compile(model, backend="specla", options={"inner": "aot_eager"})
    tokens = torch.randint(0, VOCAB, (BATCH, PROMPT + 2))
    with torch.no_grad():
        eager = model(tokens[:, :PROMPT], use_cache=True)
        ours = compiled(tokens[:, :PROMPT], use_cache=True)
        assert (eager.logits - ours.logits).abs().max() <= 1e-5
        for t in range(PROMPT, PROMPT + 2):
            eager = model(tokens[:, t : t + 1], past_key_values=eager.past_key_values, use_cache=True)
            ours = compiled(tokens[:, t : t + 1], past_key_values=ours.past_key_values, use_cache=True)
            assert (eager.logits - ours.logits).abs().max() <= 1e-5
        assert max_cache_diff(eager.past_key_values, ours.past_key_values) <= 1e-5


@pytest.mark.parametrize("inner", ["aot_eager", "eager"])
def test_chain_verify_matches_token_by_token_decoding(family, inner):
    model = tiny_model(family)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=gen)
    chain = torch.randint(0, VOCAB, (BATCH, NODES), generator=gen)
    # forcing a route reaches the CUDA dispatch only; on CPU it must leave the results unchanged
    options = {"inner": inner} if inner == "aot_eager" else {"inner": inner, "verify_kernel": "serial"}
    compiled = torch.compile(model, backend="specla", options=options)
    with torch.no_grad():
        eager = model(prompt, use_cache=True)
        steps = []
        for t in range(NODES):
            eager = model(chain[:, t : t + 1], past_key_values=eager.past_key_values, use_cache=True)
            steps.append(eager.logits)
        cache = compiled(prompt, use_cache=True).past_key_values
        parents = torch.arange(-1, NODES - 1).expand(BATCH, NODES)
        mask, positions = draft_call_inputs(parents, PROMPT, family)
        session = VerifySession()
        with session.verify(parents, mask):
            verified = compiled(input_ids=chain, past_key_values=cache, use_cache=True, position_ids=positions)
        assert (verified.logits - torch.cat(steps, 1)).abs().max() <= 1e-5
        session.accept(torch.arange(NODES).expand(BATCH, NODES), torch.full((BATCH,), NODES))
        session.flush()
        assert max_cache_diff(eager.past_key_values, verified.past_key_values) <= 1e-5


def test_bf16_value_records_stay_bf16_and_commit_as_their_float32_copies():
    """A bf16 model's v records keep v's dtype (no cast kernel per layer and pass): bf16 values are exact in
    bf16, and committing them gives the state that committing their float32 copies gives, bit for bit."""
    from specla_compile.kernels import ops

    model = tiny_model("fla", dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    prompt, chain = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=gen), torch.randint(0, VOCAB, (BATCH, NODES), generator=gen)
    compiled = torch.compile(model, backend="specla", options={"inner": "aot_eager"})
    parents = torch.arange(-1, NODES - 1).expand(BATCH, NODES)
    with torch.no_grad():
        cache = compiled(prompt, use_cache=True).past_key_values
        session = VerifySession()
        with session.verify(parents):
            compiled(input_ids=chain, past_key_values=cache, use_cache=True)
    accepted = torch.tensor([5, 8])
    session.accept(torch.arange(NODES).expand(BATCH, NODES), accepted)
    assert len(session.pending) == model.config.num_hidden_layers
    for key, (k, v, g, beta, *_) in session.pending.items():
        assert v.dtype == torch.bfloat16 and (k.dtype, g.dtype, beta.dtype) == (torch.float32,) * 3
        state = session.layers[key].state
        committed, from_float32 = state.clone(), state.clone()
        ops.gdn_commit_(committed, k, v, g, beta, accepted)
        ops.gdn_commit_(from_float32, k, v.float(), g, beta, accepted)
        assert torch.equal(committed, from_float32) and not torch.equal(committed, state)


def test_tree_nodes_match_their_own_paths_and_trees_do_not_recompile(family, monkeypatch):
    import specla_compile.backend as backend

    compiles = []
    real_backend = backend.specla_backend
    monkeypatch.setattr(backend, "specla_backend", lambda gm, ex, **kw: compiles.append(1) or real_backend(gm, ex, **kw))
    model = tiny_model(family)
    compiled = torch.compile(model, backend=backend.specla_backend, options={"inner": "aot_eager"})
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=gen)
    compiles_per_tree = []
    with torch.no_grad():
        for tree in (TREES[0], *TREES):  # the first tree twice: Dynamo settles on dynamic cache lengths
            parents = torch.tensor([tree, TREES[0]])
            tokens = torch.randint(0, VOCAB, (BATCH, NODES), generator=gen)
            cache = compiled(prompt, use_cache=True).past_key_values
            mask, positions = draft_call_inputs(parents, PROMPT, family)
            before = len(compiles)
            with VerifySession().verify(parents, mask):
                logits = compiled(input_ids=tokens, past_key_values=cache, use_cache=True, position_ids=positions).logits
            compiles_per_tree.append(len(compiles) - before)
            for b in range(BATCH):
                for j in range(NODES):
                    if parents[b, j] == PAD:
                        continue
                    path = path_to(parents[b], j)
                    own = model(prompt[b : b + 1], use_cache=True).past_key_values
                    expected = model(tokens[b : b + 1, path], past_key_values=own, use_cache=True).logits[0, -1]
                    assert (logits[b, j] - expected).abs().max() <= 1e-5
    assert compiles_per_tree[2:] == [0, 0], f"new trees of one size recompiled: {compiles_per_tree}"


def test_verify_errors(family):
    model = tiny_model(family)
    compiled = torch.compile(model, backend="specla", options={"inner": "aot_eager"})
    tokens = torch.randint(0, VOCAB, (BATCH, NODES))
    parents = torch.arange(-1, NODES - 1).expand(BATCH, NODES)
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="cannot verify"), VerifySession().verify(parents, None):
            compiled(input_ids=tokens, use_cache=True)  # no cache: nothing to verify from
        cache = compiled(tokens[:, :PROMPT], use_cache=True).past_key_values
        if is_hybrid(family):
            with pytest.raises(ValueError, match="tree_mask"), VerifySession().verify(parents, None):
                compiled(input_ids=tokens, past_key_values=cache, use_cache=True)


def test_model_without_gdn_compiles_normally(caplog):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    ).eval()
    tokens = torch.randint(0, VOCAB, (1, 6))
    with caplog.at_level(logging.INFO, logger="specla_compile"), torch.no_grad():
        ours = torch.compile(model, backend="specla", options={"inner": "aot_eager"})(tokens).logits
    assert torch.allclose(ours, model(tokens).logits, atol=1e-5)
    assert "no GDN layer" in caplog.text


def test_options_are_checked():
    from specla_compile.backend import specla_backend

    gm = fx.symbolic_trace(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown specla options"):
        specla_backend(gm, [torch.randn(1, 2)], options={"inner": "eager", "speed": "max"})
    with pytest.raises(ValueError, match="'inner'"):
        specla_backend(gm, [torch.randn(1, 2)], options={"inner": "tvm"})
    with pytest.raises(ValueError, match="'verify_kernel'"):
        specla_backend(gm, [torch.randn(1, 2)], options={"inner": "eager", "verify_kernel": "fastest"})
    with pytest.raises(ValueError, match="'plain'"):
        specla_backend(gm, [torch.randn(1, 2)], options={"inner": "eager", "plain": "lazy"})
    with pytest.raises(ValueError, match="'combo_kernels'"):
        specla_backend(gm, [torch.randn(1, 2)], options={"inner": "eager", "combo_kernels": "yes"})


@pytest.mark.parametrize("combo_kernels", [True, False])
def test_combo_kernels_are_asked_of_inductor_for_cuda_graphs_only(combo_kernels, monkeypatch):
    """inductor's combo kernels (one launch for independent pointwise kernels) where the graph's inputs
    are on CUDA, unless the option turns them off, and its PDL where specla's kernels launch with it; CPU graphs
    compile with inductor's defaults."""
    import torch._inductor.compile_fx as inductor
    from torch._subclasses.fake_tensor import FakeTensorMode

    from specla_compile import backend
    from specla_compile.kernels import pdl

    patches_seen = []
    monkeypatch.setattr(inductor, "compile_fx", lambda gm, inputs, config_patches: patches_seen.append(config_patches))
    # (no GPU to ask here: PDL on in one run, off in the other)
    monkeypatch.setattr(pdl, "enabled", lambda device: device.type == "cuda" and combo_kernels)
    compile_inner = backend._inner_compiler("inductor", None, combo_kernels)
    with FakeTensorMode():
        on_gpu = torch.empty(2, device="cuda")
    compile_inner(None, [torch.randn(2), 3])
    compile_inner(None, [3, on_gpu])
    cpu, gpu = patches_seen
    assert "combo_kernels" not in cpu and gpu["combo_kernels"] is combo_kernels
    assert cpu["triton.cudagraphs"] is False and gpu["triton.cudagraphs"] is False
    assert "triton.enable_pdl" not in cpu and gpu["triton.enable_pdl"] is combo_kernels


def test_plain_eager_compiles_only_the_verification_twin(monkeypatch):
    import specla_compile.backend as backend

    compiled_graphs = []
    real = backend._inner_compiler

    def counting(*args):
        compile_inner = real(*args)
        return lambda gm, example_inputs: compiled_graphs.append(gm) or compile_inner(gm, example_inputs)

    monkeypatch.setattr(backend, "_inner_compiler", counting)
    model = tiny_model("fla")
    prompt, chain = torch.randint(0, VOCAB, (BATCH, PROMPT)), torch.randint(0, VOCAB, (BATCH, NODES))
    parents = torch.arange(-1, NODES - 1).expand(BATCH, NODES)
    twins, others, logits = {}, {}, {}
    for plain in ("compiled", "eager"):
        compiled_graphs.clear()
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="specla", options={"inner": "aot_eager", "plain": plain})
        with torch.no_grad():
            cache = model(prompt, use_cache=True).past_key_values
            with VerifySession().verify(parents):
                logits[plain] = compiled(input_ids=chain, past_key_values=cache, use_cache=True).logits
        twins[plain] = sum("gdn_commit_verify_" in gm.code for gm in compiled_graphs)
        others[plain] = len(compiled_graphs) - twins[plain]
    # the same twins, the same results; the captured GDN graph itself is compiled only for plain="compiled"
    assert twins["eager"] == twins["compiled"] >= 1
    assert others["compiled"] - others["eager"] == twins["compiled"], (twins, others)
    assert torch.equal(logits["eager"], logits["compiled"])


def test_padded_fla_batch_equals_each_row_alone_eager_and_compiled():
    """fla turns a batch with padding in ``attention_mask`` into packed rows (``cu_seqlens``): the capture
    runs them one at a time (eagerly: a graph break when compiled), so every row's logits and cache equal
    the row run alone."""
    model = tiny_model("fla", layers=2)
    prompts, input_ids, mask = left_padded_batch((3, 6, 5), seed=5)
    with torch.no_grad():
        alone = [model(p[None], use_cache=True) for p in prompts]
        compiled = torch.compile(model, backend="specla", options={"inner": "eager"})
        for run in (model, compiled):
            out = run(input_ids, attention_mask=mask, use_cache=True)
            for b, (p, ref) in enumerate(zip(prompts, alone)):
                assert torch.allclose(out.logits[b, -p.numel() :], ref.logits[0], atol=1e-5)
                row = [t[b : b + 1] for t in cache_tensors(out.past_key_values)]
                assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(row, cache_tensors(ref.past_key_values), strict=True))


def run_script_expecting_ok(script: str) -> None:
    """Run ``script`` in a fresh interpreter (nothing imported yet); it must print ``ok`` last."""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-2000:]


def test_backend_is_registered_without_importing_the_package():
    script = (
        "import sys, torch\n"
        "assert 'specla' in torch._dynamo.list_backends()\n"
        "from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig\n"
        "cfg = Qwen3_5TextConfig(vocab_size=50, hidden_size=32, intermediate_size=32, num_hidden_layers=2,"
        " num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1, linear_num_value_heads=2,"
        " linear_key_head_dim=16, linear_value_head_dim=8, layer_types=['linear_attention', 'full_attention'])\n"
        "model = Qwen3_5ForCausalLM(cfg).eval()\n"
        "assert 'specla_compile' not in sys.modules\n"
        "compiled = torch.compile(model, backend='specla', options={'inner': 'eager'})\n"
        "with torch.no_grad():\n"
        "    out = compiled(torch.randint(0, 50, (1, 4)))\n"
        "assert 'specla_compile' in sys.modules and out.logits.shape == (1, 4, 50)\n"
        "print('ok')\n"
    )
    run_script_expecting_ok(script)


def test_generator_compiles_from_a_source_checkout_without_the_entry_point():
    """Run from a checkout on PYTHONPATH (as on the GPU machine), no entry point registers "specla":
    the generator's compile must register it by name itself."""
    script = (
        "import importlib.metadata as md\n"
        "_all = md.entry_points\n"
        "md.entry_points = lambda **kw: md.EntryPoints([]) if kw.get('group') == 'torch_dynamo_backends' else _all(**kw)\n"
        "import torch\n"
        "from specla_compile.runtime.generator import compile_for_verification\n"
        "compile_for_verification(torch.nn.Linear(2, 2))\n"
        "print('ok')\n"
    )
    run_script_expecting_ok(script)


def test_inductor_inner_compiler_verifies_a_chain():
    """The default inner compiler (inductor, C++ on CPU) on one family: slower to build, so once."""
    torch._dynamo.reset()
    model = tiny_model("fla", layers=2)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=gen)
    chain = torch.randint(0, VOCAB, (1, 4), generator=gen)
    compiled = torch.compile(model, backend="specla")
    with torch.no_grad():
        eager = model(prompt, use_cache=True)
        expected = []
        for t in range(4):
            eager = model(chain[:, t : t + 1], past_key_values=eager.past_key_values, use_cache=True)
            expected.append(eager.logits)
        cache = compiled(prompt, use_cache=True).past_key_values
        session = VerifySession()
        with session.verify(torch.arange(-1, 3)[None]):
            logits = compiled(input_ids=chain, past_key_values=cache, use_cache=True).logits
        assert (logits - torch.cat(expected, 1)).abs().max() <= 1e-5


def test_fla_rearrange_is_routed_and_equals_einops():
    """fla's GDN layer splits and merges heads with einops, whose pattern parsing Dynamo re-traced at every
    call (most of a model's trace): the routed one reshapes for the layer's two patterns, else calls einops."""
    import einops
    import fla.layers.gated_deltanet as layer

    from specla_compile.lowering.capture import fla_rearrange

    assert layer.rearrange.__specla_original__ is einops.rearrange
    x, y = torch.randn(2, 3, 12), torch.randn(2, 3, 4, 5)
    for t, pattern, axes in ((x, "... (h d) -> ... h d", {"d": 4}), (y, "b t h d -> b t (h d)", {}),
                             (y, "b t h d -> b h t d", {}), (x, "b t (h d) -> b h t d", {"h": 3})):
        assert torch.equal(fla_rearrange(t, pattern, **axes), einops.rearrange(t, pattern, **axes))


def test_verification_twin_is_cacheable_by_aot_autograd(family):
    """Every node of the twin passes AOTAutograd's cacheability check (the rewrite's nodes carry example
    values as Dynamo's do): otherwise a warm process re-traces every graph with AOTAutograd."""
    from torch._functorch._aot_autograd.autograd_cache import check_node_safe

    from specla_compile.backend import specla_backend

    twins = []

    def record(gm, example_inputs):
        twins.append(specla_backend(gm, example_inputs, options={"inner": "eager"}))
        return twins[-1]

    model = tiny_model(family)
    prompt = torch.randint(0, VOCAB, (BATCH, PROMPT))
    with torch.no_grad():
        cache = model(prompt, use_cache=True).past_key_values
        torch.compile(model, backend=record, fullgraph=True)(input_ids=prompt[:, :3], past_key_values=cache, use_cache=True)
    nodes = list(twins[0].program.graph_module.graph.nodes)
    assert any(n.target in (torch.ops.specla.commit_tree_conv_.default, torch.ops.specla.commit_three_tree_convs_.default) for n in nodes)
    for node in nodes:
        check_node_safe(node)  # raises BypassAOTAutogradCache
