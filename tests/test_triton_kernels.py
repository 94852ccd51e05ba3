"""Every Triton kernel under ``TRITON_INTERPRET=1`` on CPU against the fp64 reference (small shapes,
random trees with padding, grouped heads HV = 2H, random inputs, NaN-poisoned outputs).

Triton reads ``TRITON_INTERPRET`` when it is first imported, and other test modules import it
(through fla) during collection; so in a normal run ``test_kernels_under_interpreter`` runs this file
again in a fresh process with the variable set, where the kernel tests themselves run."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from kernel_cases import (
    NAMES,
    accepted_records,
    conv_gates_oracle,
    gates_commit_verify_oracle,
    poisoned_allocations,
    random_conv_gates_pass,
    random_gate_projections,
    random_inputs,
    random_parents,
    reference_verify,
    rel_err,
)

from specla_compile.kernels import dispatch, ops
from specla_compile.kernels import reference as ref
from specla_compile.kernels.dispatch import ROUTES, KernelConfig

pytest.importorskip("triton")
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in test_kernels_under_interpreter's process")
if INTERPRETED:
    from specla_compile.kernels import triton_attention as ta
    from specla_compile.kernels import triton_conv as tc
    from specla_compile.kernels import triton_gather as tg
    from specla_compile.kernels import triton_gemv as tgv
    from specla_compile.kernels import triton_linear as tl_
    from specla_compile.kernels import triton_topk as tk
    from specla_compile.kernels import triton_verify as tv


@pytest.mark.skipif(INTERPRETED or torch.cuda.is_available(),
                    reason="already interpreted, or CUDA present (test_gpu_kernels.py covers the compiled kernels)")
def test_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                         env=env, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout


# (topology kind, rows, real nodes, PAD tail, K, V, H, HV, l2norm, launch config)
CASES = {
    "chain": ("chain", 2, 9, 0, 16, 32, 1, 2, True, KernelConfig(block_v=16)),
    "tree_padded": ("tree", 2, 12, 3, 32, 16, 2, 4, True, KernelConfig(block_k=16)),
    "forest_no_l2": ("forest", 1, 16, 0, 32, 32, 1, 2, False, KernelConfig(block_v=32)),
    "star_padded": ("star", 2, 7, 2, 16, 16, 2, 4, True, KernelConfig()),
    "single_node": ("tree", 3, 1, 0, 16, 16, 1, 2, True, KernelConfig()),
    "single_node_wide": ("tree", 2, 1, 0, 16, 32, 1, 2, True, dispatch.kernel_config("serial", 1, pending=True)),
    "tree_16": ("tree", 1, 16, 0, 16, 32, 2, 4, True, KernelConfig(block_v=16, block_k=16)),
    # a large batch's shape: the commit as its own launch, then wide verify tiles
    "batch_split_commit": ("tree", 8, 12, 2, 16, 32, 1, 2, True, dispatch.kernel_config("parallel", 16, pending=True, batch=8)),
}
SCALE = 0.3


def case_inputs(name: str, seed: int):
    kind, rows, nodes, pad, dk, dv, heads, value_heads, l2, config = CASES[name]
    parents = random_parents(rows, nodes, seed=seed, kind=kind, padding=pad)
    x = random_inputs(parents, heads=heads, value_heads=value_heads, dk=dk, dv=dv, seed=seed, dtype=torch.float32)
    return parents, x, l2, config


@interpreted
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", CASES)
def test_verify(case, route):
    parents, x, l2, config = case_inputs(case, seed=len(case))
    state = x["state"].clone()
    with poisoned_allocations():
        o, k_hat = tv.tree_verify(*(x[n] for n in NAMES), parents, state, SCALE, l2, route=route, config=config)
    ref_o, ref_k, _ = reference_verify(x, parents, SCALE, l2)
    assert rel_err(o, ref_o) <= 1e-5
    assert rel_err(k_hat, ref_k) <= 1e-6
    assert torch.equal(state, x["state"])  # verify never writes the durable state


def in_layout(state: torch.Tensor, layout: str) -> torch.Tensor:
    """A copy of ``state [B, HV, K, V]`` stored K-major ("kv", contiguous) or V-major ("vk", as fla keeps it)."""
    return state.clone() if layout == "kv" else state.transpose(-1, -2).contiguous().transpose(-1, -2)


FUSED_CASES = [(case, route, "kv") for case in ("chain", "tree_padded", "star_padded", "tree_16") for route in ROUTES]
FUSED_CASES += [("tree_padded", route, "vk") for route in ROUTES]  # fla's V-major state, updated where it lies
FUSED_CASES += [("batch_split_commit", "parallel", layout) for layout in ("kv", "vk")]
FUSED_CASES += [("single_node_wide", "serial", "vk")]  # plain decoding's step: one node, a pending record, fla's layout


@interpreted
@pytest.mark.parametrize("case, route, layout", FUSED_CASES)
def test_fused_commit_verify(case, route, layout):
    parents, x, l2, config = case_inputs(case, seed=7)
    prev_parents, prev = case_inputs(case, seed=8)[:2]
    records, num = accepted_records(prev, prev_parents, max_accepted=6, seed=9)
    state = in_layout(x["state"], layout)
    with poisoned_allocations():
        o, k_hat = tv.tree_verify(*(x[n] for n in NAMES), parents, state, SCALE, l2, route=route, config=config,
                                  pending=tv.Pending(*records, num))
    ref_o, ref_k, ref_state = reference_verify(x, parents, SCALE, l2, pending=(records, num))
    assert rel_err(state, ref_state) <= 1e-6
    assert rel_err(o, ref_o) <= 1e-5
    assert rel_err(k_hat, ref_k) <= 1e-6


@interpreted
@pytest.mark.parametrize("case, layout", [("chain", "kv"), ("tree_padded", "vk"), ("tree_16", "kv")])
def test_the_parallel_route_commits_a_whole_accepted_path(case, layout):
    """The parallel route's fused commit of a row's whole accepted path, a part of it, none, against the fp64
    reference (the committed state and the pass's outputs)."""
    parents, x, l2, config = case_inputs(case, seed=7)
    prev_parents, prev = case_inputs(case, seed=8)[:2]
    records, _ = accepted_records(prev, prev_parents, max_accepted=16, seed=9)
    width = records.k.shape[1]
    num = torch.tensor([width, 2, 0][: parents.shape[0]])
    state = in_layout(x["state"], layout)
    with poisoned_allocations():
        o, k_hat = tv.tree_verify(*(x[n] for n in NAMES), parents, state, SCALE, l2, route="parallel",
                                  config=config,
                                  pending=tv.Pending(*records, num))
    ref_o, ref_k, ref_state = reference_verify(x, parents, SCALE, l2, pending=(records, num))
    assert width >= 5 and rel_err(state, ref_state) <= 1e-6
    assert rel_err(o, ref_o) <= 1e-5 and rel_err(k_hat, ref_k) <= 1e-6


@interpreted
@pytest.mark.parametrize("layout, source", [("kv", torch.float32), ("vk", torch.float32), ("vk", torch.float16)])
@pytest.mark.parametrize("l2, with_pending", [(True, True), (False, True), (True, False)])
def test_one_token_pass_computes_its_gates(layout, source, l2, with_pending):
    """Plain decoding's one-node pass with the gate and beta computed in its launch from strided slices of a projection
    (softplus past its threshold and far below zero included): the gates, outputs, keys and committed state against
    the fp64 oracle."""
    parents, x, _, config = case_inputs("single_node_wide", seed=11)
    prev_parents, prev = case_inputs("single_node_wide", seed=12)[:2]
    records, num = accepted_records(prev, prev_parents, max_accepted=1, seed=13)
    gates = random_gate_projections(*parents.shape, x["v"].shape[2], seed=14, dtype=source)
    pending = (records, num) if with_pending else None
    state = in_layout(x["state"], layout)
    with poisoned_allocations():
        outs = tv.commit_verify_one_token_gates(x["q"], x["k"], x["v"], gates, state, SCALE, l2, config=config,
                                                pending=tv.Pending(*records, num) if with_pending else None)
    o, k_hat, g, beta = outs
    ref_o, ref_k, ref_state, ref_g, ref_beta = gates_commit_verify_oracle(x, gates, parents, SCALE, l2, pending)
    # (each gate to 1e-5 of itself: e^-40 inherits the float32 rounding of a + dt_bias, 40 * 6e-8)
    assert ((g - ref_g) / ref_g).abs().max() <= 1e-5 and ((beta - ref_beta) / ref_beta).abs().max() <= 1e-6
    assert rel_err(o, ref_o) <= 1e-5 and rel_err(k_hat, ref_k) <= 1e-6 and rel_err(state, ref_state) <= 1e-6


@interpreted
@pytest.mark.parametrize("case, layout", [("tree_padded", "kv"), ("tree_16", "vk"), ("batch_split_commit", "kv")])
def test_the_parallel_route_computes_its_gates(case, layout):
    """A drafted pass on the parallel route with each node's gate and beta computed in its launch from strided slices
    of a projection (``fold_gates_drafted``): gates, outputs, keys and committed state against the fp64 oracle, padded
    trees and a batch whose commit runs apart included; other routes refuse gates in one line."""
    parents, x, _, _ = case_inputs(case, seed=15)
    prev_parents, prev = case_inputs(case, seed=16)[:2]
    records, num = accepted_records(prev, prev_parents, max_accepted=4, seed=17)
    gates = random_gate_projections(*parents.shape, x["v"].shape[2], seed=18, dtype=torch.float32)
    state = in_layout(x["state"], layout)
    g, beta = (torch.full(parents.shape + (x["v"].shape[2],), float("nan")) for _ in range(2))
    config = dispatch.kernel_config("parallel", parents.shape[1], pending=True, batch=parents.shape[0])
    with poisoned_allocations():
        o, k_hat = tv.tree_verify(x["q"], x["k"], x["v"], g, beta, parents, state, SCALE, True, route="parallel",
                                  pending=tv.Pending(*records, num), config=config, gates=gates)
    ref_o, ref_k, ref_state, ref_g, ref_beta = gates_commit_verify_oracle(x, gates, parents, SCALE, True, (records, num))
    assert ((g - ref_g) / ref_g).abs().max() <= 1e-5 and ((beta - ref_beta) / ref_beta).abs().max() <= 1e-6
    assert rel_err(o, ref_o) <= 1e-5 and rel_err(k_hat, ref_k) <= 1e-6 and rel_err(state, ref_state) <= 1e-6
    with pytest.raises(ValueError, match="parallel route's launch alone"):
        tv.tree_verify(x["q"], x["k"], x["v"], g, beta, parents, state, SCALE, True, route="serial", gates=gates)


@interpreted
@pytest.mark.parametrize("layout, nums", [("kv", (1, 3)), ("vk", (0, 2))])
@pytest.mark.parametrize("l2", [True, False])
def test_one_token_pass_convolves_its_projection(layout, nums, l2):
    """Plain decoding's one-node pass from the projection itself (``fold_convs``): the q/k/v short convs of strided
    slices of one output, from conv states into which each row's pending inputs commit first (none, some, the whole
    window), then the gates and the recurrence, all in one launch of two V tiles a head, against the op's fp64
    composition of the three-conv op and the gates op: outputs, records, committed conv and recurrent states; the
    counters of each head's readers back at zero."""
    case = random_conv_gates_pass(2, 2, 4, 16, nums, seed=21 + nums[0], dtype=torch.float32)
    expected, expected_conv, expected_state = conv_gates_oracle(case, SCALE, l2)
    xs, conv_states = case["xs"], case["conv_states"]
    before = [s.clone() for s in conv_states]
    state = in_layout(case["state"], layout)
    with poisoned_allocations():
        got = tv.commit_verify_one_token_conv_gates(xs, conv_states, case["weights"], case["conv_pending"], case["num"],
                                                    True, case["gates"], state, SCALE, l2,
                                                    pending=tv.Pending(*case["records"], case["num"]),
                                                    config=KernelConfig(block_v=8, num_warps=2))
    assert len(got) == len(expected) == 8
    for name, a, b in zip(("o", "k_hat", "g", "beta", "v"), got, expected):
        assert a.shape == b.shape and rel_err(a, b) <= 1e-5, name
    assert all(torch.equal(copy, x) for copy, x in zip(got[5:], xs))  # (the conv records: the inputs)
    assert all(torch.equal(s.double(), e) for s, e in zip(conv_states, expected_conv))  # (committed: values moved)
    assert not torch.equal(conv_states[0][1], before[0][1])  # (row 1 commits two inputs)
    assert rel_err(state, expected_state) <= 1e-6
    assert not tv._readers(conv_states[0], 2 * 2).any()


@interpreted
@pytest.mark.parametrize("source, conv_dtype, nums", [(torch.bfloat16, None, (1, 3)), (torch.bfloat16, None, (5, 7)),
                                                       (torch.float32, torch.bfloat16, (2, 3))])
def test_the_conv_fold_computes_what_the_unfused_kernels_do(source, conv_dtype, nums):
    """``fold_convs``' one launch against the two it replaces (the three-conv kernel, then the one-node gates kernel) on
    the same inputs: every output, record and committed state bit for bit, with pending counts past the capacity and
    conv states of another dtype than the projection (a pending input rounds to the state's dtype in both)."""
    case = random_conv_gates_pass(2, 2, 4, 16, nums, seed=5, dtype=source)
    states = [s.to(conv_dtype or s.dtype) for s in case["conv_states"]]
    fused_states, split_states = [s.clone() for s in states], [s.clone() for s in states]
    fused_state, split_state = case["state"].clone(), case["state"].clone()
    config, pending = KernelConfig(block_v=8, num_warps=2), tv.Pending(*case["records"], case["num"])
    fused = tv.commit_verify_one_token_conv_gates(case["xs"], fused_states, case["weights"], case["conv_pending"],
                                                  case["num"], True, case["gates"], fused_state, SCALE, True,
                                                  pending=pending, config=config)
    ys_rows = tc.three_tree_convs(case["xs"], split_states, case["weights"], case["conv_pending"], case["num"],
                                  case["parents"], True)
    q, k, v = ops.conv_heads(ys_rows[:3], split_state)
    split = (*tv.commit_verify_one_token_gates(q, k, v, case["gates"], split_state, SCALE, True, pending=pending,
                                               config=config), v, *ys_rows[3:])
    assert all(torch.equal(a, b) for a, b in zip(fused, split, strict=True))
    assert all(torch.equal(a, b) for a, b in zip((*fused_states, fused_state), (*split_states, split_state)))


@interpreted
@pytest.mark.parametrize("block_v, layout", [(16, "kv"), (32, "kv"), (16, "vk")])
def test_commit(block_v, layout):
    parents, x, _, _ = case_inputs("tree_padded", seed=3)
    records, num = accepted_records(x, parents, max_accepted=8, seed=4)
    assert num.min() < num.max()  # rows commit different lengths
    state = in_layout(x["state"], layout)
    tv.commit_(state, *records, num, config=KernelConfig(block_v=block_v))
    expected = ref.gdn_commit_reference(x["state"].double(), ref.FactorRecords(*(t.double() for t in records)), num)
    assert rel_err(state, expected) <= 1e-6
    assert torch.equal(state[num == 0], x["state"][num == 0])


@interpreted
@pytest.mark.parametrize("case, route", [("tree_16", "parallel"), ("chain", "serial"), ("single_node_wide", "serial"),
                                         ("tree_padded", "hybrid")])
def test_a_commit_before_the_pdl_wait_changes_nothing_else(case, route, monkeypatch):
    """Inside ``dispatch.commits_before_wait`` on a PDL device the recurrent kernels on the named states commit before
    their wait (EARLY). Off the GPU the wait is a no-op, so that code path must give, bit for bit, what the usual one
    gives: the verify routes (the hybrid keeps its wait first), the standalone commit and the one-node gates and
    conv-gates kernels."""
    parents, x, l2, config = case_inputs(case, seed=7)
    prev_parents, prev = case_inputs(case, seed=8)[:2]
    records, num = accepted_records(prev, prev_parents, max_accepted=6, seed=9)
    pending = tv.Pending(*records, num)
    conv_case = random_conv_gates_pass(2, 2, 4, 16, (1, 3), seed=21, dtype=torch.float32)
    gates = random_gate_projections(*parents.shape, x["v"].shape[2], seed=14, dtype=torch.float32)

    def launches(states: list[torch.Tensor], conv_states: list[torch.Tensor]) -> list[torch.Tensor]:
        state, committed, one_node, conv_state = states
        outs = tv.tree_verify(*(x[n] for n in NAMES), parents, state, SCALE, l2, route=route, config=config,
                              pending=pending)
        tv.commit_(committed, *records, num, config=config)
        if parents.shape[1] == 1:
            outs += tv.commit_verify_one_token_gates(x["q"], x["k"], x["v"], gates, one_node, SCALE, l2, config=config,
                                                     pending=pending)
        outs += tv.commit_verify_one_token_conv_gates(
            conv_case["xs"], conv_states, conv_case["weights"], conv_case["conv_pending"], conv_case["num"], True,
            conv_case["gates"], conv_state, SCALE, l2, pending=tv.Pending(*conv_case["records"], conv_case["num"]),
            config=KernelConfig(block_v=8, num_warps=2))
        return [*outs, *states, *conv_states]

    def fresh() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return ([x["state"].clone() for _ in range(3)] + [conv_case["state"].clone()],
                [c.clone() for c in conv_case["conv_states"]])

    usual = launches(*fresh())
    monkeypatch.setattr(tv, "enabled", lambda device: True)  # (as on a Hopper GPU: the launches would use PDL)
    states, conv_states = fresh()
    with dispatch.commits_before_wait(states):
        assert tv._pending_args(pending, states[0])[3]  # (EARLY)
        assert not tv._pending_args(pending, x["state"])[3]  # (a state not named, e.g. a copy: it waits first)
        strided = tv.Pending(torch.cat([records.k, records.k], -1)[..., ::2], *records[1:], num)
        assert not tv._pending_args(strided, states[0])[3]  # (a record copied just before the launch)
        early = launches(states, conv_states)
    assert not tv._pending_args(pending, states[0])[3]
    assert all(torch.equal(a, b) for a, b in zip(usual, early, strict=True))


@interpreted
def test_snapshot_holds_every_node_state():
    parents, x, l2, _ = case_inputs("tree_padded", seed=5)
    batch, n = parents.shape
    hv, dk, dv = x["state"].shape[1:]
    snapshot = torch.full((batch, hv, n, dk, dv), float("nan"))
    tv.tree_verify(*(x[n_] for n_ in NAMES), parents, x["state"], SCALE, l2, route="serial", snapshot=snapshot)
    _, states = ref.gdn_tree_reference(*(x[n_].double() for n_ in NAMES), parents, x["state"].double(),
                                       scale=SCALE, use_qk_l2norm=l2)
    assert rel_err(snapshot.transpose(1, 2), states) <= 1e-6


@interpreted
def test_unknown_route_and_misplaced_snapshot_are_refused():
    parents, x, l2, _ = case_inputs("chain", seed=1)
    args = (*(x[n] for n in NAMES), parents, x["state"], SCALE, l2)
    with pytest.raises(ValueError, match="unknown route"):
        tv.tree_verify(*args, route="warp")
    with pytest.raises(ValueError, match="serial route"):
        tv.tree_verify(*args, route="hybrid", snapshot=torch.empty(0))


@interpreted
@pytest.mark.parametrize("width, state_len, with_bias, silu", [(4, 3, True, True), (4, 6, False, True), (2, 1, True, False)])
@pytest.mark.parametrize("kind", ["tree", "forest", "chain"])
@pytest.mark.parametrize("transposed", [False, True])
def test_tree_conv(kind, width, state_len, with_bias, silu, transposed):
    """The tree conv and its record copy, from an input read where it lies: a column slice (state_len > 0)
    or transposed (transformers' [B, D, N] conv input: channels not adjacent)."""
    gen = torch.Generator().manual_seed(width * 10 + state_len)
    parents = random_parents(2, 13, seed=state_len, kind=kind, padding=3)
    x = torch.randn(2, 16, 40 + state_len, generator=gen)[..., state_len:]  # (a column slice when state_len > 0)
    if transposed:
        x = x.transpose(1, 2).contiguous().transpose(1, 2)
    conv_state = torch.randn(2, 40, state_len, generator=gen)
    weight = torch.randn(40, width, generator=gen)
    bias = torch.randn(40, generator=gen) if with_bias else None
    with poisoned_allocations():
        y, record = tc.tree_conv(x, conv_state, weight, bias, parents, silu, block_d=16)
    assert torch.equal(record, x) and record.is_contiguous()  # the conv's factor record, copied on the way
    expected = ref.tree_conv_reference(x.double(), conv_state.double(), weight.double(),
                                       None if bias is None else bias.double(), parents, silu=silu)
    assert rel_err(y, expected) <= 1e-6


@interpreted
@pytest.mark.parametrize("state_len, accepted", [(3, [0, 2]), (3, [5, 1]), (6, [4, 4])])
def test_commit_then_tree_conv_in_one_launch(state_len, accepted):
    gen = torch.Generator().manual_seed(state_len + 1)
    parents = random_parents(2, 9, seed=state_len, kind="tree", padding=2)
    x, pending_x = torch.randn(2, 11, 40, generator=gen), torch.randn(2, max(accepted) + 1, 40, generator=gen)
    conv_state, weight, bias = torch.randn(2, 40, state_len, generator=gen), torch.randn(40, 4, generator=gen), torch.randn(40, generator=gen)
    num = torch.tensor(accepted)
    updated = conv_state.clone()
    with poisoned_allocations():
        y, record = tc.tree_conv(x, updated, weight, bias, parents, True, pending=(pending_x, num), block_d=16)
    assert torch.equal(record, x)
    committed = ref.conv_state_commit_reference(conv_state, pending_x, num)
    assert torch.equal(updated, committed)
    expected = ref.tree_conv_reference(x.double(), committed.double(), weight.double(), bias.double(), parents, silu=True)
    assert rel_err(y, expected) <= 1e-6


@interpreted
@pytest.mark.parametrize("layout", ["contiguous", "sliced", "transposed"])
@pytest.mark.parametrize("widths", [(40, 24, 56), (16, 16, 16)])
def test_three_convs_in_one_launch(widths, layout):
    """fla's q, k and v convs (different channel counts) committed and convolved in one launch, each as
    its own commit-then-tree-conv; the inputs are read where they lie: column slices of one fused
    projection's output (with more columns after them), or transposed. The launch also returns
    contiguous copies of the inputs (the layer's conv records)."""
    gen = torch.Generator().manual_seed(sum(widths))
    parents = random_parents(2, 9, seed=3, kind="tree", padding=2)
    num = torch.tensor([3, 0])
    if layout == "sliced":
        xs = torch.randn(2, 11, sum(widths) + 5, generator=gen).split([*widths, 5], dim=-1)[:3]
    else:
        xs = [torch.randn(2, 11, d, generator=gen) for d in widths]
    if layout == "transposed":
        xs = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in xs]
    assert all(x.is_contiguous() == (layout == "contiguous") for x in xs)
    pendings = [torch.randn(2, 4, d, generator=gen) for d in widths]
    states = [torch.randn(2, d, 3, generator=gen) for d in widths]
    weights = [torch.randn(d, 4, generator=gen) for d in widths]
    updated = [s.clone() for s in states]
    with poisoned_allocations():
        outputs = tc.three_tree_convs(xs, updated, weights, pendings, num, parents, True, block_d=16)
    ys, records = outputs[:3], outputs[3:]
    assert all(torch.equal(r, x) and r.is_contiguous() for r, x in zip(records, xs))
    for x, y, state, new, weight, pending in zip(xs, ys, states, updated, weights, pendings):
        committed = ref.conv_state_commit_reference(state, pending, num)
        assert torch.equal(new, committed)
        expected = ref.tree_conv_reference(x.double(), committed.double(), weight.double(), None, parents, silu=True)
        assert rel_err(y, expected) <= 1e-6


@interpreted
@pytest.mark.parametrize("state_len, accepted", [(3, [0, 2]), (3, [5, 1]), (6, [4, 4])])
def test_conv_state_commit(state_len, accepted):
    gen = torch.Generator().manual_seed(state_len)
    conv_state = torch.randn(2, 40, state_len, generator=gen)
    x = torch.randn(2, max(accepted) + 1, 40, generator=gen)
    num = torch.tensor(accepted)
    updated = conv_state.clone()
    tc.conv_state_commit_(updated, x, num, block_d=16)
    assert torch.equal(updated, ref.conv_state_commit_reference(conv_state, x, num))


@interpreted
@pytest.mark.parametrize("rows, split", [(1, 1), (5, 2), (17, 1), (32, 4)])
def test_benchmark_gemv_matches_linear(rows, split):
    """The GEMV that benchmarks/gemv_gpu.py times against cuBLAS: x @ W^T for up to 32 rows, N and K not
    multiples of the tiles, split-K adding into a zeroed output."""
    from gemv_gpu import gemv

    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 100, generator=gen), torch.randn(40, 100, generator=gen)
    y = torch.zeros(rows, 40)
    gemv(x, w, y, block_n=16, block_k=32, split=split)
    assert rel_err(y, x.double() @ w.double().T) <= 1e-5
    with pytest.raises(ValueError, match="at most 32"):
        gemv(torch.randn(33, 100), w, torch.zeros(33, 40), block_n=16, block_k=32, split=1)


@interpreted
@pytest.mark.parametrize("rows", [1, 17])
def test_benchmark_tma_gemv_matches_linear(rows):
    """The GEMV with TMA loads that benchmarks/gemv_gpu.py --kernel tma times against cuBLAS: N and K not multiples
    of the descriptor's block (the copies read zeros past the weight's edges)."""
    from gemv_gpu import tma_gemv
    from triton.tools.tensor_descriptor import TensorDescriptor

    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 100, generator=gen), torch.randn(40, 100, generator=gen)
    y = torch.zeros(rows, 40)
    tma_gemv(x, TensorDescriptor.from_tensor(w, [16, 32]), y, stages=1)
    assert rel_err(y, x.double() @ w.double().T) <= 1e-5


@interpreted
@pytest.mark.parametrize("programs, block_n, defer_norm, persistent",
                         [(1, 16, False, True), (1, 8, True, True), (3, 16, True, False), (5, 8, False, False),
                          (2, 16, True, False), (7, 16, True, False)])
def test_benchmark_layer_stack_matches_reference(programs, block_n, defer_norm, persistent):
    """The layer-stack kernel that benchmarks/persistent_gpu.py times: 3 GDN layers (norms, fused projections,
    recurrence with gates, gated norm, o_proj, MLP) against the float64 reference. One launch a step with tiles
    dealt to fewer programs than tiles, or to more (7 programs, 4 tiles of o_proj and down: some get none), the
    fused projection's last tile partial; the norms' scales computed before each GEMV or from the squares its walk
    sums. The persistent launch (grid barriers, each GEMV's first tiles loaded before the barrier in front of it)
    runs here with one program: the interpreter runs programs one after another, so more would wait forever."""
    from persistent_gpu import PHASES, LayerStack, random_stack, reference_stack

    stack = random_stack(layers=3, hidden=64, heads=2, head_dim=32, intermediate=96, seed=programs)
    x_ref, state_ref = reference_stack(stack)
    engine = LayerStack(stack, block_n, 32, warps=4, defer_norm=defer_norm, preload=True, programs=programs)
    if persistent:
        engine.run_persistent()
    else:
        engine.run_by_step()
    assert rel_err(engine.x, x_ref) <= 1e-5 and rel_err(engine.state, state_ref) <= 1e-5
    if persistent:
        assert engine.barrier.item() == PHASES * 3  # (one arrival per step)
    assert rel_err(stack["x"], x_ref) > 0.1  # (the layers moved the residual)
    with pytest.raises(ValueError, match="does not divide"):
        LayerStack(stack, block_n, 64, warps=4, defer_norm=defer_norm, preload=True, programs=programs)


@interpreted
@pytest.mark.parametrize("lead, n, block_k", [((1, 1), 40, 32), ((1,), 64, 64), ((1, 1), 24, 16)])
def test_gated_norm_gemv(lead, n, block_k):
    """The one-row gated output norm and o_proj (``specla::gated_norm_linear``'s CUDA kernel) against fp64: each
    head's RMS and SiLU gate (a K chunk of one head, two heads, half a head), then the GEMV over output tiles (the
    last one partial) and K chunks (the next loaded first); refused in one line for two rows or heads that are not
    a power of two. (In fp32: this interpreter rounds bf16 toward zero where the GPU rounds to nearest.)"""
    gen = torch.Generator().manual_seed(n)
    x, gate = torch.randn(*lead, 2, 32, generator=gen), torch.randn(*lead, 2, 32, generator=gen)
    norm, w = 1 + 0.2 * torch.randn(32, generator=gen), torch.randn(n, 64, generator=gen)
    y = tgv.gated_norm_gemv(x, gate, norm, 1e-6, w, block_n=16, block_k=block_k, warps=4)
    assert y.shape == (*lead, n)
    assert rel_err(y, ref.gated_norm_linear_reference(x.double(), gate.double(), norm.double(), 1e-6, w.double())) <= 1e-5
    for bad_x, bad_w in ((torch.randn(2, 2, 32), w), (torch.randn(1, 3, 32), torch.randn(n, 96))):
        assert not ops.gated_norm_gemv_fits(bad_x, bad_x.clone(), norm, bad_w, block_k=32)
        with pytest.raises(ValueError, match="one contiguous row"):
            tgv.gated_norm_gemv(bad_x, bad_x.clone(), norm, 1e-6, bad_w, block_k=32)


@interpreted
@pytest.mark.parametrize("lead, inner, n, block_k", [((1, 1), 96, 40, None), ((1,), 64, 16, 16), ((), 48, 24, None)])
def test_swiglu_gemv(lead, inner, n, block_k):
    """The one-row ``silu(gate) * up`` and down projection (``specla::swiglu_linear``'s CUDA kernel) against fp64:
    the product made chunk by chunk from the two halves of the gate/up row, the GEMV over output tiles (the last
    one partial) and K chunks (32, four of 16, the 16 that divides 48); refused in one line for two rows, halves
    that do not match the weight, or an inner size no chunk of 16 or more divides."""
    gen = torch.Generator().manual_seed(inner + n)
    gate_up, w = torch.randn(*lead, 2 * inner, generator=gen), torch.randn(n, inner, generator=gen)
    assert ops.swiglu_gemv_block_k(w) == {96: 32, 64: 64, 48: 16}[inner]
    y = tgv.swiglu_gemv(gate_up, w, block_n=16, block_k=block_k, warps=4)
    assert y.shape == (*lead, n)
    assert rel_err(y, ref.swiglu_linear_reference(gate_up.double(), w.double())) <= 1e-5
    for bad_row, bad_w in ((torch.randn(2, 2 * inner), w), (torch.randn(1, 2 * inner + 2), w),
                           (torch.randn(1, 2 * 24), torch.randn(n, 24))):
        assert not ops.swiglu_gemv_fits(bad_row, bad_w)
        with pytest.raises(ValueError, match="one contiguous row"):
            tgv.swiglu_gemv(bad_row, bad_w)


@interpreted
@pytest.mark.parametrize("rows, vocab, k, block", [(3, 100, 4, 32), (2, 64, 1, 64), (5, 70, 7, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("one_block", [False, True], ids=["chunks", "one block"])
def test_vocab_top_k(rows, vocab, k, block, dtype, one_block):
    """The k best log-probabilities per row and their ids, against log_softmax + a stable sort, per chunk of
    ``block`` tokens and a merge, or a whole row in one block: random scores (several chunks, the last one
    partial, with fewer real tokens than k when k > vocab % block; a row's block padded past the vocabulary),
    then scores with ties (the lower id first, across chunks too) and masked (-inf) entries, then large ones
    (around 300, where a log-sum-exp added before the subtraction would lose the log-probabilities' digits)."""
    gen = torch.Generator().manual_seed(rows * vocab + k)
    scores = (3 * torch.randn(rows, vocab, generator=gen)).to(dtype)
    tied = torch.randint(0, 4, (rows, vocab), generator=gen).to(dtype)
    tied[:, ::5] = float("-inf")
    large = (300 + 3 * torch.randn(rows, vocab, generator=gen)).to(dtype)
    blocks = {"block": block, "row_block": tk.ROW_BLOCK if one_block else 0}
    for x in (scores, tied, large):
        log_probs, ids = tk.vocab_top_k(x, k, **blocks)
        expected_lp, expected_ids = ref.vocab_top_k_reference(x, k)
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(log_probs, expected_lp, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="1 <= k <= V"):
        tk.vocab_top_k(scores, vocab + 1, **blocks)
    if block < vocab and not one_block:
        with pytest.raises(ValueError, match="at most 16 tokens per row"):
            tk.vocab_top_k(scores, block + 1, block=16, row_block=0)


@interpreted
@pytest.mark.parametrize("rows, vocab, k", [(1, 70, 7), (4, 100, 4), (20, 33, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # (the interpreter's bf16 tl.dot is wrong)
@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
def test_linear_top_k(rows, vocab, k, dtype, bias):
    """An LM head's scores and their k best in the GEMM's launch, then the merge, against F.linear then
    log_softmax + a stable sort: scores of small integers (exact in half precision and in any summation
    order; many ties, which go to the lower id across column blocks), then random ones (fp32; the last column block
    partial, holding fewer real columns than k when k > vocab % 16; 17-32 rows take the wider row tile)."""
    gen = torch.Generator().manual_seed(rows * vocab + k)
    depth = 40
    small = lambda *shape: torch.randint(-2, 3, shape, generator=gen).to(dtype)
    cases = [(small(rows, depth), small(vocab, depth), small(vocab) if bias else None)]
    if dtype == torch.float32:
        cases.append((torch.randn(rows, depth, generator=gen), torch.randn(vocab, depth, generator=gen),
                      torch.randn(vocab, generator=gen) if bias else None))
    for x, w, b in cases:
        log_probs, ids = tk.linear_top_k(x, w, b, k)
        scores = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double()).to(dtype)
        expected_lp, expected_ids = ref.vocab_top_k_reference(scores, k)
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(log_probs, expected_lp, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="a k that linear_top_k_fits"):
        tk.linear_top_k(x, w, b, 17)
    meta = lambda *shape: torch.empty(shape, device="meta")
    # (a draft vocabulary and a whole one fit one merge; a 150k-token vocabulary's 4,748 column blocks do not)
    assert tk.linear_top_k_fits(meta(8192, 2048), 4) and tk.linear_top_k_fits(meta(32000, 1024), 4)
    assert not tk.linear_top_k_fits(meta(151936, 1024), 4) and not tk.linear_top_k_fits(meta(8192, 2048), 65)
    with pytest.raises(ValueError, match="M <= 32"):
        tk.linear_top_k(torch.zeros(33, depth, dtype=dtype), w, b, k)


@interpreted
def test_gather_paths_in_few_launches():
    """Every record's accepted path in one call, against one PyTorch gather per record: rows of 32-bit
    words (bf16 and fp32), of 16-bit words (an odd bf16 row), of bytes (int8, odd), longer than a block,
    a source that is a slice of a larger one, one whose rows are not contiguous (gathered by PyTorch), one-element
    rows whose size-1 dimension has a stride other than 1, more tensors than one launch
    takes, paths ending in -1; destinations start as NaN or garbage, so a row left unwritten fails."""
    gen = torch.Generator().manual_seed(7)
    rows, nodes, length = 2, 7, 5
    shapes = [((4, 8), torch.bfloat16), ((4,), torch.float32), ((3,), torch.bfloat16), ((5,), torch.int8),
              ((1500,), torch.float32), ((2, 3), torch.float64)] * 5  # 30 pairs: 20 of 32-bit words, two launches
    srcs = [(100 * torch.randn(rows, nodes, *shape, generator=gen)).to(dtype) for shape, dtype in shapes]
    srcs[1] = torch.randn(rows, nodes + 3, 4, generator=gen)[:, 1:-2]  # rows of a larger tensor
    srcs[2] = torch.randn(rows, nodes, 3, 2, generator=gen).to(torch.bfloat16).transpose(2, 3)  # PyTorch's gather
    srcs[5] = torch.randn(rows, 1, nodes, generator=gen, dtype=torch.float64).transpose(1, 2)  # one-element rows, stride 7
    index = torch.randint(0, nodes, (rows, length), generator=gen)
    index[1, 3:] = -1
    index[0, -1] = nodes - 1
    dsts = [torch.full((rows, length, *s.shape[2:]), float("nan")).to(s.dtype) if s.is_floating_point()
            else torch.full((rows, length, *s.shape[2:]), 77, dtype=s.dtype) for s in srcs]
    tg.gather_paths_(dsts, srcs, index)
    for dst, expected in zip(dsts, ref.gather_paths_reference(srcs, index), strict=True):
        assert torch.equal(dst, expected)
    words = {tg._widest_words(t) for t in srcs}
    assert words == {4, 2, 1}
    with pytest.raises(ValueError, match="cannot gather"):
        tg.gather_paths_([dsts[0][:, :2]], [srcs[0]], index)
    with pytest.raises(ValueError, match="cannot gather"):  # a source with fewer batch rows than the path
        tg.gather_paths_([dsts[0]], [srcs[0][:1]], index)


@interpreted
@pytest.mark.parametrize("rows, heads, queries, columns, dim, block_t, shared_mask",
                         [(2, 3, 4, 150, 32, 64, False), (1, 2, 16, 64, 24, 32, True), (3, 1, 1, 40, 16, 16, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # (the interpreter's bf16 tl.dot is wrong)
def test_draft_attention(rows, heads, queries, columns, dim, block_t, shared_mask, dtype):
    """Few queries over a masked key buffer, split across key blocks, against the fp64 reference: random
    masks (the last block partial, one block with nothing visible, one query that sees no key at all:
    zeros), queries read through a transposed view (as the EAGLE head makes them), a mask shared by every
    row, head sizes that are not powers of two; the output starts as NaN-poisoned memory and comes out with
    the heads side by side ([R, S, H, d])."""
    gen = torch.Generator().manual_seed(rows * columns + dim)
    q = torch.randn(rows, queries, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    keys, values = (torch.randn(rows, heads, columns, dim, generator=gen).to(dtype) for _ in range(2))
    mask = torch.rand(1 if shared_mask else rows, queries, columns, generator=gen) < 0.4
    mask[:, :, block_t : 2 * block_t] = False
    blind = queries > 1  # (the last query sees no key)
    mask[:, -1] &= not blind
    with poisoned_allocations():
        out = ta.draft_attention(q, keys, values, mask, 0.3, block_t=block_t)
    expected = ref.draft_attention_reference(q.double(), keys.double(), values.double(), mask, 0.3)
    assert out.dtype == dtype and out.shape == (rows, queries, heads, dim) and out.is_contiguous()  # (heads side by side)
    out = out.transpose(1, 2)
    assert torch.equal(out[:, :, -1].float(), torch.zeros(rows, heads, dim)) == blind
    assert rel_err(out, expected) <= (1e-5 if dtype == torch.float32 else 2e-3)
    with pytest.raises(ValueError, match="a bool mask"):
        ta.draft_attention(q, keys, values, mask.int(), 0.3)
    with pytest.raises(ValueError, match="one dtype for the rest"):
        ta.draft_attention(q.double(), keys, values, mask, 0.3)
    with pytest.raises(ValueError, match="at most 16 queries"):
        ta.draft_attention(torch.randn(1, 1, 17, dim), keys[:1, :1].float(), values[:1, :1].float(),
                           torch.ones(1, 17, columns, dtype=torch.bool), 0.3)


def _head_linear_inputs(rows: int, n: int, k: int, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, k, generator=gen).to(dtype), "w": (torch.randn(n, k, generator=gen) / k**0.5).to(dtype),
            "norm": (1 + 0.3 * torch.randn(k, generator=gen)).to(dtype), "bias": torch.randn(n, generator=gen).to(dtype),
            "residual": torch.randn(rows, n, generator=gen).to(dtype), "table": torch.randn(7, n, generator=gen).to(dtype),
            "ids": torch.randint(0, 7, (rows,), generator=gen)}


@interpreted
@pytest.mark.parametrize("rows, dtype", [(1, torch.float32), (5, torch.float16), (20, torch.float32)])
@pytest.mark.parametrize("residual", [False, True], ids=["no residual", "residual"])
def test_split_linear_sums_its_depth_slices_in_order(rows, dtype, residual):
    """A deep, narrow weight (a down projection) split along its depth: a depth of 4,100 in four slices (the last
    one partial), 40 columns (two 32-column blocks, the last partial), with and without the residual, against
    fp64 PyTorch; each block's last program sums the NaN-poisoned partials' buffer only where the programs wrote,
    the block counters are back at zero after the launch, and a second launch gives the same bits."""
    assert [ops.linear_split(torch.empty(shape, device="meta")) for shape in ((40, 4100), (1024, 8192), (2048, 8192),
                                                                             (1024, 2048))] == [4, 8, 1, 1]
    assert [ops.linear_split(torch.empty(shape, dtype=torch.int8, device="meta"))
            for shape in ((2048, 8192), (4096, 8192))] == [8, 1]  # (int8: up to 2,048 columns)
    t = _head_linear_inputs(rows, 40, 4100, dtype, rows)
    with poisoned_allocations():
        y = tl_.linear(t["x"], t["w"], residual=t["residual"] if residual else None)
        again = tl_.linear(t["x"], t["w"], residual=t["residual"] if residual else None)
    expected = t["x"].double() @ t["w"].double().T + (t["residual"].double() if residual else 0)
    assert y.dtype == dtype and y.shape == (rows, 40)
    assert rel_err(y, expected) <= (1e-5 if dtype == torch.float32 else 2e-3)
    assert torch.equal(y, again)
    assert not tl_._counts[y.device].any()


@interpreted
@pytest.mark.parametrize("rows, dtype, split", [(1, torch.float32, 3), (5, torch.float16, 4), (16, torch.float16, None),
                                               (20, torch.float32, 2)])
def test_swiglu_linear_sums_the_products_depth_slices(rows, dtype, split):
    """An MLP's ``silu(gate) * up`` and down projection in one split launch: packed [gate, up] rows of depth 600 in
    256-deep steps (three, the last partial) split 2-4 ways (four: the last slice empty) over 40 columns (two 32-column
    blocks, the last partial), or with the default tiles and split (one slice at this depth: one partial 64-column
    block), against fp64 PyTorch with the product rounded to the rows' dtype, as inductor's kernel of it writes it;
    NaN-poisoned partials, the block counters back at zero, the same bits from a second launch."""
    gen = torch.Generator().manual_seed(rows)
    gate_up = (2 * torch.randn(rows, 1200, generator=gen)).to(dtype)
    weight = (torch.randn(40, 600, generator=gen) / 600**0.5).to(dtype)
    with poisoned_allocations():
        tiles = None if split is None else (32, 256, 4)
        y = tl_.swiglu_linear(gate_up, weight, split=split, tiles=tiles, warps=4)
        again = tl_.swiglu_linear(gate_up, weight, split=split, tiles=tiles, warps=4)
    gate, up = gate_up.double().chunk(2, dim=-1)
    expected = (torch.nn.functional.silu(gate) * up).to(dtype).double() @ weight.double().T
    assert y.dtype == dtype and y.shape == (rows, 40)
    assert rel_err(y, expected) <= (1e-5 if dtype == torch.float32 else 2e-3)
    assert torch.equal(y, again)
    assert not tl_._counts[y.device].any()
    with pytest.raises(ValueError, match="swiglu_linear takes"):
        tl_.swiglu_linear(gate_up[:, :1000], weight)


@interpreted
@pytest.mark.parametrize("rows, n, dtype", [(rows, 40, dtype) for rows in (1, 5, 16) for dtype in (torch.float32, torch.float16)]
                         + [(5, 2100, torch.float32)])  # (fp16, not bf16: the interpreter's bf16 tl.dot is wrong)
@pytest.mark.parametrize("norm, bias, residual", [(False, False, None), (True, False, None), (False, True, "rows"),
                                                  (False, False, "table"), (True, True, "table")])
def test_head_linear(rows, n, dtype, norm, bias, residual):
    """A few rows through a weight with the head's norm before and its bias and residual (own rows, or rows of a
    table picked by index) after, in one launch, against fp64 PyTorch: random inputs, a depth of 300 (two
    256-deep steps, or three 128-deep ones, the last partial), 40 output columns (three 16-column programs, the
    last partial) or 2,100 (the 32-column tiles of a wide weight, as q/k/v's), NaN-poisoned outputs."""
    t = _head_linear_inputs(rows, n, 300, dtype, rows + 3 * norm + 5 * bias)
    d = {name: v.double() if v.is_floating_point() else v for name, v in t.items()}
    kwargs = {"bias": t["bias"] if bias else None, "norm_weight": t["norm"] if norm else None, "eps": 1e-5,
              "residual": {"rows": t["residual"], "table": t["table"], None: None}[residual],
              "residual_rows": t["ids"] if residual == "table" else None}
    with poisoned_allocations():
        y = tl_.linear(t["x"], t["w"], **kwargs)
    h = torch.nn.functional.rms_norm(d["x"], (300,), d["norm"], 1e-5) if norm else d["x"]
    expected = torch.nn.functional.linear(h, d["w"], d["bias"] if bias else None)
    expected = expected + {"rows": d["residual"], "table": d["table"][t["ids"]], None: 0}[residual]
    assert y.dtype == dtype and y.shape == (rows, n)
    assert rel_err(y, expected) <= (1e-5 if dtype == torch.float32 else 2e-3)


@interpreted
@pytest.mark.parametrize("rows, n", [(3, 24), (16, 1030)])
@pytest.mark.parametrize("norm", [False, True])
def test_head_gated_linear(rows, n, norm):
    """``silu(gate) * up`` of a packed gate/up weight in one launch, against fp64 PyTorch: both tile shapes (16 and
    32 columns per program; 1,030 of them leave the last block partial), with and without the norm before."""
    t = _head_linear_inputs(rows, 2 * n, 300, torch.float32, rows + n + norm)
    d = {name: v.double() for name, v in t.items() if v.is_floating_point()}
    with poisoned_allocations():
        y = tl_.gated_linear(t["x"], t["w"], t["norm"] if norm else None, 1e-5)
    if norm:
        expected = ref.norm_gated_linear_reference(d["x"], d["norm"], 1e-5, d["w"])
    else:
        gate, up = torch.nn.functional.linear(d["x"], d["w"]).chunk(2, dim=-1)
        expected = torch.nn.functional.silu(gate) * up
    assert y.shape == (rows, n) and rel_err(y, expected) <= 1e-5


@interpreted
@pytest.mark.parametrize("rows, heads, dim, dtype", [(3, 3, 16, torch.float32), (16, 2, 32, torch.float16),
                                                     (20, 2, 32, torch.float32), (32, 1, 64, torch.float16)])
def test_gated_norm_linear_of_a_few_rows(rows, heads, dim, dtype):
    """A drafted pass's gated output norm and o_proj in one launch (``specla::gated_norm_linear``'s few-row kernel)
    against fp64 PyTorch: each head normalised and gated in its own step (one to three of them), up to 16 rows in a
    16-row tile and 17-32 in a 32-row one, 40 output columns (three 16-column programs, the last partial), the gate
    read where it lies in a packed projection's rows, into NaN-poisoned memory; refused in one line for 33 rows, heads
    that are not a power of two from 16 to 256, or a gate strided within a row. (fp16, not bf16: the interpreter's
    bf16 tl.dot is wrong.)"""
    gen = torch.Generator().manual_seed(rows + heads)
    x = torch.randn(rows, heads, dim, generator=gen).to(dtype)
    gate = torch.randn(rows, 3 * heads * dim, generator=gen).to(dtype)[:, heads * dim : 2 * heads * dim].view(rows, heads, dim)
    norm = (1 + 0.3 * torch.randn(dim, generator=gen)).to(dtype)
    w = (torch.randn(40, heads * dim, generator=gen) / (heads * dim) ** 0.5).to(dtype)
    with poisoned_allocations():
        y = tl_.gated_norm_linear(x, gate, norm, 1e-5, w, block_n=16)
    d = lambda t: t.double()
    assert y.dtype == dtype and y.shape == (rows, 40)
    assert rel_err(y, ref.gated_norm_linear_reference(d(x), d(gate), d(norm), 1e-5, d(w))) <= (
        1e-5 if dtype == torch.float32 else 2e-3)
    many, odd = torch.randn(33, heads, dim).to(dtype), torch.randn(rows, 2, 24).to(dtype)
    strided = torch.randn(rows, heads, 2 * dim).to(dtype)[..., :dim]
    for bad_x, bad_gate, bad_norm, bad_w in ((many, many, norm, w), (odd, odd, norm[:24], w[:, :48].contiguous()),
                                             (x, strided, norm, w)):
        with pytest.raises(ValueError, match="gated_norm_linear takes up to 32 rows of heads"):
            tl_.gated_norm_linear(bad_x, bad_gate, bad_norm, 1e-5, bad_w)


@interpreted
@pytest.mark.parametrize("rows", [3, 16, 20, 32])
@pytest.mark.parametrize("gated", [False, True])
def test_linear_adds_a_skip_before_its_norm_and_writes_the_sum(rows, gated):
    """A residual stream's add, the norm after it and the GEMM after that (and ``silu(gate) * up``) in one launch,
    against fp64 PyTorch: up to 16 rows in one 16-row tile, 17-32 in a 32-row one; the sum, rounded to the rows'
    dtype, written once (by the first program) into NaN-poisoned memory."""
    t = _head_linear_inputs(rows, 2 * 40, 300, torch.float32, rows + gated)
    skip = torch.randn(rows, 300, generator=torch.Generator().manual_seed(rows))
    summed = torch.full_like(skip, float("nan"))
    weight = t["w"] if gated else t["w"][:40]
    with poisoned_allocations():
        y = (tl_.gated_linear if gated else tl_.linear)(t["x"], weight, norm_weight=t["norm"], eps=1e-5, skip=skip,
                                                         skip_sum=summed)
    expected, _ = ref.add_norm_linear_reference(t["x"].double(), skip.double(), t["norm"].double(), 1e-5, weight.double(),
                                                gated=gated)
    assert y.shape == (rows, 40) and rel_err(y, expected) <= 1e-5
    assert torch.equal(summed, t["x"] + skip)


@interpreted
@pytest.mark.parametrize("rows, dtype", [(3, torch.float32), (5, torch.float16), (20, torch.float32)])
def test_int8_weights_scale_each_output_column(rows, dtype):
    """Weight-only int8 (``reference.quantize_rows``, per output row) in every head kernel, against fp64 PyTorch of
    the integers times their scales: a plain GEMM, one with the norm before and the bias and table rows after, the
    gated gate/up (its two halves' scales apart; with its norm too), a depth split four ways with its residual, and a
    tree level's LM head with its bias and top-k; rows of weights a few times apart in size, random inputs."""
    gen = torch.Generator().manual_seed(rows)
    tol = 1e-5 if dtype == torch.float32 else 2e-3

    def int8(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, scale = ref.quantize_rows(torch.randn(n, k, generator=gen) * (0.2 + 4 * torch.rand(n, 1, generator=gen)))
        return q, scale, q.double() * scale.double()[:, None]

    t = _head_linear_inputs(rows, 40, 300, dtype, rows)
    d = {name: v.double() if v.is_floating_point() else v for name, v in t.items()}
    q, scale, w = int8(40, 300)
    with poisoned_allocations():
        plain = tl_.linear(t["x"], q, weight_scale=scale)
        full = tl_.linear(t["x"], q, t["bias"], t["table"], t["ids"], t["norm"], 1e-5, weight_scale=scale)
    assert rel_err(plain, d["x"] @ w.T) <= tol
    from specla_compile.kernels import cuda  # (the op's CUDA path: an int8 LM head's scores with their bias)

    assert rel_err(cuda._linear(t["x"], q, scale, t["bias"]), d["x"] @ w.T + d["bias"]) <= tol
    normed = torch.nn.functional.rms_norm(d["x"], (300,), d["norm"], 1e-5)
    assert rel_err(full, torch.nn.functional.linear(normed, w, d["bias"]) + d["table"][t["ids"]]) <= tol
    q, scale, w = int8(80, 300)
    gate, up = (d["x"] @ w.T).chunk(2, dim=-1)
    assert rel_err(tl_.gated_linear(t["x"], q, weight_scale=scale), torch.nn.functional.silu(gate) * up) <= tol
    assert rel_err(tl_.gated_linear(t["x"], q, t["norm"], 1e-5, weight_scale=scale),
                   ref.norm_gated_linear_reference(d["x"], d["norm"], 1e-5, w)) <= tol
    q, scale, w = int8(40, 4100)
    x = torch.randn(rows, 4100, generator=gen).to(dtype)
    assert rel_err(tl_.linear(x, q, residual=t["residual"], weight_scale=scale),
                   x.double() @ w.T + d["residual"]) <= tol
    assert not tl_._counts[x.device].any()
    q, scale, w = int8(2100, 2048)  # (a wide weight at depth 2,048: int8 steps twice as deep)
    assert tl_._tiles(2100, 2048, int8=True)[1] == 2 * tl_._tiles(2100, 2048)[1]
    x = torch.randn(rows, 2048, generator=gen).to(dtype)
    assert rel_err(tl_.linear(x, q, weight_scale=scale), x.double() @ w.T) <= tol
    q, scale, w = int8(100, 300)
    bias = torch.randn(100, generator=gen).to(dtype)
    log_probs, ids = tk.linear_top_k(t["x"], q, bias, 4, scale)
    expected_lp, expected_ids = ref.vocab_top_k_reference(d["x"] @ w.T + bias.double(), 4)
    assert torch.allclose(log_probs, expected_lp, atol=50 * tol)  # (scores near 50: fp16 rounds them by 0.03)
    if dtype == torch.float32:  # (half precision's rounded scores may reorder near-ties)
        assert torch.equal(ids, expected_ids)
    if dtype == torch.float16:  # (the op on a weight too wide for one merge: int8 scores from the GEMM, then top-k)
        q, scale, w = int8(4200, 300)
        bias = torch.randn(4200, generator=gen).to(dtype)
        assert not tk.linear_top_k_fits(q, 32)
        log_probs, ids = cuda._linear_top_k(t["x"], q, bias, 32, scale)
        # (on the CPU its GEMM is the reference's: the weight dequantized in fp16, three roundings of ~5e-4 each)
        scores = d["x"] @ w.T + bias.double()
        torch.testing.assert_close(log_probs, ref.vocab_top_k_reference(scores, 32)[0].float(),
                                   atol=3e-3 * scores.abs().max().item(), rtol=0)
    with pytest.raises(ValueError, match="an int8 weight with its scale"):
        tl_.linear(t["x"], q)
    with pytest.raises(ValueError, match="scale in float32"):
        tl_.linear(t["x"], q, weight_scale=scale.double())


@interpreted
def test_head_linear_ops_take_strided_indices_and_large_activations():
    """Through the ops' CUDA implementations (the kernels under the interpreter), in fp16: token ids that are a
    column of a wider buffer (a drafter's level-0 tokens: a strided view) pick their own table rows, and rows of
    activations in the thousands, times a norm weight of 8, normalize before they round (no inf)."""
    from specla_compile.kernels import cuda

    t = _head_linear_inputs(4, 40, 300, torch.float16, 0)
    buffer = torch.randint(0, 7, (4, 9), generator=torch.Generator().manual_seed(1))
    ids = buffer[:, -1:]  # [4, 1], row stride 9
    y = cuda._linear_add(t["x"][:, None], t["w"], None, t["table"], ids)
    expected = ref.linear_add_reference(t["x"].double()[:, None], t["w"].double(), None, t["table"].double(), ids)
    assert rel_err(y, expected) <= 2e-3
    large, norm = 3000 * t["x"], torch.full((300,), 8.0, dtype=torch.float16)
    for out, want in ((cuda._norm_linear(large, norm, 1e-5, t["w"]), ref.norm_linear_reference),
                      (cuda._norm_gated_linear(large, norm, 1e-5, t["w"]), ref.norm_gated_linear_reference)):
        assert rel_err(out, want(large.double(), norm.double(), 1e-5, t["w"].double())) <= 2e-3


@interpreted
def test_head_linear_refuses_what_it_cannot_take():
    x, w = torch.randn(33, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="M <= 32"):
        tl_.linear(x, w)
    with pytest.raises(ValueError, match="contiguous"):
        tl_.linear(x[:4, ::2].contiguous().t(), torch.randn(4, 4))
    with pytest.raises(ValueError, match="residual must be"):
        tl_.linear(x[:4], w, residual=torch.randn(3, 4))
    with pytest.raises(ValueError, match=r"contiguous residual_rows \[4\]"):  # (a strided view would read other rows)
        tl_.linear(x[:4], w, residual=torch.randn(7, 4), residual_rows=torch.zeros(4, 2, dtype=torch.long)[:, 0])
    with pytest.raises(ValueError, match="one dtype"):
        tl_.linear(x[:4].half(), w)
    with pytest.raises(ValueError, match="an even count"):
        tl_.gated_linear(x[:4], torch.randn(5, 8))
    with pytest.raises(ValueError, match="a skip and its sum's output together"):
        tl_.linear(x[:4], w, skip=x[4:8])
    skip = torch.randn(4, 8)
    with pytest.raises(ValueError, match="memory of its own"):  # (program 0 would write it while others read it)
        tl_.linear(x[:4].contiguous(), w, norm_weight=torch.ones(8), skip=skip, skip_sum=skip)
    with pytest.raises(ValueError, match="float32 or bfloat16 rows only"):
        tl_.linear(x[:4].half(), w.half(), skip=x[4:8].half(), skip_sum=x[:4].half())
