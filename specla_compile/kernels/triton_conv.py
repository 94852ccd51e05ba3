"""Triton kernels for the tree short convolution (with SiLU) and the conv-state commit.

Same math as ``reference.tree_conv_reference`` / ``conv_state_commit_reference``. A program owns one
batch row and a block of channels for every node at once: node j's taps are found by following the
parent pointers W-1 times on device, and taps past the root read the durable conv state.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_args, wait_upstream


@triton.jit
def shift_in(conv_state, x, num_accepted, b, rd, md, A, D, S, BS: tl.constexpr):
    """Row b's channels ``rd``: new column c is column num + c of (old state ++ accepted inputs), in place."""
    rs = tl.arange(0, BS)
    m2 = md[:, None] & (rs < S)[None, :]
    src = tl.minimum(tl.load(num_accepted + b).to(tl.int32), A) + rs
    in_state = (src < S)[None, :]
    old = tl.load(conv_state + (b * D + rd[:, None]) * S + src[None, :], mask=m2 & in_state, other=0.0)
    new = tl.load(x + (b * A + (src - S)[None, :]) * D + rd[:, None], mask=m2 & (in_state == 0), other=0.0)
    shifted = tl.where(in_state, old, new.to(old.dtype))
    tl.debug_barrier()  # in place: every read of this block lands before any write
    tl.store(conv_state + (b * D + rd[:, None]) * S + rs[None, :], shifted, mask=m2)


@triton.jit
def one_node_conv(x, sxd, conv_state, pending_x, weight, b, rd, md, num, D, S, A, W: tl.constexpr, SILU: tl.constexpr):
    """Row b's channels ``rd`` of one node's conv (a one-node pass: the node is its row's root), from the conv state
    as committing the row's first ``num`` pending inputs leaves it, read where they lie: the state is not written
    here (other programs may still read it). ``x`` points at the row's input, channels ``sxd`` apart. Returns the
    output as :func:`_tree_conv_block` rounds it (in float32) and the input."""
    own = tl.load(x + rd * sxd, mask=md, other=0.0)
    acc = own.to(tl.float32) * tl.load(weight + rd * W + (W - 1), mask=md, other=0.0).to(tl.float32)
    for i in tl.static_range(1, W):
        src = tl.zeros_like(rd) + (num + S - i)  # the committed state's column S - i, in (old state ++ pending inputs)
        old = tl.load(conv_state + (b * D + rd) * S + src, mask=md & (src < S), other=0.0)
        new = tl.load(pending_x + (b * A + src - S) * D + rd, mask=md & (src >= S), other=0.0)
        tap = tl.where(src < S, old, new.to(old.dtype)).to(tl.float32)  # (a pending input as the state would hold it)
        acc += tap * tl.load(weight + rd * W + (W - 1 - i), mask=md, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    return acc.to(own.dtype).to(tl.float32), own


@triton.jit
def _tree_conv_block(
    x, sxb, sxn, sxd, conv_state, weight, bias, parents, y, x_rows, b, rd, N, D, S, pending_x, num_pending, A,
    W: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    COMMIT: tl.constexpr, BS: tl.constexpr,
):
    """Row b's channels ``rd`` of one conv, every node at once. With COMMIT, first shift these channels'
    pending accepted inputs into the conv state (the delayed update), then convolve from the updated state.
    ``x`` has strides ``(sxb, sxn, sxd)``: it may be a column slice of a wider tensor (a fused projection's
    output) or a transposed one (transformers' ``[B, D, N]``), read where it lies. ``y`` is contiguous, and
    so is ``x_rows``, where the block copies its ``x`` (the pass's factor record of this conv: a later
    commit copies it whole, which a slice would slow)."""
    rn = tl.arange(0, BN)
    mn = rn < N
    md = rd < D
    if COMMIT:
        shift_in(conv_state, pending_x, num_pending, b, rd, md, A, D, S, BS)
        tl.debug_barrier()  # the taps below read columns other threads of this program just wrote
    m2 = mn[:, None] & md[None, :]
    own = tl.load(x + b * sxb + rn[:, None] * sxn + rd[None, :] * sxd, mask=m2, other=0.0)
    tl.store(x_rows + (b * N + rn[:, None]) * D + rd[None, :], own, mask=m2)
    acc = own.to(tl.float32) * tl.load(weight + rd * W + (W - 1), mask=md, other=0.0).to(tl.float32)[None, :]
    node = rn  # the i-th ancestor of each node while it exists
    depth = tl.zeros([BN], dtype=tl.int32)  # real ancestors found so far
    alive = mn
    for i in tl.static_range(1, W):
        par = tl.load(parents + b * N + node, mask=alive, other=-1)
        alive = alive & (par >= 0)
        node = tl.where(alive, par, node)
        depth += alive.to(tl.int32)
        from_x = tl.load(x + b * sxb + node[:, None] * sxn + rd[None, :] * sxd, mask=m2 & alive[:, None], other=0.0)
        # past the root, tap W-1-i reads the conv state's column S - i + depth (depth < i there)
        col = S - i + depth
        from_state = tl.load(conv_state + (b * D + rd[None, :]) * S + col[:, None], mask=m2 & (alive == 0)[:, None],
                             other=0.0)
        tap = tl.where(alive[:, None], from_x.to(tl.float32), from_state.to(tl.float32))
        acc += tap * tl.load(weight + rd * W + (W - 1 - i), mask=md, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + rd, mask=md, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y + (b * N + rn[:, None]) * D + rd[None, :], acc.to(y.dtype.element_ty), mask=m2)


@triton.jit
def _tree_conv_kernel(
    x, sxb, sxn, sxd, conv_state, weight, bias, parents, y, x_rows, N, D, S, pending_x, num_pending, A,
    W: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    COMMIT: tl.constexpr, BS: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Grid: (B, channel blocks)."""
    wait_upstream(USE_PDL)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    _tree_conv_block(x, sxb, sxn, sxd, conv_state, weight, bias, parents, y, x_rows, tl.program_id(0), rd, N, D, S,
                     pending_x, num_pending, A, W, BN, BD, HAS_BIAS, SILU, COMMIT, BS)


@triton.jit
def _three_tree_convs_kernel(
    x0, x1, x2, sb0, sn0, sd0, sb1, sn1, sd1, sb2, sn2, sd2, s0, s1, s2, w0, w1, w2, p0, p1, p2, y0, y1, y2, r0, r1, r2, D0, D1, D2,
    parents, num_pending, N, S, A,
    W: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, SILU: tl.constexpr, BS: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Grid: (B, channel blocks of the widest conv, 3): the commit and tree conv of three bias-free convs
    (fla's q, k and v) in one launch; axis 2 picks the conv."""
    wait_upstream(USE_PDL)
    c = tl.program_id(2)  # (each weight also stands in as its bias pointer: HAS_BIAS is False, never read)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    b = tl.program_id(0)
    if c == 0:
        _tree_conv_block(x0, sb0, sn0, sd0, s0, w0, w0, parents, y0, r0, b, rd, N, D0, S, p0, num_pending, A, W, BN, BD, False, SILU, True, BS)
    elif c == 1:
        _tree_conv_block(x1, sb1, sn1, sd1, s1, w1, w1, parents, y1, r1, b, rd, N, D1, S, p1, num_pending, A, W, BN, BD, False, SILU, True, BS)
    else:
        _tree_conv_block(x2, sb2, sn2, sd2, s2, w2, w2, parents, y2, r2, b, rd, N, D2, S, p2, num_pending, A, W, BN, BD, False, SILU, True, BS)


@triton.jit
def _conv_commit_kernel(conv_state, x, num_accepted, A, D, S, BS: tl.constexpr, BD: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid: (B, channel blocks)."""
    wait_upstream(USE_PDL)
    rd = tl.program_id(1) * BD + tl.arange(0, BD)
    shift_in(conv_state, x, num_accepted, tl.program_id(0), rd, rd < D, A, D, S, BS)


def tree_conv(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    parents: torch.Tensor,
    silu: bool = True,
    *,
    pending: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_d: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tree short convolution, ``x [B, N, D]`` -> ``[B, N, D]`` (``reference.tree_conv_reference``), and a
    contiguous copy of ``x`` made on the way (the conv's factor record). With ``pending = (inputs [B, A, D],
    num_accepted [B])`` the same launch first commits them into ``conv_state`` in place
    (``specla::commit_tree_conv_``)."""
    if pending is not None and not conv_state.is_contiguous():
        raise ValueError("conv_state must be contiguous: it is updated in place")
    conv_state, weight, parents = (t.contiguous() for t in (conv_state, weight, parents))  # (x: read at its strides)
    batch, n, d = x.shape
    y, x_rows = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(2))
    block_n = max(16, triton.next_power_of_2(n))
    pending_x, num = (pending[0].contiguous(), pending[1]) if pending is not None else (x, parents)  # (unread without COMMIT)
    _tree_conv_kernel[(batch, triton.cdiv(d, block_d))](
        x, *x.stride(), conv_state, weight, bias if bias is not None else weight, parents, y, x_rows, n, d,
        conv_state.shape[2], pending_x, num, pending_x.shape[1],
        W=weight.shape[1], BN=block_n, BD=block_d, HAS_BIAS=bias is not None, SILU=silu,
        COMMIT=pending is not None, BS=triton.next_power_of_2(conv_state.shape[2]), **launch_args(x.device),
    )
    return y, x_rows


def fits_three_tree_convs(xs, conv_states, weights, pending_xs) -> bool:
    """Whether three convs can share one launch: the kernel takes one dtype per kind of tensor, one batch,
    state width, kernel width and pending count, and updates the states where they lie."""
    return (all(s.is_contiguous() for s in conv_states)
            and len({(s.shape[0], s.shape[2], s.dtype) for s in conv_states}) == 1
            and len({(x.shape[:2], x.dtype) for x in xs}) == 1
            and len({(w.shape[1], w.dtype) for w in weights}) == 1
            and len({(p.shape[1], p.dtype) for p in pending_xs}) == 1)


def three_tree_convs(
    xs: tuple[torch.Tensor, ...],
    conv_states: tuple[torch.Tensor, ...],
    weights: tuple[torch.Tensor, ...],
    pending_xs: tuple[torch.Tensor, ...],
    num_pending: torch.Tensor,
    parents: torch.Tensor,
    silu: bool = True,
    *,
    block_d: int = 128,
) -> tuple[torch.Tensor, ...]:
    """:func:`tree_conv` with ``pending`` of three bias-free convs (fla's q, k, v), in one launch: each
    commits its ``pending_xs`` into its contiguous ``conv_states`` in place, then convolves its ``xs``.
    Returns the three outputs, then the three contiguous copies of ``xs``."""
    if len({len(xs), len(conv_states), len(weights), len(pending_xs)} | {3}) != 1:
        raise ValueError("three_tree_convs takes three convs")
    if not fits_three_tree_convs(xs, conv_states, weights, pending_xs):
        raise ValueError("three_tree_convs needs contiguous conv states and one batch, state width, kernel width, "
                         "pending count and dtype per kind of tensor across the three convs")
    weights, pending_xs = ([t.contiguous() for t in ts] for ts in (weights, pending_xs))
    parents = parents.contiguous()
    batch, n, _ = xs[0].shape
    ys = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
    rows = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
    width = conv_states[0].shape[2]
    _three_tree_convs_kernel[(batch, triton.cdiv(max(x.shape[2] for x in xs), block_d), 3)](
        *xs, *(stride for x in xs for stride in x.stride()), *conv_states, *weights, *pending_xs, *ys, *rows,
        *(x.shape[2] for x in xs), parents, num_pending, n, width,
        pending_xs[0].shape[1], W=weights[0].shape[1], BN=max(16, triton.next_power_of_2(n)), BD=block_d, SILU=silu,
        BS=triton.next_power_of_2(width), **launch_args(parents.device),
    )
    return (*ys, *rows)


def conv_state_commit_(conv_state: torch.Tensor, x: torch.Tensor, num_accepted: torch.Tensor, *, block_d: int = 64) -> None:
    """Shift each row's first ``num_accepted[b]`` inputs of ``x [B, A, D]`` into ``conv_state [B, D, S]`` in place."""
    if not conv_state.is_contiguous():
        raise ValueError("conv_state must be contiguous: it is updated in place")
    batch, d, width = conv_state.shape
    x = x.contiguous()
    _conv_commit_kernel[(batch, triton.cdiv(d, block_d))](
        conv_state, x, num_accepted, x.shape[1], d, width, BS=triton.next_power_of_2(width), BD=block_d,
        **launch_args(x.device),
    )
