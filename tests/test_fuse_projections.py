"""Projections that read one input become one GEMM: packing keeps the model's outputs, the compiled
verification pass has fewer linear calls and the same results."""

from __future__ import annotations

import pytest
import torch
from models import FAMILIES, VOCAB, tiny_model
from test_backend import draft_call_inputs

from specla_compile.lowering.fuse_projections import fuse_projections, gathers_as_slices, pack_projections
from specla_compile.lowering.session import VerifySession


def _linear_calls(gm: torch.fx.GraphModule) -> int:
    return sum(n.op == "call_function" and n.target is torch._C._nn.linear for n in gm.graph.nodes)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_projections_are_one_gemm_each_and_change_no_result(family, monkeypatch):
    import specla_compile.backend as backend

    twins = []
    real = backend._inner_compiler

    def keep_twins(*args):
        compile_inner = real(*args)
        return lambda gm, ex: (twins.append(gm) if "gdn_commit_verify_" in gm.code else None) or compile_inner(gm, ex)

    monkeypatch.setattr(backend, "_inner_compiler", keep_twins)
    model = tiny_model(family)
    gen = torch.Generator().manual_seed(3)
    prompt, chain = torch.randint(0, VOCAB, (2, 6), generator=gen), torch.randint(0, VOCAB, (2, 5), generator=gen)
    parents = torch.arange(-1, 4).expand(2, 5)
    mask, positions = draft_call_inputs(parents, prompt.shape[1], family)
    results = {}
    with torch.no_grad():
        for packed in (False, True):
            if packed:
                before = {name: p.detach().clone() for name, p in model.named_parameters()}
                assert pack_projections(model, prompt[:1, :2]) >= 2  # the GDN inputs and the MLP's gate/up, at least
                assert all(torch.equal(before[name], p) for name, p in model.named_parameters())  # same values
                assert pack_projections(model, prompt[:1, :2]) == 0  # packed once
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="specla", options={"inner": "aot_eager", "plain": "eager"})
            cache = model(prompt, use_cache=True).past_key_values
            eager = model(chain, past_key_values=model(prompt, use_cache=True).past_key_values, use_cache=True).logits
            with VerifySession().verify(parents, mask):
                results[packed] = compiled(input_ids=chain, past_key_values=cache, use_cache=True, position_ids=positions).logits
            assert (results[packed] - eager).abs().max() <= 1e-5
    assert _linear_calls(twins[1]) < _linear_calls(twins[0]), [_linear_calls(t) for t in twins]


def _packed_fla_graph(seed: int, dynamic: bool, tokens: int = 5) -> tuple[torch.fx.GraphModule, list]:
    """Dynamo's graph of a packed tiny fla model over ``tokens`` tokens (the node dimension marked dynamic or not),
    with its example inputs."""
    model = tiny_model("fla")
    ids = torch.randint(0, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(seed))
    pack_projections(model, ids[:, :2])
    graphs = []

    def keep(gm, example_inputs):
        graphs.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    if dynamic:
        torch._dynamo.mark_dynamic(ids, 1)
    with torch.no_grad():
        torch.compile(model, backend=keep)(input_ids=ids, use_cache=False)
    return graphs[0]


def test_the_fused_gemm_joins_its_parts_example_values_and_keeps_the_node_dimension_symbolic():
    """The fused linear takes Dynamo's example values of its parts, joined: computing its own by a fake
    run of ``linear`` reads a symbolic node dimension as an integer on CUDA, a guard that specialises the
    one graph traced for every bucket size to one size."""
    gm, example_inputs = _packed_fla_graph(seed=4, dynamic=True)
    assert fuse_projections(gm, example_inputs) >= 2
    fused = [n for n in gm.graph.nodes if n.target is torch._C._nn.linear and n.args[1].target is torch.as_strided]
    assert len(fused) >= 2
    for node in fused:
        value = node.meta["example_value"]
        assert isinstance(value.shape[1], torch.SymInt) and value.shape[-1] == node.args[1].args[1][0]


def test_a_static_twin_reads_the_fused_gemms_parts_as_slices():
    """Per-size twins (static shapes) take the fused output's parts as slices, views that the ops after
    them read in place, where the size-generic graph gathers each part (a copy kernel per part on the
    GPU); same outputs."""
    gm, example_inputs = _packed_fla_graph(seed=5, dynamic=False)
    with torch.no_grad():
        parts = fuse_projections(gm, example_inputs) and sum(n.target is torch.index_select for n in gm.graph.nodes)
        expected = gm(*example_inputs)
        assert parts >= 5 and gathers_as_slices(gm) == parts
        assert not any(n.target in (torch.index_select, torch.arange) for n in gm.graph.nodes)
        assert sum(n.target is torch.narrow for n in gm.graph.nodes) == parts
        for got, want in zip(gm(*example_inputs), expected):
            assert torch.equal(got, want)


def test_max_autotune_on_cuda_refuses_fused_projections_at_once():
    """inductor's GEMM autotuner fails on a fused GEMM's weight (an as_strided view over its first part's
    input) minutes into a CUDA compile: the backend says so in one line before compiling, and names the way
    out; other modes, other inner compilers and CPU graphs go on."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from specla_compile.backend import _tunes_gemms_on_cuda, specla_backend

    gm, example_inputs = _packed_fla_graph(seed=6, dynamic=False)
    with FakeTensorMode():
        on_gpu = torch.empty(1, device="cuda")
    with pytest.raises(ValueError, match="cannot autotune the fused projection GEMMs.*fuse_projections': False"):
        specla_backend(gm, [*example_inputs, on_gpu], mode="max-autotune-no-cudagraphs")  # (one CUDA input: enough)
    assert _tunes_gemms_on_cuda("inductor", "max-autotune", [on_gpu])
    assert not _tunes_gemms_on_cuda("inductor", "max-autotune", example_inputs)  # CPU
    assert not _tunes_gemms_on_cuda("inductor", "default", [on_gpu]) and not _tunes_gemms_on_cuda("inductor", None, [on_gpu])
    assert not _tunes_gemms_on_cuda("aot_eager", "max-autotune", [on_gpu])
    with torch._inductor.config.patch(max_autotune_gemm=True):  # (the same asked of inductor's config)
        assert _tunes_gemms_on_cuda("inductor", None, [on_gpu])
