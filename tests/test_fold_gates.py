"""A one-node twin's GDN gates fold into its recurrence op: what folds and what stays, the same outputs, and
generation through folded passes stays exact."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import random_conv_gates_pass
from test_fold_norms import _calls, _decode_on_cpu_as_on_cuda, _dynamo_graph

from specla_compile import SpecConfig
from specla_compile.lowering.fold_gates import CONVS, CONVS_FOLDED, FOLDED, VERIFY, fold_convs, fold_gates

SPECLA = torch.ops.specla
B, HEADS, VALUE_HEADS, DIM = 2, 1, 2, 8


def _verify(x, g, beta, parents):
    """``specla.gdn_commit_verify_`` over the state, pending record and q/k/v of ``x``, with these gates."""
    return SPECLA.gdn_commit_verify_(*x, g, beta, parents, 0.3, True)


def _fla(*inputs):  # (its gates also returned, as the rewrite returns them as the pass's records)
    x, (a, b, a_log, dt_bias, parents) = inputs[:9], inputs[9:]
    g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    beta = b.float().sigmoid()
    return (*_verify(x, g, beta, parents), g.to(torch.float32), beta)


def _casts_by_to(*inputs):  # (and the product's factors the other way round)
    x, (a, b, a_log, dt_bias, parents) = inputs[:9], inputs[9:]
    g = torch.nn.functional.softplus(dt_bias.to(torch.float32) + a.to(torch.float32)) * -torch.exp(a_log.float())
    beta = torch.sigmoid(b.to(torch.float32))
    return (*_verify(x, g, beta, parents), beta)


def _half_precision_sigmoid(*inputs):  # (Qwen3.5 in bf16: beta rounds to bf16 first)
    x, (a, b, a_log, dt_bias, parents) = inputs[:9], inputs[9:]
    g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    return _verify(x, g, b.sigmoid().float(), parents)


def _softplus_with_a_beta(*inputs):
    x, (a, b, a_log, dt_bias, parents) = inputs[:9], inputs[9:]
    g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias, beta=2.0)
    return _verify(x, g, b.float().sigmoid(), parents)


def _scaled_by_a_number(*inputs):
    x, (a, b, _, dt_bias, parents) = inputs[:9], inputs[9:]
    g = -torch.nn.functional.softplus(a.float() + dt_bias) * 0.5
    return _verify(x, g, b.float().sigmoid(), parents)


def _gate_read_before_the_recurrence(*inputs):
    x, (a, b, a_log, dt_bias, parents) = inputs[:9], inputs[9:]
    g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    kept = g * 2
    return (*_verify(x, g, b.float().sigmoid(), parents), kept)


def _source_written_before_the_recurrence(*inputs):
    x, (a, b, a_log, dt_bias, parents) = inputs[:9], inputs[9:]
    a = a.clone()
    g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    a.mul_(2)
    return (*_verify(x, g, b.float().sigmoid(), parents), a)


def _source_set_by_index_before_the_recurrence(*inputs):
    x, (a, b, a_log, dt_bias, parents) = inputs[:9], inputs[9:]
    b = b.clone()
    beta = b.float().sigmoid()
    b[0] = 0
    g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    return (*_verify(x, g, beta, parents), b)


FOLD_CASES = {  # function: gates folded (one node a row)
    _fla: 1,
    _casts_by_to: 1,
    _half_precision_sigmoid: 0,
    _softplus_with_a_beta: 0,
    _scaled_by_a_number: 0,
    _gate_read_before_the_recurrence: 0,
    _source_written_before_the_recurrence: 0,
    _source_set_by_index_before_the_recurrence: 0,
}


def _inputs(nodes: int, seed: int) -> list[torch.Tensor]:
    """The state, a pending record, q/k/v, the gates' projections and parameters, and a chain's parents."""
    gen = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen)
    x = [randn(B, VALUE_HEADS, DIM, DIM), torch.nn.functional.normalize(randn(B, 1, HEADS, DIM), dim=-1),
         randn(B, 1, VALUE_HEADS, DIM), -torch.rand(B, 1, VALUE_HEADS, generator=gen), torch.rand(B, 1, VALUE_HEADS, generator=gen),
         torch.tensor([1, 0]), randn(B, nodes, HEADS, DIM), randn(B, nodes, HEADS, DIM), randn(B, nodes, VALUE_HEADS, DIM)]
    projection = (2 * randn(B, nodes, 3 * VALUE_HEADS)).bfloat16()  # (a and b: slices of one bf16 output)
    parents = torch.arange(-1, nodes - 1).expand(B, nodes).contiguous()
    return [*x, projection[..., :VALUE_HEADS], projection[..., 2 * VALUE_HEADS:], randn(VALUE_HEADS), randn(VALUE_HEADS), parents]


def _run(gm, example_inputs) -> list[torch.Tensor]:
    """The graph's outputs on copies of its inputs, then the state it committed (the one input of the state's shape)."""
    fresh = [t.clone() for t in example_inputs]
    out = gm(*fresh)
    return [*out, next(t for t in fresh if t.shape == (B, VALUE_HEADS, DIM, DIM))]


@pytest.mark.parametrize("fn", FOLD_CASES, ids=lambda fn: fn.__name__.strip("_"))
def test_what_folds_and_what_stays(fn):
    """Each form of the gates around a one-node recurrence, as Dynamo captures it: whether the pass folds it, and the
    same outputs and committed state (fp32, CPU references) where it folds or not."""
    gm, example_inputs = _dynamo_graph(fn, *_inputs(nodes=1, seed=3))
    expected = _run(gm, example_inputs)
    assert fold_gates(gm) == FOLD_CASES[fn]
    assert _calls(gm, FOLDED) == FOLD_CASES[fn] and _calls(gm, *VERIFY) == 1 - FOLD_CASES[fn]
    if FOLD_CASES[fn]:  # (none of the gates' math is left: the op computes it)
        assert not any(n.target in (torch.nn.functional.softplus, torch._C._nn.softplus, torch.sigmoid, "sigmoid")
                       for n in gm.graph.nodes)
    got = _run(gm, example_inputs)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and (g - e).abs().max() <= 1e-6 * e.abs().max()


def test_a_pass_of_several_nodes_folds_its_gates_when_drafted_passes_do():
    """A pass of several nodes keeps its gates unless ``drafted`` (the parallel route computes them in its launch);
    folded, its outputs, records and committed state stay."""
    gm, example_inputs = _dynamo_graph(_fla, *_inputs(nodes=3, seed=4))
    expected = _run(gm, example_inputs)
    assert fold_gates(gm) == 0 and _calls(gm, *VERIFY) == 1
    assert fold_gates(gm, drafted=True) == 1 and _calls(gm, FOLDED) == 1
    for g, e in zip(_run(gm, example_inputs), expected, strict=True):
        assert (g - e).abs().max() <= 1e-6 * e.abs().max()


def test_drafted_decoding_through_folded_gates_equals_eager_decoding(monkeypatch, caplog):
    """With ``fold_gates_drafted`` (made to fold here: CPU), the twin of the 8-node draft bucket (whose 8-node chains
    take the parallel route) folds every layer's gates too; drafted and plain decoding both equal eager decoding."""
    log = _decode_on_cpu_as_on_cuda("fold_gates_drafted", SpecConfig(mode="chain", depth=7, bucket=8), 12, monkeypatch,
                                    caplog)
    assert log.count("4 GDN layers' gates folded into their parallel verify") >= 1  # (the 8-node twin's)
    assert log.count("4 GDN layers' gates folded into their recurrence") == 1  # (the 1-node twin's, as by default)


def _convs_then_recurrence(*inputs, v_read_early: bool = False, y_kept: bool = False, state_read: bool = False):
    """A one-node layer as the rewrite leaves it: q/k/v convs, their outputs as heads, fla's gates, the recurrence;
    returns what the pass keeps (v's heads and the convs' inputs as records)."""
    states, pendings, num, xs, weights = inputs[0:3], inputs[3:6], inputs[6], inputs[7:10], inputs[10:13]
    state, records, (a, b, a_log, dt_bias, parents) = inputs[13], inputs[14:18], inputs[18:]
    y0, y1, y2, r0, r1, r2 = SPECLA.commit_three_tree_convs_(*states, *pendings, num, *xs, *weights, parents, True)
    q, k, v = y0.reshape(B, 1, -1, DIM), y1.reshape(B, 1, -1, DIM), y2.reshape(B, 1, VALUE_HEADS, DIM)
    early = v * 2 if v_read_early else states[0] * 2 if state_read else None
    g = -a_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    o, k_hat = SPECLA.gdn_commit_verify_(state, *records, num, q, k, v, g, b.float().sigmoid(), parents, 0.3, True)
    kept = (early,) if early is not None else (y0,) if y_kept else ()
    return (o, k_hat, v.contiguous(), r0, r1, r2, *kept)


def _conv_pass_inputs(seed: int) -> list[torch.Tensor]:
    case = random_conv_gates_pass(B, HEADS, VALUE_HEADS, DIM, (1, 2), seed=seed, dtype=torch.float32)
    return [*case["conv_states"], *case["conv_pending"], case["num"], *case["xs"], *case["weights"], case["state"],
            *case["records"], *case["gates"], case["parents"]]


@pytest.mark.parametrize("variant, folds", [({}, 1), ({"v_read_early": True}, 0), ({"y_kept": True}, 0),
                                            ({"state_read": True}, 0)])
def test_the_convs_fold_into_the_folded_recurrence(variant, folds):
    """After ``fold_gates``, ``fold_convs`` puts a one-node layer's q/k/v convs into its recurrence op, with the same
    outputs, records and committed conv and recurrent states (fp32, CPU references); not where a conv's output is read
    by anything else, nor where v's heads or a conv state (which the fused op commits later) are read before the
    recurrence."""
    fn = lambda *inputs: _convs_then_recurrence(*inputs, **variant)
    inputs = _conv_pass_inputs(seed=5)
    gm, example_inputs = _dynamo_graph(fn, *inputs)
    fresh = [t.clone() for t in example_inputs]
    expected = [*gm(*fresh), *fresh]
    assert fold_gates(gm) == 1 and fold_convs(gm) == folds
    assert _calls(gm, CONVS_FOLDED) == folds and _calls(gm, *CONVS) == 1 - folds
    fresh = [t.clone() for t in example_inputs]
    got = [*gm(*fresh), *fresh]
    for g, e in zip(got, expected, strict=True):
        assert (g - e).abs().max() <= 1e-6 * e.abs().max()


def test_plain_decoding_through_folded_gates_equals_eager_decoding(monkeypatch, caplog):
    """With ``fold_gates`` (made to fold here: CPU, fp32), the one-node twin of plain decoding computes every layer's
    gates in its recurrence op while the drafted passes' twins keep theirs; drafted and plain decoding both equal
    eager decoding."""
    log = _decode_on_cpu_as_on_cuda("fold_gates", SpecConfig(mode="chain", depth=5, bucket=8), 4, monkeypatch, caplog)
    assert log.count("4 GDN layers' gates folded") == 1  # the 1-node twin's, not the draft bucket's


def test_plain_decoding_through_folded_convs_equals_eager_decoding(monkeypatch, caplog):
    """With ``fold_convs`` (made to fold here: CPU, where the op runs its reference composition), the one-node twin of
    plain decoding runs each layer's q/k/v convs, gates and recurrence as one op while the drafted passes keep their
    convs; drafted and plain decoding both equal eager decoding."""
    log = _decode_on_cpu_as_on_cuda("fold_convs", SpecConfig(mode="chain", depth=5, bucket=8), 10, monkeypatch, caplog)
    assert log.count("4 GDN layers' q/k/v convs folded") == 1  # the 1-token twin's, not the draft bucket's
