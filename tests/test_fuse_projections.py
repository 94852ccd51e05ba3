"""Projections that read one input become one GEMM: packing keeps the model's outputs, the compiled
verification pass has fewer linear calls and the same results."""

from __future__ import annotations

import pytest
import torch
from models import FAMILIES, VOCAB, tiny_model
from test_backend import draft_call_inputs

from specla_compile.lowering.fuse_projections import pack_projections
from specla_compile.lowering.session import VerifySession


def _linear_calls(gm: torch.fx.GraphModule) -> int:
    return sum(n.op == "call_function" and n.target is torch._C._nn.linear for n in gm.graph.nodes)


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_projections_are_one_gemm_each_and_change_no_result(family, monkeypatch):
    import specla_compile.backend as backend

    twins = []
    real = backend._inner_compiler

    def keep_twins(inner, mode):
        compile_inner = real(inner, mode)
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
