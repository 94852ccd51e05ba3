"""The CUDA implementations of the ops (Triton kernels) at real shapes against the fp64 reference.

K = V = 256, 8 value heads over 4 query/key heads, up to 64 nodes, random trees with padding, bf16
inputs, fp32 state, outputs NaN-poisoned. Skipped without CUDA. Tolerances (relative Frobenius error):
``o`` 1e-2 (a bf16 output's own rounding is ~2e-3 and the parallel route multiplies bf16-derived
operands in tf32), ``k_hat`` and committed states 1e-5 (fp32 arithmetic); fp32 inputs 1e-4 for ``o``.
"""

from __future__ import annotations

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

from specla_compile.kernels import cuda_gemv, dispatch, ops, pdl, triton_gemv, triton_linear, triton_topk, triton_verify
from specla_compile.kernels import reference as ref
from specla_compile.kernels.dispatch import ROUTES, KernelConfig, use_route

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# (topology kind, rows, real nodes, PAD tail)
CASES = {
    "single": ("tree", 2, 1, 0),
    "chain8": ("chain", 2, 8, 0),
    "chain16": ("chain", 1, 16, 0),
    "tree16_padded": ("tree", 2, 13, 3),
    "star24_padded": ("star", 1, 20, 4),
    "forest33": ("forest", 2, 33, 0),
    "tree64_padded": ("tree", 2, 60, 4),
}
HEADS, VALUE_HEADS, DIM = 4, 8, 256
SCALE = DIM**-0.5
O_TOL, EXACT_TOL = 1e-2, 1e-5


def inputs(case: str, seed: int, dtype: torch.dtype = torch.bfloat16):
    kind, rows, nodes, pad = CASES[case]
    parents = random_parents(rows, nodes, seed=seed, kind=kind, padding=pad).cuda()
    x = random_inputs(parents, heads=HEADS, value_heads=VALUE_HEADS, dk=DIM, dv=DIM, seed=seed, dtype=dtype, device="cuda")
    return parents, x


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", CASES)
def test_verify(case, route):
    parents, x = inputs(case, seed=1)
    state = x["state"].clone()
    with poisoned_allocations(), use_route(route):
        o, k_hat = ops.gdn_tree_verify(*(x[n] for n in NAMES), parents, state, SCALE, True)
    ref_o, ref_k, _ = reference_verify(x, parents, SCALE, True)
    assert o.dtype == torch.bfloat16 and k_hat.dtype == torch.float32
    assert rel_err(o, ref_o) <= O_TOL
    assert rel_err(k_hat, ref_k) <= EXACT_TOL
    assert torch.equal(state, x["state"])


@pytest.mark.parametrize("case, v_major", [("single", False), ("single", True), ("chain8", False), ("tree16_padded", True)])
def test_gates_commit_verify(case, v_major, monkeypatch):
    """The recurrence with the gates computed from bf16 projection slices (``fold_gates``, ``fold_gates_drafted``): a
    one-node pass in one launch of its own kernel (also on fla's V-major state), an 8-node chain and a padded 16-node
    tree in the parallel route's launch; against the fp64 oracle (beta to 2e-6: the GPU's sigmoid is approximate)."""
    parents, x = inputs(case, seed=6)
    prev_parents, prev = inputs(case, seed=7)
    records, num = accepted_records(prev, prev_parents, max_accepted=4, seed=8)
    gates = random_gate_projections(*parents.shape, VALUE_HEADS, seed=9, dtype=torch.bfloat16, device="cuda")
    launches = []
    kernel, verify = triton_verify.commit_verify_one_token_gates, triton_verify.tree_verify
    monkeypatch.setattr(triton_verify, "commit_verify_one_token_gates", lambda *a, **kw: launches.append(1) or kernel(*a, **kw))
    monkeypatch.setattr(triton_verify, "tree_verify", lambda *a, **kw: launches.append(kw.get("gates") is not None and
                                                                                      kw["route"]) or verify(*a, **kw))
    state = x["state"].transpose(-1, -2).contiguous().transpose(-1, -2) if v_major else x["state"].clone()
    with poisoned_allocations():
        o, k_hat, g, beta = ops.gdn_gates_commit_verify_(state, *records, num, x["q"], x["k"], x["v"], *gates, parents, SCALE, True)
    ref_o, ref_k, ref_state, ref_g, ref_beta = gates_commit_verify_oracle(x, gates, parents, SCALE, True, (records, num))
    assert ((g - ref_g) / ref_g).abs().max() <= 1e-5 and ((beta - ref_beta) / ref_beta).abs().max() <= 2e-6
    assert rel_err(o, ref_o) <= O_TOL and rel_err(k_hat, ref_k) <= EXACT_TOL and rel_err(state, ref_state) <= EXACT_TOL
    assert launches == ([1] if case == "single" else ["parallel"])


@pytest.mark.parametrize("nums, v_major", [((1,), False), ((1,), True), ((1, 0, 2, 3), False)])
def test_conv_gates_commit_verify(nums, v_major, monkeypatch):
    """The one-node pass from its projection (``fold_convs``) with heads of 256 (8 value heads on 4 key heads, a bf16
    projection, a float32 state, also fla's V-major one; 1 and 4 rows): one launch against the fp64 composition
    (whose convs do not round to bf16); then 100 launches in a row from the same states, each output bit for bit the
    first's and every commit exact. Each key head's q/k conv windows are read by 32 programs (16 V tiles of 2 value
    heads) and committed by the last of them: a commit before every program had read them would show here."""
    case = random_conv_gates_pass(len(nums), HEADS, VALUE_HEADS, DIM, nums, seed=10, dtype=torch.bfloat16, device="cuda")
    expected, expected_conv, expected_state = conv_gates_oracle(case, SCALE, True)
    before = [s.clone() for s in (*case["conv_states"], case["state"])]
    launches = []
    kernel = triton_verify.commit_verify_one_token_conv_gates
    monkeypatch.setattr(triton_verify, "commit_verify_one_token_conv_gates", lambda *a, **kw: launches.append(1) or kernel(*a, **kw))

    def run():
        for tensor, saved in zip((*case["conv_states"], case["state"]), before):
            tensor.copy_(saved)
        state = case["state"].transpose(-1, -2).contiguous().transpose(-1, -2) if v_major else case["state"]
        out = ops.gdn_conv_gates_commit_verify_(case["conv_states"], case["conv_pending"], case["xs"], case["weights"], True,
                                                state, *case["records"], case["num"], *case["gates"], case["parents"], SCALE,
                                                True)
        return out, state

    with poisoned_allocations():
        got, state = run()
    for name, a, b in zip(("o", "k_hat", "g", "beta", "v"), got, expected):
        assert a.shape == b.shape and rel_err(a, b) <= (1e-5 if name in ("g", "beta") else O_TOL), name
    assert all(torch.equal(copy, x) for copy, x in zip(got[5:], case["xs"]))
    assert rel_err(state, expected_state) <= EXACT_TOL
    first = [t.clone() for t in got[:5]]
    for _ in range(100):  # (an early commit would change another program's q/k: its outputs, not the states)
        again, _ = run()
        assert all(torch.equal(a, b) for a, b in zip(again[:5], first))
        assert all(torch.equal(s.double(), e) for s, e in zip(case["conv_states"], expected_conv))
    assert len(launches) == 101


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", ["chain8", "tree16_padded", "forest33", "tree64_padded"])
def test_fp32_inputs(case, route):
    parents, x = inputs(case, seed=2, dtype=torch.float32)
    with poisoned_allocations(), use_route(route):
        o, _ = ops.gdn_tree_verify(*(x[n] for n in NAMES), parents, x["state"], SCALE, False)
    assert rel_err(o, reference_verify(x, parents, SCALE, False)[0]) <= 1e-4


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", ["chain8", "tree16_padded", "tree64_padded"])
def test_fused_commit_verify(case, route):
    parents, x = inputs(case, seed=3)
    prev_parents, prev = inputs(case, seed=4)
    records, num = accepted_records(prev, prev_parents, max_accepted=8, seed=5)
    state = x["state"].clone()
    with poisoned_allocations(), use_route(route):
        o, k_hat = ops.gdn_commit_verify_(state, *records, num, *(x[n] for n in NAMES), parents, SCALE, True)
    ref_o, ref_k, ref_state = reference_verify(x, parents, SCALE, True, pending=(records, num))
    assert rel_err(state, ref_state) <= EXACT_TOL
    assert rel_err(o, ref_o) <= O_TOL
    assert rel_err(k_hat, ref_k) <= EXACT_TOL


def test_commit():
    parents, x = inputs("tree64_padded", seed=6)
    records, num = accepted_records(x, parents, max_accepted=8, seed=7)
    state = x["state"].clone()
    ops.gdn_commit_(state, *records, num)
    expected = ref.gdn_commit_reference(x["state"].double(), ref.FactorRecords(*(t.double() for t in records)), num)
    assert rel_err(state, expected) <= EXACT_TOL


SWEEP = {  # every launch shape benchmarks/bench_kernels.py --sections sweep measures
    "serial": [KernelConfig(8, 1), KernelConfig(8, 2), KernelConfig(16, 2), KernelConfig(16, 4)],
    "hybrid": [KernelConfig(8, 1), KernelConfig(8, 2), KernelConfig(16, 4)],
    "parallel": [KernelConfig(64, 4, 32), KernelConfig(32, 4, 64), KernelConfig(64, 8, 32), KernelConfig(128, 4, 32),
                 KernelConfig(128, 8, 32), KernelConfig(16, 4, 64), KernelConfig(16, 2, 64),
                 KernelConfig(16, 2, 32)],
}


@pytest.mark.parametrize("route, config", [(r, c) for r, cs in SWEEP.items() for c in cs])
def test_launch_configs(route, config):
    """Every launch shape the benchmark sweeps computes the same function."""
    from specla_compile.kernels import triton_verify

    parents, x = inputs("forest33", seed=8)
    with poisoned_allocations():
        o, _ = triton_verify.tree_verify(*(x[n] for n in NAMES), parents, x["state"], SCALE, True, route=route, config=config)
    assert rel_err(o, reference_verify(x, parents, SCALE, True)[0]) <= O_TOL


@pytest.mark.parametrize("config", [KernelConfig(32, 4, 64), KernelConfig(64, 4, 32), KernelConfig(16, 4, 64),
                                    *(dispatch.kernel_config("parallel", 16, pending=True, batch=b) for b in (1, 4, 16))])
def test_fused_parallel_launch_configs(config):
    parents, x = inputs("tree16_padded", seed=14)
    _check_parallel_commit_verify(parents, x, *accepted_records(x, parents, max_accepted=6, seed=15), config)


def _check_parallel_commit_verify(parents, x, records, num, config: KernelConfig) -> None:
    """The parallel route's fused commit and verify under ``config`` against fp64: the committed state, the outputs."""
    from specla_compile.kernels import triton_verify

    state = x["state"].clone()
    with poisoned_allocations():
        o, _ = triton_verify.tree_verify(*(x[n] for n in NAMES), parents, state, SCALE, True, route="parallel",
                                         config=config, pending=triton_verify.Pending(*records, num))
    ref_o, _, ref_state = reference_verify(x, parents, SCALE, True, pending=(records, num))
    assert rel_err(state, ref_state) <= EXACT_TOL
    assert rel_err(o, ref_o) <= O_TOL


@pytest.mark.parametrize("case, config", [("chain16", dispatch.kernel_config("parallel", 16, pending=True)),
                                          ("tree16_padded", KernelConfig(64, 4, 32))])
def test_the_parallel_route_commits_a_whole_accepted_path(case, config):
    """The fused commit at the 1.3B shape's heads (K = V = 256): the committed state exact against fp64 for a row's
    path of 13 records (an oracle chain's L = 12 pass) and a second row's 2."""
    parents, x = inputs(case, seed=16)
    rows = parents.shape[0]
    paths = [accepted_records(*reversed(inputs("chain16", seed=17 + r)), max_accepted=13, seed=18)[0] for r in range(rows)]
    records = ref.FactorRecords(*(torch.cat(fields) for fields in zip(*paths)))  # (a 13-record path a row)
    _check_parallel_commit_verify(parents, x, records, torch.tensor([13, 2][:rows], device="cuda"), config)


@pytest.mark.parametrize("route", ROUTES)
def test_cuda_graph_replay(route):
    """Topology and inputs are device tensors read inside the kernels: a captured graph replays new
    drafts (new parents too) without recapture, and capture itself needs no host synchronization."""
    parents, x = inputs("tree16_padded", seed=9)
    records, num = accepted_records(x, parents, max_accepted=4, seed=10)
    static = {n: t.clone() for n, t in x.items()}
    static_parents, static_num = parents.clone(), num.clone()
    with use_route(route):
        ops.gdn_commit_verify_(static["state"].clone(), *records, static_num, *(static[n] for n in NAMES), static_parents, SCALE, True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o, _ = ops.gdn_commit_verify_(static["state"], *records, static_num, *(static[n] for n in NAMES),
                                          static_parents, SCALE, True)
    new_parents, new = inputs("tree16_padded", seed=11)
    for n, t in new.items():
        static[n].copy_(t)
    static_parents.copy_(new_parents)
    static_num.copy_(num.flip(0))
    graph.replay()
    ref_o, _, ref_state = reference_verify(new, new_parents, SCALE, True, pending=(records, num.flip(0)))
    assert rel_err(o, ref_o) <= O_TOL
    assert rel_err(static["state"], ref_state) <= EXACT_TOL


@pytest.mark.parametrize("case, route", [("chain8", "parallel"), ("single", "serial"), ("chain8", "serial")])
def test_a_commit_before_the_pdl_wait_replays_exactly(case, route):
    """Captured inside ``dispatch.commits_before_wait``, a pass's layer (its inputs written, then the fused commit and
    verify, whose commit runs before its PDL wait on Hopper) replayed back to back on new inputs, each replay
    committing the records again on the state the one before left: every replay's outputs and state against the fp64
    reference. (The copies are memcpy nodes, which nothing overlaps: the overlap with a PDL kernel before is the
    engine tests' captured passes, whose conv kernels write the inputs.)"""
    parents, x = inputs(case, seed=19)
    records, num = accepted_records(x, parents, max_accepted=parents.shape[1], seed=20)
    sources = {n: torch.stack([inputs(case, seed=21 + r)[1][n] for r in range(4)]) for n in NAMES}
    static, step = {n: t.clone() for n, t in x.items()}, torch.zeros((), dtype=torch.long, device="cuda")
    state = x["state"].clone()
    with use_route(route), dispatch.commits_before_wait([state]):
        early = triton_verify._pending_args(triton_verify.Pending(*records, num), state)[3]
        assert early or not pdl.enabled(state.device)

        def layer():
            for n in NAMES:  # (the kernel just before the verify writes its inputs, not its state or records)
                static[n].copy_(sources[n].index_select(0, step)[0])
            return ops.gdn_commit_verify_(state, *records, num, *(static[n] for n in NAMES), parents, SCALE, True)

        layer()  # (compiles the kernels; commits once)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o, _ = layer()
    for r in range(4):
        before = state.clone()
        step.fill_(r)
        graph.replay()
        new = {n: sources[n][r] for n in NAMES}
        ref_o, _, ref_state = reference_verify({**new, "state": before}, parents, SCALE, True, pending=(records, num))
        assert rel_err(o, ref_o) <= O_TOL and rel_err(state, ref_state) <= EXACT_TOL, r


def test_float64_state_runs_the_reference():
    parents, x = inputs("chain8", seed=12, dtype=torch.float64)
    state = x["state"].double()
    o, _ = ops.gdn_tree_verify(*(x[n] for n in NAMES), parents, state, SCALE, True)
    assert rel_err(o, reference_verify({**x, "state": state}, parents, SCALE, True)[0]) <= 1e-12


@pytest.mark.parametrize("case", ["chain16", "tree64_padded", "forest33"])
@pytest.mark.parametrize("sliced", [False, True])
def test_three_convs_in_one_launch_on_the_gpu(case, sliced):
    """fla's q, k, v convs (value width twice the key width, as in GDN) through the one-launch op, each
    against its own commit and fp64 tree conv; ``sliced``: the inputs are column slices of one fused
    projection's output, as the compiled twins pass them (read in place)."""
    parents, _ = inputs(case, seed=14)
    gen = torch.Generator().manual_seed(3)
    batch, n = parents.shape
    widths = (HEADS * DIM, HEADS * DIM, 2 * HEADS * DIM)
    if sliced:
        xs = torch.randn(batch, n, sum(widths) + 16, generator=gen).bfloat16().cuda().split([*widths, 16], dim=-1)[:3]
    else:
        xs = [torch.randn(batch, n, d, generator=gen).bfloat16().cuda() for d in widths]
    states = [torch.randn(batch, d, 3, generator=gen).bfloat16().cuda() for d in widths]
    weights = [torch.randn(d, 4, generator=gen).bfloat16().cuda() for d in widths]
    pendings = [torch.randn(batch, n, d, generator=gen).bfloat16().cuda() for d in widths]
    num = torch.tensor([min(n, 5), 0][:batch], device="cuda")
    updated = [s.clone() for s in states]
    with poisoned_allocations():
        outputs = ops.commit_three_tree_convs_(*updated, *pendings, num, *xs, *weights, parents, True)
    ys = outputs[:3]
    assert all(torch.equal(r, x) and r.is_contiguous() for r, x in zip(outputs[3:], xs))
    for x, y, state, new, weight, pending in zip(xs, ys, states, updated, weights, pendings):
        committed = ref.conv_state_commit_reference(state, pending, num)
        assert torch.equal(new, committed)
        assert rel_err(y, ref.tree_conv_reference(x.double(), committed.double(), weight.double(), None, parents)) <= O_TOL


@pytest.mark.parametrize("state_len, with_bias", [(3, True), (4, False)])
@pytest.mark.parametrize("case", ["chain16", "tree64_padded", "forest33"])
def test_tree_conv_and_commit(case, state_len, with_bias):
    parents, _ = inputs(case, seed=13)
    gen = torch.Generator().manual_seed(state_len)
    batch, n = parents.shape
    channels = 3 * HEADS * DIM  # q, k and v convolved together
    x = torch.randn(batch, n, channels, generator=gen).bfloat16().cuda()
    conv_state = torch.randn(batch, channels, state_len, generator=gen).bfloat16().cuda()
    weight = torch.randn(channels, 4, generator=gen).bfloat16().cuda()
    bias = torch.randn(channels, generator=gen).bfloat16().cuda() if with_bias else None
    num = torch.tensor([min(n, 5), 0][:batch], device="cuda")
    pending_x = torch.randn(batch, n, channels, generator=gen).bfloat16().cuda()
    committed = ref.conv_state_commit_reference(conv_state, pending_x, num)
    updated = conv_state.clone()
    with poisoned_allocations():
        y, record = ops.commit_tree_conv_(updated, pending_x, num, x, weight, bias, parents, True)
    assert torch.equal(updated, committed) and torch.equal(record, x)
    expected = ref.tree_conv_reference(x.double(), committed.double(), weight.double(),
                                       None if bias is None else bias.double(), parents)
    assert rel_err(y, expected) <= O_TOL
    updated = conv_state.clone()
    ops.conv_state_commit_(updated, x, num)
    assert torch.equal(updated, ref.conv_state_commit_reference(conv_state, x, num))


@pytest.mark.parametrize("rows, k", [(1, 4), (16, 4), (4, 8)])
@pytest.mark.parametrize("vocab", [32000, 8192])
def test_vocab_top_k_at_a_real_vocabulary(rows, k, vocab):
    """A tree level's children on the GPU (32,000 bf16 scores per frontier node, in chunks; a draft vocabulary's
    8,192, one block per row): the reference's ids and log-probabilities, also through the op and with tied
    scores (the lower id first)."""
    gen = torch.Generator().manual_seed(rows + k)
    scores = (4 * torch.randn(rows, vocab, generator=gen)).bfloat16().cuda()
    tied = torch.randint(0, 3, (rows, vocab), generator=gen).bfloat16().cuda()
    for x in (scores, tied):
        log_probs, ids = ops.vocab_top_k(x, k)
        expected_lp, expected_ids = ref.vocab_top_k_reference(x, k)
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(log_probs, expected_lp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("vocab, hidden", [(8192, 2048), (32000, 1024)])
def test_linear_top_k_at_a_draft_heads_shapes(rows, vocab, hidden):
    """A tree level's LM head and top-k in the GEMM's launch (bf16; a draft vocabulary at the GDN-1.3B width, a
    whole one at the trained head's): with scores of small integers, exact in any summation order (and rounded
    once to bf16), the reference's ids (ties to the lower id) and log-probabilities, also through the op; with random scores, the
    picked tokens' log-probabilities match the reference's up to bf16 rounding."""
    gen = torch.Generator().manual_seed(rows + vocab)
    small = lambda *shape: torch.randint(-2, 3, shape, generator=gen).bfloat16().cuda()
    x, w = small(rows, hidden), small(vocab, hidden)
    # (the exact scores, rounded once: cuBLAS may reduce split-K partials in bf16, which rounds them twice)
    expected_lp, expected_ids = ref.vocab_top_k_reference((x.double() @ w.double().T).bfloat16(), 4)
    for log_probs, ids in (triton_topk.linear_top_k(x, w, None, 4), ops.linear_top_k(x, w, None, 4)):
        assert torch.equal(ids, expected_ids)
        torch.testing.assert_close(log_probs, expected_lp, rtol=1e-5, atol=1e-5)
    x = torch.randn(rows, hidden, generator=gen).bfloat16().cuda()
    w = (torch.randn(vocab, hidden, generator=gen) / 8).bfloat16().cuda()
    log_probs, ids = ops.linear_top_k(x, w, None, 4)
    all_lp = torch.log_softmax(torch.nn.functional.linear(x, w).float(), -1)
    torch.testing.assert_close(log_probs, all_lp.gather(1, ids), rtol=0, atol=0.1)
    torch.testing.assert_close(log_probs, all_lp.topk(4).values, rtol=0, atol=0.1)


@pytest.mark.parametrize("rows", [1, 4, 16])
@pytest.mark.parametrize("n, k", [(1024, 8192), (1024, 4096)])
def test_split_linear_at_a_down_projection_replays_in_a_cuda_graph(rows, n, k):
    """A draft head's down projection with its residual (bf16, the trained head's [1024, 4096] and a deeper one,
    depth split across programs, the last of each column block summing the partials): against fp64 PyTorch, the
    same bits at every launch, and inside a captured graph replayed on new inputs (the block counters are back at
    zero after every replay)."""
    gen = torch.Generator().manual_seed(rows + n)
    x, residual = (torch.randn(rows, size, generator=gen).bfloat16().cuda() for size in (k, n))
    w = (torch.randn(n, k, generator=gen) / k**0.5).bfloat16().cuda()
    y = ops.linear_add(x, w, None, residual, None)
    expected = x.double() @ w.double().T + residual.double()
    assert rel_err(y, expected) <= 1e-2
    assert torch.equal(y, ops.linear_add(x, w, None, residual, None))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.linear_add(x, w, None, residual, None)
    for _ in range(3):
        x.copy_(torch.randn(rows, k, generator=gen).bfloat16())
        graph.replay()
        assert torch.equal(captured, ops.linear_add(x, w, None, residual, None))
    assert not triton_linear._counts[x.device].any()


@pytest.mark.parametrize("rows", [1, 4, 16, 20])
@pytest.mark.parametrize("hidden", [1024, 2048])
def test_int8_head_ops_at_the_heads_shapes(rows, hidden):
    """A draft head's GEMMs with weight-only int8 (per-row scales) on the GPU at the trained head's and the
    1.3B-sized head's shapes, bf16 rows: the fuse with its bias and table rows, q/k/v after a norm, gate/up with its
    gate, the down projection with its residual (split at hidden 1024) and a draft vocabulary's LM head with its
    top-k, against fp64 PyTorch of the integers times their scales (20 rows: the kernels' 32-row tiles)."""
    gen = torch.Generator().manual_seed(rows + hidden)
    make = lambda *shape, scale=1.0: (scale * torch.randn(*shape, generator=gen)).bfloat16().cuda()

    def int8(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, scale = ref.quantize_rows(torch.randn(n, k, generator=gen) / k**0.5)
        return q.cuda(), scale.cuda(), q.double().cuda() * scale.double().cuda()[:, None]

    x, norm, bias, table = make(rows, hidden), 1 + make(hidden, scale=0.2), make(hidden), make(32000, hidden)
    ids = torch.randint(0, 32000, (rows,), generator=gen).cuda()
    d = lambda t: t.double()
    q, scale, w = int8(hidden, hidden)
    assert rel_err(ops.linear_add(x, q, bias, table, ids, scale),
                   ref.linear_add_reference(d(x), w, d(bias), d(table), ids)) <= 1e-2
    q, scale, w = int8(3 * hidden, hidden)
    assert rel_err(ops.norm_linear(x, norm, 1e-6, q, scale), ref.norm_linear_reference(d(x), d(norm), 1e-6, w)) <= 1e-2
    q, scale, w = int8(8 * hidden, hidden)
    assert rel_err(ops.gated_linear(x, q, scale), ref.gated_linear_reference(d(x), w)) <= 1e-2
    q, scale, w = int8(hidden, 4 * hidden)
    wide, residual = make(rows, 4 * hidden), make(rows, hidden)
    assert rel_err(ops.linear_add(wide, q, None, residual, None, scale), d(wide) @ w.T + d(residual)) <= 1e-2
    q, scale, w = int8(8192, hidden)
    log_probs, ids = ops.linear_top_k(x, q, None, 4, scale)
    all_lp = torch.log_softmax(d(x) @ w.T, -1)
    torch.testing.assert_close(log_probs.double(), all_lp.gather(1, ids), rtol=0, atol=0.05)
    torch.testing.assert_close(log_probs.double(), all_lp.topk(4).values, rtol=0, atol=0.05)
    assert not triton_linear._counts[x.device].any()


def test_gather_paths_of_a_layer_stack_replays_in_a_cuda_graph():
    """One 24-layer pass's records (bf16 keys/values/conv inputs, fp32 gates) gathered along tree paths by
    ``ops.gather_paths_`` inside a captured graph, replayed with new paths and new records: equal to one
    PyTorch gather per record every time."""
    rows, nodes = 2, 16
    shapes = [((HEADS, DIM), torch.bfloat16), ((VALUE_HEADS, DIM), torch.bfloat16), ((VALUE_HEADS,), torch.float32),
              ((VALUE_HEADS,), torch.float32), ((1024,), torch.bfloat16), ((1024,), torch.bfloat16),
              ((2048,), torch.bfloat16)] * 24
    srcs = [torch.randn(rows, nodes, *shape, device="cuda").to(dtype) for shape, dtype in shapes]
    dsts = [torch.full_like(s, float("nan")) for s in srcs]
    index = torch.zeros(rows, nodes, dtype=torch.long, device="cuda")
    ops.gather_paths_(dsts, srcs, index)  # (compiles the kernel outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.gather_paths_(dsts, srcs, index)
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for s in srcs:
            s.copy_(torch.randn(s.shape, device="cuda", generator=gen))
        index.copy_(torch.randint(-1, nodes, (rows, nodes), device="cuda", generator=gen))
        graph.replay()
        for dst, expected in zip(dsts, ref.gather_paths_reference(srcs, index), strict=True):
            assert torch.equal(dst, expected)


@pytest.mark.parametrize("rows, queries, columns", [(1, 1, 544), (1, 4, 1056), (4, 7, 544), (2, 16, 4128), (1, 40, 300)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_draft_attention_at_the_heads_shape(rows, queries, columns, dtype):
    """An EAGLE head's attention (8 heads of 128) over its key buffer on the GPU, against the fp64 reference:
    a random mask over a prefix of each row (the cached pairs) plus scattered scratch columns (a tree's
    ancestors), one query that sees no key (zeros), 40 queries (a prompt's catch-up: PyTorch's attention)."""
    gen = torch.Generator().manual_seed(rows * columns + queries)
    q = torch.randn(rows, queries, 8, 128, generator=gen).to(dtype).cuda().transpose(1, 2)
    keys, values = (torch.randn(rows, 8, columns, 128, generator=gen).to(dtype).cuda() for _ in range(2))
    lengths = torch.randint(1, columns - 32, (rows, 1, 1), generator=gen)
    mask = (torch.arange(columns) < lengths) | (torch.rand(rows, queries, columns, generator=gen) < 0.05)
    mask[:, -1] = queries == 1
    mask = mask.cuda()
    with poisoned_allocations():
        out = ops.draft_attention(q, keys, values, mask, 128**-0.5)
    expected = ref.draft_attention_reference(q.double(), keys.double(), values.double(), mask, 128**-0.5)
    assert out.shape == (rows, queries, 8, 128) and out.is_contiguous()  # ([R, S, H, d]: the heads side by side)
    out = out.transpose(1, 2)
    if queries > 1:
        assert torch.equal(out[:, :, -1].float(), torch.zeros_like(out[:, :, -1].float()))
    assert rel_err(out, expected) <= (1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("rows", [1, 4, 16, 17, 33])
def test_head_linear_ops_at_the_trained_heads_shapes(rows, monkeypatch):
    """The draft head's fused GEMMs on the GPU at the trained study's shapes (hidden 1024, MLP 4096, 32k-token
    table picked by a strided column of ids), bf16, over [R, 1, D] rows as a draft level runs them, against fp64
    PyTorch; 33 rows take the reference (cuBLAS) route."""
    gen = torch.Generator().manual_seed(rows)
    make = lambda *shape, scale=1.0: (scale * torch.randn(*shape, generator=gen)).bfloat16().cuda()
    x, norm, bias = make(rows, 1, 1024), 1 + make(1024, scale=0.2), make(1024)
    weight, gate_up, table = make(1024, 1024, scale=1 / 32), make(8192, 1024, scale=1 / 32), make(32000, 1024)
    ids = torch.randint(0, 32000, (rows, 3), generator=gen).cuda()[:, 1:2]  # (a column of a wider buffer, as a drafter's)
    d = lambda t: t.double()
    launches = []
    for name in ("linear", "gated_linear"):
        kernel = getattr(triton_linear, name)
        monkeypatch.setattr(triton_linear, name, lambda *a, kernel=kernel, **kw: launches.append(kernel) or kernel(*a, **kw))
    with poisoned_allocations():
        fused = ops.linear_add(x, weight, bias, table, ids)
        projected = ops.norm_linear(x, norm, 1e-6, weight)
        hidden = ops.norm_gated_linear(x, norm, 1e-6, gate_up)
    assert rel_err(fused, ref.linear_add_reference(d(x), d(weight), d(bias), d(table), ids)) <= 1e-2
    assert rel_err(projected, ref.norm_linear_reference(d(x), d(norm), 1e-6, d(weight))) <= 1e-2
    assert rel_err(hidden, ref.norm_gated_linear_reference(d(x), d(norm), 1e-6, d(gate_up))) <= 1e-2
    assert fused.shape == projected.shape == (rows, 1, 1024) and hidden.shape == (rows, 1, 4096)
    assert len(launches) == (3 if rows <= triton_linear.MAX_ROWS else 0)


@pytest.mark.parametrize("rows", [1, 16, 32, 33])
@pytest.mark.parametrize("gated", [False, True])
def test_folded_norm_ops_at_the_target_shapes(rows, gated, monkeypatch):
    """A GDN-1.3B layer's folded sites on the GPU, bf16 over [1, R, 2048] rows as a pass runs them: the residual
    add, the norm and the fused q/k/v/gate projection (or the MLP's gate/up and silu(gate) * up) in one launch
    up to 32 rows, against fp64 PyTorch; the sum exactly the bf16 add; 33 rows take the reference route."""
    gen = torch.Generator().manual_seed(rows + gated)
    make = lambda *shape, scale=1.0: (scale * torch.randn(*shape, generator=gen)).bfloat16().cuda()
    x, skip, norm = make(1, rows, 2048), make(1, rows, 2048), 1 + make(2048, scale=0.2)
    weight = make(11264 if gated else 8208, 2048, scale=2048**-0.5)
    launches = []
    name = "gated_linear" if gated else "linear"
    kernel = getattr(triton_linear, name)
    monkeypatch.setattr(triton_linear, name, lambda *a, **kw: launches.append(1) or kernel(*a, **kw))
    op = ops.add_norm_gated_linear if gated else ops.add_norm_linear
    with poisoned_allocations():
        y, summed = op(x, skip, norm, 1e-6, weight)
    d = lambda t: t.double()
    expected, _ = ref.add_norm_linear_reference(d(x), d(skip), d(norm), 1e-6, d(weight), gated=gated)
    assert y.shape == (1, rows, weight.shape[0] // (2 if gated else 1)) and rel_err(y, expected) <= 1e-2
    assert torch.equal(summed, x + skip)
    assert len(launches) == (1 if rows <= triton_linear.MAX_ROWS else 0)


@pytest.mark.parametrize("rows", [1, 2, 9, 16, 17, 32, 33])
def test_gated_norm_linear_at_the_target_shape(rows, monkeypatch):
    """A GDN-1.3B layer's gated output norm and o_proj as one op, bf16 [1, R, 8, 256] heads against fp64 PyTorch: one
    row in one launch of the one-row GEMV (the plain step), 2-32 rows in one launch of the few-row kernel (a drafted
    pass's), 33 through the reference."""
    gen = torch.Generator().manual_seed(rows)
    make = lambda *shape, scale=1.0: (scale * torch.randn(*shape, generator=gen)).bfloat16().cuda()
    x, gate, norm, weight = make(1, rows, 8, 256), make(1, rows, 8, 256), 1 + make(256, scale=0.2), make(2048, 2048, scale=2048**-0.5)
    launches = []
    for module, name in ((triton_gemv, "gated_norm_gemv"), (triton_linear, "gated_norm_linear")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, kernel=kernel, name=name, **kw: launches.append(name) or kernel(*a, **kw))
    with poisoned_allocations():
        y = ops.gated_norm_linear(x, gate, norm, 1e-6, weight)
    d = lambda t: t.double()
    assert y.shape == (1, rows, 2048)
    assert rel_err(y, ref.gated_norm_linear_reference(d(x), d(gate), d(norm), 1e-6, d(weight))) <= 1e-2
    assert launches == (["gated_norm_gemv"] if rows == 1 else ["gated_norm_linear"] if rows <= 32 else [])


@pytest.mark.parametrize("rows", [1, 2, 9, 32, 33])
def test_swiglu_linear_at_the_target_shape(rows, monkeypatch):
    """A GDN-1.3B layer's MLP product and down projection as one op, bf16 [1, R, 2 x 5632] gate/up rows against fp64
    PyTorch (the product rounded to bf16, as the unfused kernel writes it): one row in one launch of the one-row GEMV
    (the plain step), 2-32 in one launch of the split few-row kernel (drafted passes), more through the reference;
    the split kernel's block counters back at zero."""
    gen = torch.Generator().manual_seed(rows)
    make = lambda *shape, scale=1.0: (scale * torch.randn(*shape, generator=gen)).bfloat16().cuda()
    gate_up, weight = make(1, rows, 2 * 5632, scale=2.0), make(2048, 5632, scale=5632**-0.5)
    launches = []
    for module, name in ((triton_gemv, "swiglu_gemv"), (triton_linear, "swiglu_linear")):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, kernel=kernel, name=name, **kw: launches.append(name) or kernel(*a, **kw))
    with poisoned_allocations():
        y = ops.swiglu_linear(gate_up, weight)
    assert y.shape == (1, rows, 2048)
    gate, up = gate_up.double().chunk(2, dim=-1)
    assert rel_err(y, (torch.nn.functional.silu(gate) * up).bfloat16().double() @ weight.double().T) <= 1e-2
    assert launches == (["swiglu_gemv"] if rows == 1 else ["swiglu_linear"] if rows <= 32 else [])
    if launches == ["swiglu_linear"]:
        assert not triton_linear._counts[y.device].any()


@pytest.mark.parametrize("rows", [1, 16, 32, 33])
@pytest.mark.parametrize("site", ["qkvg", "o_proj", "gate_up", "down", "lm_head"])
def test_routed_gemms_at_the_target_shapes(rows, site):
    """Every GEMM of a GDN-1.3B pass as ``route_linears`` leaves it (``specla.linear``, or ``specla.gated_linear``
    for the MLP's gate/up), bf16 over [1, R, K] rows, against fp64 PyTorch; 33 rows take the reference route."""
    n, k = {"qkvg": (8208, 2048), "o_proj": (2048, 2048), "gate_up": (11264, 2048), "down": (2048, 5632),
            "lm_head": (32000, 2048)}[site]
    gen = torch.Generator().manual_seed(rows + n)
    make = lambda *shape, scale=1.0: (scale * torch.randn(*shape, generator=gen)).bfloat16().cuda()
    x, weight = make(1, rows, k), make(n, k, scale=k**-0.5)
    d = lambda t: t.double()
    with poisoned_allocations():
        y = ops.gated_linear(x, weight) if site == "gate_up" else ops.linear(x, weight)
    expected = ref.gated_linear_reference(d(x), d(weight)) if site == "gate_up" else d(x) @ d(weight).T
    assert y.shape == expected.shape and rel_err(y, expected) <= 1e-2


def test_kernels_launch_with_pdl_on_hopper_and_keep_stream_order_in_a_graph():
    """With PDL a kernel starts before the one it reads has finished and must wait for it: a chain of linear
    launches, each reading the output of the one before, replayed in a CUDA graph, gives the eager chain's
    values bit for bit (a kernel that read too early would not)."""
    from specla_compile.kernels import pdl

    device = torch.device("cuda")
    assert pdl.launch_args(device).get("launch_pdl", False) == (torch.cuda.get_device_capability()[0] >= 9)
    torch.manual_seed(0)
    weights = [torch.randn(2048, 2048, device=device, dtype=torch.bfloat16) / 45 for _ in range(8)]
    x = torch.randn(1, 2048, device=device, dtype=torch.bfloat16)

    def chain():
        y = x * 1  # (an eager kernel before the first linear: it launches without PDL)
        for w in weights:
            y = triton_linear.linear(y, w)  # (PDL after PDL: each waits for the one before)
        return y

    chain()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        expected = chain()
        graph.replay()
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.skipif(cuda_gemv.nvcc() is None, reason="needs nvcc to build the CUDA GEMV")
@pytest.mark.parametrize("n, k", [(40, 1024), (301, 2048), (2048, 5632)])
@pytest.mark.parametrize("pdl", [0, 1])
def test_cuda_gemv_matches_linear(n, k, pdl):
    """The CUDA C GEMV (``kernels/cuda_gemv.cu``), every configuration the benchmark times that it has an instance of
    (rows past N in the last warp included), against an fp32 product of the same bf16 operands; a depth that is not
    a multiple of 256 is refused."""
    from gemv_cuda_gpu import CONFIGS

    gemv = cuda_gemv.gemv
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 50
    x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
    expected = w.float() @ x.float()
    ran = 0
    for rows, warps, streaming, _ in CONFIGS:
        y = torch.full((n,), float("nan"), device="cuda", dtype=torch.bfloat16)
        try:
            gemv(w, x, y, rows, warps, streaming, pdl)
        except ValueError:
            assert rows * k // 256 > 32, (rows, k)  # (only the register-heavy combinations have no instance)
            continue
        torch.cuda.synchronize()
        assert (y.float() - expected).abs().max().item() <= 1e-2 * expected.abs().max().item(), (rows, warps, streaming)
        ran += 1
    assert ran >= 4
    with pytest.raises(ValueError, match="no GEMV instance"):
        gemv(w[:, :200].contiguous(), x[:200].contiguous(), torch.empty(n, device="cuda", dtype=torch.bfloat16))


@pytest.mark.skipif(cuda_gemv.nvcc() is None, reason="needs nvcc to build the CUDA GEMV")
def test_cuda_gemv_chain_with_pdl_replays_its_eager_outputs():
    """Two dependent GEMVs launched with programmatic dependent launch, captured in a CUDA graph (the second reads the
    first's output, which it may only do after its griddepcontrol.wait): every replay gives the eager chain's output,
    with the inputs changed between replays."""
    from specla_compile.runtime.graph_capture import capture

    gemv = cuda_gemv.gemv
    w1 = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16) / 30
    w2 = torch.randn(301, 2048, device="cuda", dtype=torch.bfloat16) / 30
    x = torch.randn(1024, device="cuda", dtype=torch.bfloat16)
    h, y = torch.empty(2048, device="cuda", dtype=torch.bfloat16), torch.empty(301, device="cuda", dtype=torch.bfloat16)

    def chain() -> None:
        gemv(w1, x, h, 4, 8, 0, 1)
        gemv(w2, h, y, 1, 8, 1, 1)

    graph, _ = capture(chain)
    for seed in range(3):
        x.copy_(torch.randn(1024, generator=torch.Generator().manual_seed(seed)).to(x))
        h.fill_(float("nan"))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        expected = w2.float() @ (w1.float() @ x.float()).to(torch.bfloat16).float()
        assert (y.float() - expected).abs().max().item() <= 2e-2 * expected.abs().max().item(), seed


@pytest.mark.skipif(cuda_gemv.nvcc() is None, reason="needs nvcc to build the CUDA GEMV")
@pytest.mark.parametrize("n, k", [(301, 1024), (8208, 2048), (2048, 2048), (2048, 5632), (32000, 2048)])
@pytest.mark.parametrize("prologue", ["none", "swiglu", "gated_norm"])
def test_row_gemv_op_matches_its_reference(n, k, prologue):
    """``specla::row_gemv`` on CUDA (the CUDA C GEMV with each shape's configuration, PDL as the device allows) against
    its reference in fp64 on random bf16 rows: a plain row; an MLP's packed ``[gate, up]`` row whose product the
    kernel forms; a row of heads of 256 (128 for K=1024) with its gate and norm weight, which the kernel normalises.
    A row that is not 16-byte aligned, and two rows, take the reference."""
    from specla_compile.kernels import ops

    generator = torch.Generator(device="cuda").manual_seed(n + k)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=generator)

    w = randn(n, k) / 50
    dim = 256 if k % 256 == 0 and k > 1024 else 128
    shape = {"none": (1, 1, k), "swiglu": (1, 1, 2 * k), "gated_norm": (1, 1, k // dim, dim)}[prologue]
    x = randn(*shape)
    extras = (randn(*shape), 1 + randn(dim) / 4, 1e-6) if prologue == "gated_norm" else ()
    assert cuda_gemv.fits(x, w, prologue, *extras[:2])
    got = ops.row_gemv(x, w, prologue, *extras)
    expected = ops.row_gemv._init_fn(x.double(), w.double(), prologue, *(e.double() for e in extras[:2]), *extras[2:])
    assert got.shape == (1, 1, n) and got.dtype == torch.bfloat16
    assert (got.double() - expected).abs().max().item() <= 1e-2 * expected.abs().max().item() + 1e-3, prologue
    offset = torch.empty(x.numel() + 8, device="cuda", dtype=torch.bfloat16)[1 : 1 + x.numel()].view_as(x).copy_(x)
    rows = x.expand(2, *x.shape[1:]).contiguous()
    row_extras = (extras[0].expand_as(rows).contiguous(), *extras[1:]) if extras else ()
    assert not cuda_gemv.fits(offset, w, prologue, *extras[:2]) and not cuda_gemv.fits(rows, w, prologue, *row_extras[:2])
    torch.testing.assert_close(ops.row_gemv(offset, w, prologue, *extras), ops.row_gemv._init_fn(x, w, prologue, *extras))
    torch.testing.assert_close(ops.row_gemv(rows, w, prologue, *row_extras),
                               ops.row_gemv._init_fn(rows, w, prologue, *row_extras))


@pytest.mark.skipif(cuda_gemv.nvcc() is None, reason="needs nvcc to build the CUDA GEMV")
@pytest.mark.parametrize("n, k", [(301, 1024), (8208, 2048), (11264, 2048), (32000, 2048)])
@pytest.mark.parametrize("round_sum", [False, True])
def test_add_norm_row_gemv_op_matches_its_reference(n, k, round_sum):
    """``specla::add_norm_row_gemv`` on CUDA (the CUDA C GEMV with the residual add and RMS norm in its prologue) on
    random bf16 rows at the shapes its fold gives it (q/k/v/gates, gate/up, the LM head): the sum exactly as PyTorch
    adds, the output against the op's reference (the same rounding of the sum) and against fp64. Two rows take the
    reference."""
    generator = torch.Generator(device="cuda").manual_seed(n + k + round_sum)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=generator)

    w, x, skip, norm_weight = randn(n, k) / 50, randn(1, 1, k), randn(1, 1, k), 1 + randn(k) / 4
    assert cuda_gemv.fits(x, w, "add_norm", skip, norm_weight)
    y, summed = ops.add_norm_row_gemv(x, skip, norm_weight, 1e-6, w, round_sum)
    assert y.shape == (1, 1, n) and y.dtype == torch.bfloat16 and torch.equal(summed, x + skip)
    expected = ops.add_norm_row_gemv._init_fn(x, skip, norm_weight, 1e-6, w, round_sum)[0].double()
    wide = ops.add_norm_row_gemv._init_fn(x.double(), skip.double(), norm_weight.double(), 1e-6, w.double(), round_sum)[0]
    assert (y.double() - expected).abs().max().item() <= 1e-2 * expected.abs().max().item(), "against the reference"
    assert (y.double() - wide).abs().max().item() <= 1e-2 * wide.abs().max().item(), "against fp64"
    with pytest.raises(ValueError, match="prologue must be one of"):  # (two outputs: not row_gemv's)
        ops.row_gemv(x, w, "add_norm", skip, norm_weight, 1e-6)
    with pytest.raises(ValueError, match="the outputs apart from x and the gate"):  # (block 0 would overwrite x)
        cuda_gemv.gemv(w, x.view(-1), y.view(-1), *cuda_gemv.config(n, k), prologue="add_norm", gate=skip.view(-1),
                       norm_weight=norm_weight, eps=1e-6, sum_out=x.view(-1))
    rows, skips = x.expand(2, 1, k).contiguous(), skip.expand(2, 1, k).contiguous()
    assert not cuda_gemv.fits(rows, w, "add_norm", skips, norm_weight)
    for got, want in zip(ops.add_norm_row_gemv(rows, skips, norm_weight, 1e-6, w, round_sum),
                         ops.add_norm_row_gemv._init_fn(rows, skips, norm_weight, 1e-6, w, round_sum)):
        torch.testing.assert_close(got, want)


def test_inductor_rounds_an_added_bf16_sum_before_the_norm_fused_after_it():
    """The premise of ``fold_row_norms``' reading of an add, then a norm: inductor's code of ``h = a + b`` (bf16) and
    the RMS norm of h, as a twin's graph has them, normalises h rounded to bf16, as eager PyTorch does, so its output
    is closer to the rounded reading (an H100, torch 2.11: 277 of 16,384 values differ from it, 3,194 from the float32
    sum's; the CPU's C++ code rounds too)."""

    def add_then_norm(a, b, w):
        h = a + b
        return h, torch.ops.specla.rms_norm(h, None, w, 1e-6)

    compiled = torch.compile(add_then_norm)
    generator = torch.Generator(device="cuda").manual_seed(5)
    unrounded = rounded = 0
    for _ in range(8):
        a, b = (torch.randn(1, 2048, device="cuda", generator=generator).to(torch.bfloat16) for _ in range(2))
        w = (1 + torch.randn(2048, device="cuda", generator=generator) / 4).to(torch.bfloat16)
        h, y = compiled(a, b, w)
        assert torch.equal(h, a + b)
        unrounded += (y != ref.rms_norm_reference(a, b, w, 1e-6)).sum().item()
        rounded += (y != ref.rms_norm_reference(a + b, None, w, 1e-6)).sum().item()
    assert rounded < unrounded, (rounded, unrounded)
