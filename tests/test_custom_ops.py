"""The torch.library ops: opcheck (schema, fake impl, dispatch) and agreement with the references."""

import pytest
import torch
from helpers import random_gdn_inputs
from kernel_cases import random_conv_gates_pass

from specla_compile.kernels import (
    FactorRecords,
    conv_state_commit_reference,
    gdn_commit_reference,
    gdn_tree_factorized,
    ops,
    tree_conv_reference,
)
from specla_compile.kernels.reference import vocab_top_k_reference

PARENTS = torch.tensor([[-1, 0, 0, 1, 3, -2], [-1, 0, 1, 2, 2, 0]])
NAMES = ("q", "k", "v", "g", "beta")


@pytest.fixture
def x():
    return random_gdn_inputs(PARENTS, heads=1, value_heads=2, dk=8, dv=4, dtype=torch.float32, seed=11)


def records_of(x, parents):
    return gdn_tree_factorized(*(x[n] for n in NAMES), parents, x["initial_state"], use_qk_l2norm=True)[1]


def test_gdn_tree_verify(x):
    args = (*(x[n] for n in NAMES), PARENTS, x["initial_state"], 0.25, True)
    torch.library.opcheck(ops.gdn_tree_verify, args)
    torch.library.opcheck(ops.gdn_tree_verify, (*args[:-1], False))
    o, k_hat = ops.gdn_tree_verify(*args)
    expected_o, expected = gdn_tree_factorized(*(x[n] for n in NAMES), PARENTS, x["initial_state"], scale=0.25, use_qk_l2norm=True)
    assert torch.equal(o, expected_o) and torch.equal(k_hat, expected.k)
    assert torch.allclose(k_hat.norm(dim=-1), torch.ones(()), atol=1e-5)


def test_gdn_commit_(x):
    rec = records_of(x, PARENTS)
    num = torch.tensor([3, 1])
    state = x["initial_state"].clone()
    torch.library.opcheck(ops.gdn_commit_, (state.clone(), *rec, num))
    ops.gdn_commit_(state, *rec, num)
    assert torch.equal(state, gdn_commit_reference(x["initial_state"], rec, num))
    assert not torch.equal(state, x["initial_state"])


def test_gdn_commit_verify_(x):
    pending = records_of(x, PARENTS)
    num = torch.tensor([2, 4])
    fresh = random_gdn_inputs(PARENTS, heads=1, value_heads=2, dk=8, dv=4, dtype=torch.float32, seed=12)
    tail = (*(fresh[n] for n in NAMES), PARENTS, 0.5, True)
    torch.library.opcheck(ops.gdn_commit_verify_, (x["initial_state"].clone(), *pending, num, *tail))
    state = x["initial_state"].clone()
    o, k_hat = ops.gdn_commit_verify_(state, *pending, num, *tail)
    expected_state = gdn_commit_reference(x["initial_state"], pending, num)
    expected_o, _ = gdn_tree_factorized(*(fresh[n] for n in NAMES), PARENTS, expected_state, scale=0.5, use_qk_l2norm=True)
    assert torch.equal(state, expected_state) and torch.equal(o, expected_o)


@pytest.mark.parametrize("with_bias", [True, False])
def test_commit_tree_conv_(with_bias):
    """The delayed conv-state commit, then the tree conv from the committed state, in one op."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, 5, generator=gen)
    conv_state = torch.randn(2, 5, 4, generator=gen)
    pending_x, num = torch.randn(2, 6, 5, generator=gen), torch.tensor([2, 0])
    weight = torch.randn(5, 4, generator=gen)
    bias = torch.randn(5, generator=gen) if with_bias else None
    torch.library.opcheck(ops.commit_tree_conv_, (conv_state.clone(), pending_x, num, x, weight, bias, PARENTS, True))
    committed = conv_state_commit_reference(conv_state, pending_x, num)
    state = conv_state.clone()
    y, record = ops.commit_tree_conv_(state, pending_x, num, x, weight, bias, PARENTS, True)
    assert torch.equal(record, x) and record.data_ptr() != x.data_ptr()
    assert torch.equal(state, committed) and not torch.equal(state[0], conv_state[0]) and torch.equal(state[1], conv_state[1])
    assert torch.equal(y, tree_conv_reference(x, committed, weight, bias, PARENTS))


def test_commit_three_tree_convs_():
    """fla's three convs of a layer in one op: each conv's commit and tree conv, as three single ops."""
    gen = torch.Generator().manual_seed(2)
    widths = (5, 3, 7)
    states = [torch.randn(2, d, 4, generator=gen) for d in widths]
    pendings = [torch.randn(2, 6, d, generator=gen) for d in widths]
    xs = [torch.randn(2, 6, d, generator=gen) for d in widths]
    weights = [torch.randn(d, 4, generator=gen) for d in widths]
    num = torch.tensor([3, 1])
    torch.library.opcheck(ops.commit_three_tree_convs_, ([s.clone() for s in states] + [*pendings, num, *xs, *weights, PARENTS, True]))
    fused_states = [s.clone() for s in states]
    outputs = ops.commit_three_tree_convs_(*fused_states, *pendings, num, *xs, *weights, PARENTS, True)
    for state, fused_state, pending, x, weight, y, record in zip(states, fused_states, pendings, xs, weights, outputs[:3], outputs[3:]):
        single = state.clone()
        expected_y, expected_record = ops.commit_tree_conv_(single, pending, num, x, weight, None, PARENTS, True)
        assert torch.equal(y, expected_y) and torch.equal(record, expected_record) and torch.equal(record, x)
        assert torch.equal(fused_state, single) and not torch.equal(fused_state, state)


def test_conv_state_commit_():
    gen = torch.Generator().manual_seed(1)
    conv_state = torch.randn(2, 5, 4, generator=gen)
    x = torch.randn(2, 3, 5, generator=gen)
    num = torch.tensor([1, 3])
    torch.library.opcheck(ops.conv_state_commit_, (conv_state.clone(), x, num))
    expected = conv_state_commit_reference(conv_state, x, num)
    ops.conv_state_commit_(conv_state, x, num)
    assert torch.equal(conv_state, expected)


def test_ops_compile_without_graph_breaks(x):
    """The ops are single opaque nodes for Dynamo: a compiled function around them has one graph."""

    def verify_then_commit(q, k, v, g, beta, parents, state, num):
        o, k_hat = torch.ops.specla.gdn_tree_verify(q, k, v, g, beta, parents, state, 0.25, True)
        torch.ops.specla.gdn_commit_(state, k_hat, v, g, beta, num)
        return o

    args = (*(x[n] for n in NAMES), PARENTS, x["initial_state"].clone(), torch.tensor([1, 2]))
    explanation = torch._dynamo.explain(verify_then_commit)(*args)
    assert explanation.graph_count == 1 and explanation.graph_break_count == 0
    state = x["initial_state"].clone()
    compiled = torch.compile(verify_then_commit, backend="aot_eager", fullgraph=True)
    o = compiled(*args[:6], state, args[7])
    expected_o, rec = gdn_tree_factorized(*(x[n] for n in NAMES), PARENTS, x["initial_state"], scale=0.25, use_qk_l2norm=True)
    torch.testing.assert_close(o, expected_o)
    torch.testing.assert_close(state, gdn_commit_reference(x["initial_state"], FactorRecords(*rec), torch.tensor([1, 2])))


@pytest.mark.parametrize("device", ["cpu", *(["cuda"] if torch.cuda.is_available() else [])])
def test_inductor_passes_column_slices_to_the_three_convs_as_they_lie(device):
    """Compiled after a GEMM of 8208 output columns (the 1.3B model's fused q/k/v/g/a/b: rows that are not
    a multiple of 128 bytes, which inductor pads on GPUs), the three-conv op gets views of the GEMM's
    output, not copies (the op takes any input layout), and computes what it computes eagerly. On the
    CPU inductor pads nothing: the copies can only show on a GPU (they did on the H200, 3 per layer)."""
    from torch._inductor.utils import run_and_get_code

    gen = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n, d, width = 16, 2048, 8208

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    args = [rand(1, n, 64), rand(width, 64) / 8, *(rand(1, d, 3) for _ in range(3)), *(rand(1, n, d) for _ in range(3)),
            torch.tensor([5], device=device), *(rand(d, 4) for _ in range(3)), torch.arange(-1, n - 1, device=device)[None]]

    def convs(h, w, s0, s1, s2, p0, p1, p2, num, c0, c1, c2, parents):
        y = h @ w.t()
        out = ops.commit_three_tree_convs_(s0, s1, s2, p0, p1, p2, num, y[..., :d], y[..., d : 2 * d], y[..., 2 * d : 3 * d],
                                           c0, c1, c2, parents, True)
        return out[0] + y[..., 3 * d : 4 * d], out[5]

    eager_states = [s.clone() for s in args[2:5]]
    expected = convs(*args[:2], *eager_states, *args[5:])
    compiled_states = [s.clone() for s in args[2:5]]
    got, (code,) = run_and_get_code(torch.compile(convs, dynamic=False), *args[:2], *compiled_states, *args[5:])
    call = next(line for line in code.splitlines() if "commit_three_tree_convs_.default(" in line)
    assert call.count("reinterpret_tensor(buf") == 3, call
    for a, b in zip((*got, *compiled_states), (*expected, *eager_states)):
        torch.testing.assert_close(a, b)


def test_vocab_top_k():
    """A tree level's children in one op: the reference's k best log-probabilities, best first."""
    scores = torch.randn(6, 50, generator=torch.Generator().manual_seed(3))
    torch.library.opcheck(ops.vocab_top_k, (scores, 4))
    log_probs, ids = ops.vocab_top_k(scores, 4)
    assert torch.equal(ids, torch.log_softmax(scores, -1).topk(4).indices)
    torch.testing.assert_close(log_probs, torch.log_softmax(scores, -1).topk(4).values)
    assert torch.equal(vocab_top_k_reference(torch.zeros(1, 5), 3)[1], torch.tensor([[0, 1, 2]]))  # ties: lower ids first


def test_linear_top_k():
    """A tree level's LM head and children in one op: vocab_top_k of F.linear's scores, with and without a bias."""
    gen = torch.Generator().manual_seed(4)
    x, w, b = torch.randn(3, 16, generator=gen), torch.randn(50, 16, generator=gen), torch.randn(50, generator=gen)
    for bias in (None, b):
        torch.library.opcheck(ops.linear_top_k, (x, w, bias, 4))
        log_probs, ids = ops.linear_top_k(x, w, bias, 4)
        expected = torch.log_softmax(torch.nn.functional.linear(x, w, bias), -1).topk(4)
        assert torch.equal(ids, expected.indices)
        torch.testing.assert_close(log_probs, expected.values)
    with pytest.raises(ValueError, match="1 <= k <= V"):
        ops.linear_top_k(torch.empty(3, 16, device="meta"), torch.empty(50, 16, device="meta"), None, 51)


def test_draft_attention():
    """A draft head's attention in one op: PyTorch's masked scaled-dot-product attention (fp64), zeros for a
    query that sees no key, a mask shared by every row."""
    gen = torch.Generator().manual_seed(4)
    q, keys, values = (torch.randn(2, 3, s, 8, generator=gen, dtype=torch.float64) for s in (5, 20, 20))
    mask = torch.rand(1, 5, 20, generator=gen) < 0.5
    mask[0, 0, 0], mask[0, -1] = True, False
    torch.library.opcheck(ops.draft_attention, (q, keys, values, mask, 0.25))
    out = ops.draft_attention(q, keys, values, mask, 0.25)
    assert out.shape == (2, 5, 3, 8) and out.is_contiguous()  # (the heads side by side, as the output projection reads them)
    out = out.transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q[:, :, :-1], keys, values, attn_mask=mask[:, None, :-1],
                                                           scale=0.25)
    torch.testing.assert_close(out[:, :, :-1], sdpa)
    assert torch.equal(out[:, :, -1], torch.zeros(2, 3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="a bool mask"):  # (an integer mask would invert bitwise, silently)
        ops.draft_attention(q, keys, values, mask.int(), 0.25)


def test_head_linear_ops():
    """The draft head's fused GEMMs, as ops: what the modules they replace compute (fp64), with a residual of
    the output's shape or rows of a table picked by index, over [R, S, ...] inputs."""
    gen = torch.Generator().manual_seed(5)
    x, table = torch.randn(2, 3, 8, generator=gen, dtype=torch.float64), torch.randn(11, 6, generator=gen, dtype=torch.float64)
    ids, residual = torch.randint(0, 11, (2, 3), generator=gen), torch.randn(2, 3, 6, generator=gen, dtype=torch.float64)
    fc, norm = torch.nn.Linear(8, 6).double(), torch.nn.RMSNorm(8, eps=1e-5).double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=gen)
        gate_up = torch.randn(12, 8, generator=gen, dtype=torch.float64)
        for args in ((x, fc.weight, fc.bias, residual, None), (x, fc.weight, None, table, ids)):
            torch.library.opcheck(ops.linear_add, args)
        torch.testing.assert_close(ops.linear_add(x, fc.weight, fc.bias, table, ids), fc(x) + table[ids])
        torch.testing.assert_close(ops.linear_add(x, fc.weight, None, residual, None), x @ fc.weight.T + residual)
        torch.library.opcheck(ops.norm_linear, (x, norm.weight, 1e-5, fc.weight))
        torch.testing.assert_close(ops.norm_linear(x, norm.weight, 1e-5, fc.weight), norm(x) @ fc.weight.T)
        torch.library.opcheck(ops.norm_gated_linear, (x, norm.weight, 1e-5, gate_up))
        hidden = ops.norm_gated_linear(x, norm.weight, 1e-5, gate_up)
        torch.testing.assert_close(hidden, torch.nn.functional.silu(norm(x) @ gate_up[:6].T) * (norm(x) @ gate_up[6:].T))
        torch.library.opcheck(ops.linear, (x, fc.weight))
        torch.testing.assert_close(ops.linear(x, fc.weight), x @ fc.weight.T)
        torch.library.opcheck(ops.gated_linear, (x, gate_up))
        torch.testing.assert_close(ops.gated_linear(x, gate_up), torch.nn.functional.silu(x @ gate_up[:6].T) * (x @ gate_up[6:].T))


def test_swiglu_linear():
    """An MLP's product and down projection from its packed gate/up output, as one op: the modules' math in fp64 over
    [B, N, 2I] rows; in bf16 the product is rounded once, from float32, as inductor's kernel of it writes it (not
    twice, as eager bf16 ``silu`` then ``*`` would)."""
    gen = torch.Generator().manual_seed(6)
    gate_up, down = torch.randn(2, 3, 16, generator=gen, dtype=torch.float64), torch.randn(5, 8, generator=gen, dtype=torch.float64)
    torch.library.opcheck(ops.swiglu_linear, (gate_up, down))
    gate, up = gate_up.chunk(2, -1)
    torch.testing.assert_close(ops.swiglu_linear(gate_up, down), (torch.nn.functional.silu(gate) * up) @ down.T)
    rows, weight = (4 * gate_up).bfloat16(), down.bfloat16()
    gate, up = rows.float().chunk(2, -1)
    product = (torch.nn.functional.silu(gate) * up).bfloat16()
    assert torch.equal(ops.swiglu_linear(rows, weight), torch.nn.functional.linear(product, weight))


def test_conv_gates_commit_verify():
    """A one-node layer from its projection as one op: opcheck, and its outputs, conv records and committed conv and
    recurrent states those of the three-conv op, the heads and the gates op run one after another (fp64)."""
    case = random_conv_gates_pass(2, 2, 4, 8, (1, 3), seed=7, dtype=torch.float64)
    args = lambda states, state: (states, case["conv_pending"], case["xs"], case["weights"], True, state, *case["records"],
                                  case["num"], *case["gates"], case["parents"], 0.3, True)
    torch.library.opcheck(ops.gdn_conv_gates_commit_verify_, args([s.clone() for s in case["conv_states"]], case["state"].clone()))
    states, state = [s.clone() for s in case["conv_states"]], case["state"].clone()
    got = ops.gdn_conv_gates_commit_verify_(*args(states, state))
    steps_states, steps_state = [s.clone() for s in case["conv_states"]], case["state"].clone()
    ys_rows = ops.commit_three_tree_convs_(*steps_states, *case["conv_pending"], case["num"], *case["xs"], *case["weights"],
                                           case["parents"], True)
    q, k, v = (y.unflatten(-1, (-1, 8)) for y in ys_rows[:3])
    steps = ops.gdn_gates_commit_verify_(steps_state, *case["records"], case["num"], q, k, v, *case["gates"], case["parents"],
                                         0.3, True)
    for a, b in zip(got, (*steps, v, *ys_rows[3:]), strict=True):
        assert torch.equal(a, b)
    assert all(torch.equal(a, b) for a, b in zip((*states, state), (*steps_states, steps_state)))
    assert not torch.equal(states[0], case["conv_states"][0])


@pytest.mark.parametrize("prologue", ["none", "swiglu", "gated_norm"])
def test_row_gemv(prologue):
    """The CUDA C GEMV's op: schema, fake and dispatch (opcheck), and its CPU reference in fp64 against the modules'
    math for each prologue: a plain row, an MLP's packed [gate, up] row, a row of 2 heads of 8 with its gate."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(5, 16, generator=gen, dtype=torch.float64)
    shape = {"none": (1, 1, 16), "swiglu": (1, 1, 32), "gated_norm": (1, 1, 2, 8)}[prologue]
    row = torch.randn(*shape, generator=gen, dtype=torch.float64)
    gate, norm_weight = torch.randn(*shape, generator=gen, dtype=torch.float64), torch.randn(8, generator=gen, dtype=torch.float64)
    extras = (gate, norm_weight, 1e-6) if prologue == "gated_norm" else ()
    torch.library.opcheck(ops.row_gemv, (row, weight, prologue, *extras))
    x = row
    if prologue == "swiglu":
        first, second = row.chunk(2, -1)
        x = torch.nn.functional.silu(first) * second
    elif prologue == "gated_norm":
        normed = row * torch.rsqrt(row.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
        x = (normed * torch.nn.functional.silu(gate)).flatten(-2)
    torch.testing.assert_close(ops.row_gemv(row, weight, prologue, *extras), x @ weight.T)
    with pytest.raises(ValueError, match="prologue must be one of"):
        ops.row_gemv(row, weight, prologue.upper())
    with pytest.raises(ValueError, match="prologue must be one of"):
        ops.row_gemv(row, weight, "add_norm")  # (two outputs: specla::add_norm_row_gemv)


@pytest.mark.parametrize("round_sum", [False, True])
def test_add_norm_row_gemv(round_sum):
    """The CUDA C GEMV's add-and-norm op: schema, fake and dispatch (opcheck); in fp64, the GEMV of the RMS norm of
    ``x + skip`` and the sum; in bf16, the norm reads the sum as the graph it replaces did: fla's fused prenorm
    (``specla.rms_norm(x, skip)``, the float32 sum) or, with ``round_sum``, an add and then the norm of its rounded
    output, which differ here (tested)."""
    gen = torch.Generator().manual_seed(11)
    x, skip, norm_weight = (torch.randn(*shape, generator=gen, dtype=torch.float64) for shape in ((1, 1, 16), (1, 1, 16), (16,)))
    weight = torch.randn(5, 16, generator=gen, dtype=torch.float64)
    torch.library.opcheck(ops.add_norm_row_gemv, (x, skip, norm_weight, 1e-6, weight, round_sum))
    y, summed = ops.add_norm_row_gemv(x, skip, norm_weight, 1e-6, weight, round_sum)
    h = x + skip
    torch.testing.assert_close(summed, h)
    torch.testing.assert_close(y, (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight) @ weight.T)
    x, skip = (torch.randn(1, 1, 256, generator=gen).to(torch.bfloat16) for _ in range(2))
    norm_weight, weight = torch.randn(256, generator=gen).to(torch.bfloat16), torch.randn(64, 256, generator=gen).to(torch.bfloat16)
    y, summed = ops.add_norm_row_gemv(x, skip, norm_weight, 1e-6, weight, round_sum)
    fused = torch.nn.functional.linear(torch.ops.specla.rms_norm(x, skip, norm_weight, 1e-6), weight)
    added = torch.nn.functional.linear(torch.ops.specla.rms_norm(x + skip, None, norm_weight, 1e-6), weight)
    assert torch.equal(summed, x + skip) and not torch.equal(fused, added)
    assert torch.equal(y, added if round_sum else fused)
    with pytest.raises(ValueError, match="the skip must have the rows' shape"):
        ops.add_norm_row_gemv(x, skip[..., :128], norm_weight, 1e-6, weight, round_sum)
