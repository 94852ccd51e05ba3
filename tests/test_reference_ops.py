import inspect

import pytest
import torch
import torch.nn.functional as F
from helpers import parent_batches, path_recurrence, random_gdn_inputs
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_next import modeling_qwen3_next

from specla_compile.kernels import (
    FactorRecords,
    conv_state_commit_reference,
    gdn_commit_reference,
    gdn_commit_verify_reference,
    gdn_tree_factorized,
    gdn_tree_reference,
    tree_conv_reference,
)
from specla_compile.runtime.topology import PAD, path_to

# transformers swaps in fla's (GPU-only) kernel when fla is installed; unwrap to its own torch code
torch_recurrent_gated_delta_rule = inspect.unwrap(modeling_qwen3_next.torch_recurrent_gated_delta_rule)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4}  # fp64 absolute, fp32 relative


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def verify_fns():
    return [
        lambda *a, **kw: gdn_tree_reference(*a, **kw)[0],
        lambda *a, **kw: gdn_tree_factorized(*a, **kw)[0],
    ]


@pytest.mark.parametrize("heads, value_heads", [(2, 2), (1, 4)])
@pytest.mark.parametrize("use_qk_l2norm", [False, True])
@pytest.mark.parametrize("verify", verify_fns(), ids=["sequential", "factorized"])
def test_chain_matches_transformers(heads, value_heads, use_qk_l2norm, verify):
    n = 9
    parents = (torch.arange(n) - 1)[None].repeat(2, 1)
    x = random_gdn_inputs(parents, heads=heads, value_heads=value_heads, dk=16, dv=8, dtype=torch.float32, seed=3)
    ours = verify(*(x[k] for k in ("q", "k", "v", "g", "beta")), parents, x["initial_state"], use_qk_l2norm=use_qk_l2norm)
    theirs, final = torch_recurrent_gated_delta_rule(
        x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["initial_state"],
        output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm,
    )
    assert rel_err(ours, theirs) <= 1e-5
    _, states = gdn_tree_reference(*(x[k] for k in ("q", "k", "v", "g", "beta")), parents, x["initial_state"], use_qk_l2norm=use_qk_l2norm)
    assert rel_err(states[:, -1], final) <= 1e-5


@settings(max_examples=40, deadline=None)
@given(
    parents=parent_batches(),
    dtype=st.sampled_from([torch.float64, torch.float32]),
    heads=st.sampled_from([(1, 1), (1, 2), (2, 4)]),
    use_qk_l2norm=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_trees_match_path_recurrence(parents, dtype, heads, use_qk_l2norm, seed):
    x = random_gdn_inputs(parents, heads=heads[0], value_heads=heads[1], dk=8, dv=4, dtype=dtype, seed=seed)
    args = [x[k] for k in ("q", "k", "v", "g", "beta")]
    scale = 0.3
    o_seq, states = gdn_tree_reference(*args, parents, x["initial_state"], scale=scale, use_qk_l2norm=use_qk_l2norm)
    o_fac, records = gdn_tree_factorized(*args, parents, x["initial_state"], scale=scale, use_qk_l2norm=use_qk_l2norm)
    assert torch.isfinite(o_fac).all()
    for b, row in enumerate(parents.tolist()):
        for j, p in enumerate(row):
            if p == PAD:
                continue
            o_path, s_path = path_recurrence(x, path_to(parents[b], j), b, scale, use_qk_l2norm)
            for got in (o_seq[b, j], o_fac[b, j]):
                if dtype == torch.float64:
                    assert (got - o_path).abs().max() <= TOLERANCE[dtype]
                else:
                    assert rel_err(got, o_path) <= TOLERANCE[dtype]
            if dtype == torch.float64:
                assert (states[b, j] - s_path).abs().max() <= TOLERANCE[dtype]
    # records replay: committing a node's path gives that node's state
    j = parents.shape[1] - 1
    while parents[0, j] == PAD:
        j -= 1
    path = torch.tensor(path_to(parents[0], j))[None].repeat(parents.shape[0], 1)
    num = torch.full((parents.shape[0],), path.shape[1])
    committed = gdn_commit_reference(x["initial_state"], records.select(path), num)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert rel_err(committed[0], states[0, j]) <= tol


def test_default_scale_and_state():
    parents = torch.tensor([[-1, 0, 0]])
    x = random_gdn_inputs(parents, dk=16)
    args = [x[k] for k in ("q", "k", "v", "g", "beta")]
    o_default, _ = gdn_tree_factorized(*args, parents, None)
    o_explicit, _ = gdn_tree_factorized(*args, parents, torch.zeros_like(x["initial_state"]), scale=16**-0.5)
    torch.testing.assert_close(o_default, o_explicit, rtol=0, atol=1e-12)
    o_ref, _ = gdn_tree_reference(*args, parents, None)
    torch.testing.assert_close(o_default, o_ref, rtol=0, atol=1e-12)


def test_shape_errors():
    parents = torch.tensor([[-1, 0]])
    x = random_gdn_inputs(parents, heads=2, value_heads=3)
    args = [x[k] for k in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match="multiple"):
        gdn_tree_reference(*args, parents, None)
    x = random_gdn_inputs(parents)
    args = [x[k] for k in ("q", "k", "v", "g", "beta")]
    with pytest.raises(ValueError, match="parents"):
        gdn_tree_factorized(*args, torch.tensor([[-1, 0, 1]]), None)
    with pytest.raises(ValueError, match="state"):
        gdn_tree_factorized(*args, parents, x["initial_state"][..., :3])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_commit_ragged_rows(dtype):
    parents = torch.tensor([[-1, 0, 1, 2, 3], [-1, 0, 1, 2, 3]])
    x = random_gdn_inputs(parents, dtype=dtype, seed=7)
    args = [x[k] for k in ("q", "k", "v", "g", "beta")]
    _, states = gdn_tree_reference(*args, parents, x["initial_state"])
    _, records = gdn_tree_factorized(*args, parents, x["initial_state"])
    num = torch.tensor([2, 0])
    new = gdn_commit_reference(x["initial_state"], records, num)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert rel_err(new[0], states[0, 1]) <= tol
    assert torch.equal(new[1], x["initial_state"][1])  # nothing accepted: state untouched


@settings(max_examples=25, deadline=None)
@given(parents=parent_batches(), accepted=st.integers(0, 4), seed=st.integers(0, 2**16))
def test_fused_commit_verify_equals_commit_then_verify(parents, accepted, seed):
    chain = (torch.arange(4) - 1)[None].repeat(parents.shape[0], 1)
    old = random_gdn_inputs(chain, seed=seed)
    new = random_gdn_inputs(parents, seed=seed + 1)
    _, pending = gdn_tree_factorized(*(old[k] for k in ("q", "k", "v", "g", "beta")), chain, old["initial_state"], use_qk_l2norm=True)
    num = torch.full((parents.shape[0],), accepted)
    args = [new[k] for k in ("q", "k", "v", "g", "beta")]
    o, records, state = gdn_commit_verify_reference(old["initial_state"], pending, num, *args, parents, use_qk_l2norm=True)
    expected_state = gdn_commit_reference(old["initial_state"], pending, num)
    expected_o, expected_records = gdn_tree_factorized(*args, parents, expected_state, use_qk_l2norm=True)
    assert torch.equal(state, expected_state)
    assert torch.equal(o, expected_o)
    assert all(torch.equal(a, b) for a, b in zip(records, expected_records))
    # and committing equals walking the accepted chain sequentially
    if accepted:
        _, states = gdn_tree_reference(*(old[k] for k in ("q", "k", "v", "g", "beta")), chain, old["initial_state"], use_qk_l2norm=True)
        assert (state - states[:, accepted - 1]).abs().max() <= 1e-10


def path_conv(x_row, state_row, weight, bias, path):
    """Plain causal conv1d over [conv_state ++ path inputs], last output."""
    seq = torch.cat([state_row, x_row[path].T], dim=-1)[None]  # [1, D, S + L]
    y = F.conv1d(seq, weight[:, None, :], bias, groups=weight.shape[0])
    return F.silu(y[0, :, -1])


@settings(max_examples=40, deadline=None)
@given(parents=parent_batches(), width=st.integers(1, 5), extra_state=st.integers(0, 2), seed=st.integers(0, 2**16))
def test_tree_conv_matches_causal_conv_along_paths(parents, width, extra_state, seed):
    gen = torch.Generator().manual_seed(seed)
    batch, n = parents.shape
    d = 6
    x = torch.randn(batch, n, d, generator=gen, dtype=torch.float64)
    conv_state = torch.randn(batch, d, width - 1 + extra_state, generator=gen, dtype=torch.float64)
    weight = torch.randn(d, width, generator=gen, dtype=torch.float64)
    bias = torch.randn(d, generator=gen, dtype=torch.float64)
    y = tree_conv_reference(x, conv_state, weight, bias, parents)
    for b, row in enumerate(parents.tolist()):
        for j, p in enumerate(row):
            if p != PAD:
                expected = path_conv(x[b], conv_state[b], weight, bias, path_to(parents[b], j))
                assert (y[b, j] - expected).abs().max() <= 1e-12


def test_conv_state_commit():
    gen = torch.Generator().manual_seed(0)
    state = torch.randn(2, 3, 4, generator=gen)
    x = torch.randn(2, 5, 3, generator=gen)
    new = conv_state_commit_reference(state, x, torch.tensor([2, 5]))
    torch.testing.assert_close(new[0], torch.cat([state[0], x[0, :2].T], -1)[:, -4:], rtol=0, atol=0)
    torch.testing.assert_close(new[1], x[1, 1:].T, rtol=0, atol=0)
    assert torch.equal(conv_state_commit_reference(state, x, torch.tensor([0, 0])), state)


def test_conv_commit_then_conv_equals_longer_path():
    """Committing accepted inputs and convolving the next node equals convolving along the whole path."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 6, 4, generator=gen, dtype=torch.float64)
    state = torch.randn(1, 4, 3, generator=gen, dtype=torch.float64)
    weight = torch.randn(4, 4, generator=gen, dtype=torch.float64)
    chain = (torch.arange(6) - 1)[None]
    full = tree_conv_reference(x, state, weight, None, chain)
    new_state = conv_state_commit_reference(state, x[:, :4], torch.tensor([4]))
    tail = tree_conv_reference(x[:, 4:], new_state, weight, None, chain[:, :2])
    torch.testing.assert_close(tail, full[:, 4:], rtol=0, atol=1e-12)


def test_conv_shape_errors():
    parents = torch.tensor([[-1, 0]])
    with pytest.raises(ValueError, match="conv_state"):
        tree_conv_reference(torch.randn(1, 2, 3), torch.randn(1, 3, 1), torch.randn(3, 4), None, parents)
    with pytest.raises(ValueError, match="weight"):
        tree_conv_reference(torch.randn(1, 2, 3), torch.randn(1, 3, 3), torch.randn(2, 4), None, parents)


def test_factor_records_select():
    rec = FactorRecords(*(torch.arange(2 * 4 * s).reshape(2, 4, s).float() for s in (3, 2, 1, 1)))
    picked = rec.select(torch.tensor([[0, 2], [3, 1]]))
    assert torch.equal(picked.k[1, 0], rec.k[1, 3]) and torch.equal(picked.v[0, 1], rec.v[0, 2])


def test_the_rms_norm_op_is_fla_s_norm_and_differentiable():
    """``specla::rms_norm`` (the node a static twin folds): fla's RMSNorm in fp32 rounded once, with fla's fused
    prenorm's residual added unrounded, ``F.rms_norm`` in fp64, and composite, so that CPU training
    differentiates through it."""
    from specla_compile.kernels.reference import add_norm_linear_reference, rms_norm_reference

    gen = torch.Generator().manual_seed(4)
    x, weight = torch.randn(3, 5, 64, generator=gen, dtype=torch.float64), 1 + 0.3 * torch.randn(64, generator=gen, dtype=torch.float64)
    skip = torch.randn(3, 5, 64, generator=gen, dtype=torch.float64)
    assert (torch.ops.specla.rms_norm(x, None, weight, 1e-6) - F.rms_norm(x, (64,), weight, 1e-6)).abs().max() <= 1e-14
    assert (torch.ops.specla.rms_norm(x, skip, weight, 1e-6) - F.rms_norm(x + skip, (64,), weight, 1e-6)).abs().max() <= 1e-14
    half, half_skip = x.bfloat16(), skip.bfloat16()
    wide = half.float() + half_skip.float()  # (fla's fused prenorm: the float32 sum, not the rounded one)
    expected = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.bfloat16().float()).bfloat16()
    assert torch.equal(rms_norm_reference(half, half_skip, weight.bfloat16(), 1e-6), expected)
    leaf = x.clone().requires_grad_()
    torch.ops.specla.rms_norm(leaf, None, weight, 1e-6).square().sum().backward()
    wanted = x.clone().requires_grad_()
    F.rms_norm(wanted, (64,), weight, 1e-6).square().sum().backward()
    assert (leaf.grad - wanted.grad).abs().max() <= 1e-12
    w = torch.randn(16, 64, generator=gen, dtype=torch.float64)
    y, summed = add_norm_linear_reference(x, skip, weight, 1e-6, w, gated=True)
    gate, up = F.linear(F.rms_norm(x + skip, (64,), weight, 1e-6), w).chunk(2, -1)
    assert torch.equal(summed, x + skip) and (y - F.silu(gate) * up).abs().max() <= 1e-12
    with pytest.raises(ValueError, match="the skip must have the rows' shape"):
        add_norm_linear_reference(x, skip[:1], weight, 1e-6, w)  # (no broadcasting: the sum replaces a + b)


def test_the_gated_rms_norm_op_is_fla_s_gated_norm_and_differentiable():
    """``specla::rms_norm_gated`` (the node fla's ``FusedRMSNormGated`` becomes, which a one-token twin folds into
    o_proj): ``F.rms_norm`` times SiLU(gate) in fp64; for bf16, the float32 math the capture ran before it rounded
    once; composite, so CPU training differentiates through it; and ``gated_norm_linear``'s reference is it with
    the heads flattened, then the GEMM."""
    from specla_compile.kernels.reference import gated_norm_linear_reference, rms_norm_gated_reference

    gen = torch.Generator().manual_seed(5)
    x, gate = (torch.randn(2, 3, 4, 32, generator=gen, dtype=torch.float64) for _ in range(2))
    weight = 1 + 0.3 * torch.randn(32, generator=gen, dtype=torch.float64)
    expected = F.rms_norm(x, (32,), weight, 1e-6) * F.silu(gate)
    assert (torch.ops.specla.rms_norm_gated(x, gate, weight, 1e-6) - expected).abs().max() <= 1e-14
    half, half_gate = x.bfloat16(), gate.bfloat16()
    wide = half.float()
    before = (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.bfloat16().float()
              * F.silu(half_gate.float())).bfloat16()
    assert torch.equal(rms_norm_gated_reference(half, half_gate, weight.bfloat16(), 1e-6), before)
    leaf = x.clone().requires_grad_()
    torch.ops.specla.rms_norm_gated(leaf, gate, weight, 1e-6).square().sum().backward()
    wanted = x.clone().requires_grad_()
    (F.rms_norm(wanted, (32,), weight, 1e-6) * F.silu(gate)).square().sum().backward()
    assert (leaf.grad - wanted.grad).abs().max() <= 1e-12
    w = torch.randn(16, 128, generator=gen, dtype=torch.float64)
    assert (gated_norm_linear_reference(x, gate, weight, 1e-6, w) - F.linear(expected.flatten(-2), w)).abs().max() <= 1e-12
