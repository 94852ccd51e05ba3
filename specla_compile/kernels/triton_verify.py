"""Triton kernels for GDN tree verification and factor-record commit (the math of ``reference.py``).

Three verify routes, each optionally fused with the delayed commit of pending accepted records:

* ``serial``: one program per (row, value head, V tile) keeps its ``K x BV`` fp32 state tile on chip
  and walks the nodes in topological order. Where the next node does not continue the previous one it
  resumes from a parked state: only nodes that a later, non-adjacent child starts from are parked
  (``snapshot`` parks every node instead: the per-token snapshot strategy of some serving systems).
* ``hybrid``: heavy-light chains, computed on chip from ``parents``; one program per chain. A chain's
  boundary state is re-derived by replaying its root path from the inputs (the factor records), so
  chains need no parked states, no inter-program waiting and no host-side decomposition.
* ``parallel``: the tree-masked UT form of DESIGN.md; the node count is padded to a power of two
  ``BT >= 16`` and ``(I + A)^-1`` is built by recursive block doubling on tensor cores.

Plain decoding's one-node pass has a kernel of its own, which also computes the layer's gate and beta from their
projections (``commit_verify_one_token_gates``, for the backend's ``fold_gates``).

Kernels take the topology as device tensors and never synchronize with the host (CUDA-graph safe).
The same code runs on CPU under ``TRITON_INTERPRET=1`` (the tests).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..tree import PAD
from .dispatch import ROUTES, KernelConfig, early_commit
from .pdl import enabled, launch_args, wait_upstream
from .reference import L2NORM_EPS
from .triton_conv import one_node_conv, shift_in

_EPS: tl.constexpr = tl.constexpr(L2NORM_EPS)
_PAD: tl.constexpr = tl.constexpr(PAD)


# --- building blocks ------------------------------------------------------------------------------


@triton.jit
def _state_tile(i_v, i_bh, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BKF: tl.constexpr,
                BV: tl.constexpr, SK: tl.constexpr, SV: tl.constexpr):
    """Program (V tile ``i_v``, row and value head ``i_bh``)'s row, value head, key head, K and V ranges with their
    masks, and its ``K x BV`` tile's offsets and mask in the durable state's layout."""
    hv = i_bh % HV
    rk = tl.arange(0, BKF)
    rv = i_v * BV + tl.arange(0, BV)
    mk, mv = rk < K, rv < V
    tile_off = i_bh.to(tl.int64) * K * V + rk[:, None] * SK + rv[None, :] * SV
    return i_bh // HV, hv, hv // (HV // H), rk, mk, rv, mv, tile_off, mk[:, None] & mv[None, :]


@triton.jit
def _load_qkv(q, k, v, b, j, h, hv, N, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
              rk, mk, rv, mv):
    qk = ((b * N + j) * H + h) * K + rk
    return (tl.load(q + qk, mask=mk, other=0.0).to(tl.float32),
            tl.load(k + qk, mask=mk, other=0.0).to(tl.float32),
            tl.load(v + ((b * N + j) * HV + hv) * V + rv, mask=mv, other=0.0).to(tl.float32))


@triton.jit
def _load_node(q, k, v, g, beta, b, j, h, hv, N, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
               V: tl.constexpr, rk, mk, rv, mv):
    """Raw inputs of node j (clamped to the last node, so a walk may read one past its end). The walks
    issue these one node ahead: their memory latency overlaps the previous step instead of stalling it."""
    j = tl.minimum(j, N - 1)
    gate = (b * N + j) * HV + hv
    qj, kj, vj = _load_qkv(q, k, v, b, j, h, hv, N, H, HV, K, V, rk, mk, rv, mv)
    return qj, kj, vj, tl.load(g + gate).to(tl.float32), tl.load(beta + gate).to(tl.float32)


@triton.jit
def _softplus(x):
    """torch's softplus: ``log(1 + e^x)``, ``x`` itself past 20; ``log1p`` stays exact for a tiny ``e^x``
    (``w - 1`` is the ``e^x`` that ``w = 1 + e^x`` kept)."""
    u = tl.exp(tl.minimum(x, 20.0, propagate_nan=tl.PropagateNan.ALL))  # (a NaN stays NaN, as in torch)
    w = 1.0 + u
    return tl.where(x > 20.0, x, tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0))))


@triton.jit
def _gates_of(a, b, a_log, dt_bias, hv):
    """fla's gate and beta of value head ``hv`` from their float32 projections ``a``, ``b`` (one node's or a vector of
    nodes'): ``-exp(A_log) * softplus(a + dt_bias)`` and ``sigmoid(b)``."""
    g = -tl.exp(tl.load(a_log + hv).to(tl.float32)) * _softplus(a + tl.load(dt_bias + hv).to(tl.float32))
    return g, tl.sigmoid(b)


@triton.jit
def _step(s, k, v, g, beta):
    """S <- alpha S; d = beta (v - S^T k); S <- S + k d^T (no output)."""
    s = s * tl.exp(g)
    d = beta * (v - tl.sum(s * k[:, None], 0))
    return s + k[:, None] * d[None, :]


@triton.jit
def _step_out(s, q, k, v, g, beta, scale, USE_L2: tl.constexpr):
    """The step plus o = scale S'^T q, with both K-reductions taken from alpha S so they run side by side."""
    if USE_L2:
        q = q * tl.rsqrt(tl.sum(q * q, 0) + _EPS)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + _EPS)
    s = s * tl.exp(g)
    d = beta * (v - tl.sum(s * k[:, None], 0))
    o = scale * (tl.sum(s * q[:, None], 0) + tl.sum(q * k, 0) * d)
    return s + k[:, None] * d[None, :], o


@triton.jit
def _apply_records(s, pk, pv, pg, pb, num_ptr, b, hv, h, A, H: tl.constexpr, HV: tl.constexpr,
                   K: tl.constexpr, V: tl.constexpr, rk, mk, rv, mv):
    """Apply row b's first ``num`` pending records (normalized keys) to the state tile, each record
    loaded one step ahead."""
    num = tl.minimum(tl.load(num_ptr + b).to(tl.int32), A)
    # records have no query: the key pointer stands in for it and the copy is dropped
    _, kn, vn, gn, bn = _load_node(pk, pk, pv, pg, pb, b, 0, h, hv, A, H, HV, K, V, rk, mk, rv, mv)
    for i in range(num):
        ki, vi, gi, bi = kn, vn, gn, bn
        _, kn, vn, gn, bn = _load_node(pk, pk, pv, pg, pb, b, i + 1, h, hv, A, H, HV, K, V, rk, mk, rv, mv)
        s = _step(s, ki, vi, gi, bi)
    return s


@triton.jit
def _store_k_hat(k, k_hat, b, h, N, H: tl.constexpr, K: tl.constexpr, BKF: tl.constexpr,
                 USE_L2: tl.constexpr, first, stride):
    """Emit the normalized keys of row b, head h (the verify's factor-record output) for the blocks of 16
    nodes ``first, first + stride, ...``: the V-tile programs share the work, one block each."""
    rk = tl.arange(0, BKF)
    for n0 in range(first * 16, N, stride * 16):
        rr = n0 + tl.arange(0, 16)
        m = (rr < N)[:, None] & (rk < K)[None, :]
        off = ((b * N + rr[:, None]) * H + h) * K + rk[None, :]
        x = tl.load(k + off, mask=m, other=0.0).to(tl.float32)
        if USE_L2:
            x = x * tl.rsqrt(tl.sum(x * x, 1) + _EPS)[:, None]
        tl.store(k_hat + off, x, mask=m)


@triton.jit
def _ancestor_matrix(prow, rn, LOG2BN: tl.constexpr):
    """incl[j, m]: m is j or an ancestor of j. Reachability squared log2(BN) times (exact: 0/1 operands)."""
    reach = ((prow[:, None] == rn[None, :]) | (rn[:, None] == rn[None, :])).to(tl.float32)
    for _ in tl.static_range(LOG2BN):
        reach = tl.minimum(tl.dot(reach, reach), 1.0)
    return reach > 0.5


@triton.jit
def _heavy_light(prow, incl, rn, N):
    """Heavy-light decomposition on chip (the rule of ``topology.chain_decomposition``): every node
    continues into its child with the largest subtree, ties to the earliest child. Returns
    (is_start, head, depth): chain starts, each node's chain start, each node's depth."""
    size = tl.sum(incl.to(tl.int32), 0)
    score = size * (2 * rn.shape[0]) - rn
    child = prow[:, None] == rn[None, :]  # [j, p]: p is j's parent
    best = tl.max(tl.where(child, score[:, None], -1), 0)
    best_of_parent = tl.sum(tl.where(child, best[None, :], 0), 1)
    is_start = (rn < N) & ((prow < 0) | (score != best_of_parent))
    head = tl.max(tl.where(incl & is_start[None, :], rn[None, :], -1), 1)
    depth = tl.sum(incl.to(tl.int32), 1) - 1
    return is_start, head, depth


@triton.jit
def _ut_inverse(incl, gamma, beta, kk, rt, LOG2BT: tl.constexpr, PREC: tl.constexpr):
    """The UT form's ``(decay, (I + A)^-1)`` for nodes whose ancestors (themselves included) are ``incl``, with running
    log decays ``gamma`` and raw key products ``kk``: ``decay[j, m] = e^(gamma_j - gamma_m)`` for m an ancestor of j,
    ``A[j, m] = beta_j decay[j, m] kk[j, m]`` for a strict one (the verify's tree, a commit's chain of records)."""
    decay = tl.where(incl, tl.exp(tl.where(incl, gamma[:, None] - gamma[None, :], 0.0)), 0.0)
    a = tl.where(incl & (rt[:, None] != rt[None, :]), beta[:, None] * decay * kk, 0.0)
    return decay, _unit_lower_inverse(a, rt, LOG2BT, PREC)


@triton.jit
def _unit_lower_inverse(a, rt, LOG2BT: tl.constexpr, PREC: tl.constexpr):
    """(I + a)^-1 for strictly lower ``a``: at level l the inverse of every 2^(l+1) diagonal block is
    D - D A_off D from the inverses D of its two halves (stable, no alternating power series)."""
    t = (rt[:, None] == rt[None, :]).to(tl.float32)
    for lvl in tl.static_range(LOG2BT):
        half = 1 << lvl
        off = (rt[:, None] // (2 * half) == rt[None, :] // (2 * half)) & (rt[:, None] // half != rt[None, :] // half)
        t = t - tl.dot(tl.dot(t, tl.where(off, a, 0.0), input_precision=PREC), t, input_precision=PREC)
    return t


# --- kernels --------------------------------------------------------------------------------------


@triton.jit
def _recurrent_kernel(
    q, k, v, g, beta, parents, state, o, k_hat, parked, counter,
    pk, pv, pg, pb, num_pending,
    scale, N, A,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BKF: tl.constexpr, BV: tl.constexpr, BN: tl.constexpr, LOG2BN: tl.constexpr,
    USE_L2: tl.constexpr, HAS_PENDING: tl.constexpr, VERIFY: tl.constexpr, HYBRID: tl.constexpr,
    SNAPSHOT: tl.constexpr, SK: tl.constexpr, SV: tl.constexpr, EARLY: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Serial route (grid z = 1), hybrid route (grid z = N, one program per chain) and the standalone
    commit (VERIFY = False); with EARLY (not HYBRID) the commit runs before the PDL wait
    (:func:`.dispatch.commits_before_wait`). Grid: (V tiles, B * HV, z)."""
    if not EARLY:
        wait_upstream(USE_PDL)
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    c = tl.program_id(2)
    b, hv, h, rk, mk, rv, mv, tile_off, tile_mask = _state_tile(i_v, i_bh, H, HV, K, V, BKF, BV, SK, SV)
    rn = tl.arange(0, BN)
    n_chains = 1
    if HYBRID:
        prow = tl.load(parents + b * N + rn, mask=rn < N, other=_PAD)
        # chains = real nodes - nodes with a child (each has one heavy child): idle programs leave early
        has_child = tl.max(((prow[:, None] == rn[None, :]) & (prow[:, None] >= 0)).to(tl.int32), 0)
        n_chains = tl.sum((rn < N).to(tl.int32), 0) - tl.sum(has_child, 0)
    if c < n_chains:
        if HYBRID:
            s0 = tl.load(state + tile_off, mask=tile_mask, other=0.0)
            if HAS_PENDING:
                s0 = _apply_records(s0, pk, pv, pg, pb, num_pending, b, hv, h, A, H, HV, K, V, rk, mk, rv, mv)
                # every chain program reads the old tile; the last one to finish reading writes the new one
                tl.debug_barrier()
                seen = tl.atomic_add(counter + i_bh * tl.num_programs(0) + i_v, 1)
                if seen == n_chains - 1:
                    tl.store(state + tile_off, s0, mask=tile_mask)
        else:
            s0 = _committed_tile(state, tile_off, tile_mask, pk, pv, pg, pb, num_pending, b, hv, h, A, H, HV, K, V,
                                 rk, mk, rv, mv, HAS_PENDING)
        if EARLY:
            wait_upstream(USE_PDL)  # (the commit above read only what earlier passes wrote)
        if VERIFY:
            if (hv % (HV // H) == 0) & (c == 0):
                _store_k_hat(k, k_hat, b, h, N, H, K, BKF, USE_L2, i_v, tl.num_programs(0))
            if HYBRID:
                # walk the root path of this chain's start (no outputs), then the chain itself
                incl = _ancestor_matrix(prow, rn, LOG2BN)
                is_start, head, depth = _heavy_light(prow, incl, rn, N)
                rank = tl.cumsum(is_start.to(tl.int32), 0) - 1
                start = tl.sum(tl.where(is_start & (rank == c), rn, 0), 0)
                emit_from = tl.sum(tl.where(rn == start, depth, 0), 0)
                on_path = (tl.sum(tl.where(rn[:, None] == start, incl.to(tl.int32), 0), 0) > 0) | (head == start)
                steps = emit_from + tl.sum((head == start).to(tl.int32), 0)
            else:
                steps = N
                park_base = parked + (i_bh.to(tl.int64) * N * K) * V + rk[:, None] * V + rv[None, :]
                prow = tl.load(parents + b * N + rn, mask=rn < N, other=_PAD)
                p_next = tl.load(parents + b * N)
            j_next = tl.full([], 0, tl.int32)
            if HYBRID:
                j_next = tl.sum(tl.where(on_path & (depth == 0), rn, 0), 0)
            qn, kn, vn, gn, bn = _load_node(q, k, v, g, beta, b, j_next, h, hv, N, H, HV, K, V, rk, mk, rv, mv)
            s = s0
            for t in range(steps):
                j = j_next
                qj, kj, vj, gj, bj = qn, kn, vn, gn, bn
                if HYBRID:
                    j_next = tl.sum(tl.where(on_path & (depth == t + 1), rn, 0), 0)
                else:
                    j_next = t + 1
                    p = p_next
                    p_next = tl.load(parents + b * N + tl.minimum(j_next, N - 1))
                qn, kn, vn, gn, bn = _load_node(q, k, v, g, beta, b, j_next, h, hv, N, H, HV, K, V, rk, mk, rv, mv)
                if not HYBRID:
                    if p != j - 1:
                        if p < 0:  # a root (or padding): from the durable state
                            s = s0
                        else:
                            tl.debug_barrier()  # the parked tile was written by other threads
                            s = tl.load(park_base + p * K * V, mask=tile_mask, other=0.0)
                s, oj = _step_out(s, qj, kj, vj, gj, bj, scale, USE_L2)
                o_ptr = o + ((b * N + j) * HV + hv) * V + rv
                if HYBRID:
                    if t >= emit_from:  # past the boundary: this chain's own nodes
                        tl.store(o_ptr, oj.to(o.dtype.element_ty), mask=mv)
                else:
                    tl.store(o_ptr, oj.to(o.dtype.element_ty), mask=mv)
                    if SNAPSHOT:
                        tl.store(park_base + j * K * V, s, mask=tile_mask)
                    else:
                        if tl.sum(((prow == j) & (rn > j + 1)).to(tl.int32), 0) > 0:
                            tl.store(park_base + j * K * V, s, mask=tile_mask)


@triton.jit
def _parallel_kernel(
    q, k, v, g, beta, parents, state, o, k_hat,
    pk, pv, pg, pb, num_pending,
    a, b_proj, a_log, dt_bias, SA_ROW, SA_NODE, SA_HEAD, SB_ROW, SB_NODE, SB_HEAD,
    scale, N, A,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, LOG2BT: tl.constexpr,
    USE_L2: tl.constexpr, HAS_PENDING: tl.constexpr, GATES: tl.constexpr, PREC: tl.constexpr, SK: tl.constexpr,
    SV: tl.constexpr, EARLY: tl.constexpr, USE_PDL: tl.constexpr,
):
    """Tree-masked UT verify from the state tile (after the fused commit when HAS_PENDING: a row's records one at a
    time; with EARLY before the PDL wait, :func:`.dispatch.commits_before_wait`).
    Grid: (V tiles, B * HV). The K dimension streams in chunks of BK; raw dot products are
    rescaled by the row norms afterwards, so normalization costs no extra pass. With GATES, each node's gate and beta
    come from their projections (``a``, ``b_proj`` at any strides) and ``g``, ``beta`` receive them (the records)."""
    if not EARLY:
        wait_upstream(USE_PDL)
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    b = i_bh // HV
    hv = i_bh % HV
    h = hv // (HV // H)
    rv = i_v * BV + tl.arange(0, BV)
    mv = rv < V
    state_tile = state + i_bh.to(tl.int64) * K * V
    if HAS_PENDING:
        rkf = tl.arange(0, BKF)
        _committed_tile(state_tile, rkf[:, None] * SK + rv[None, :] * SV, (rkf < K)[:, None] & mv[None, :], pk, pv, pg,
                        pb, num_pending, b, hv, h, A, H, HV, K, V, rkf, rkf < K, rv, mv, HAS_PENDING)
        tl.debug_barrier()  # the chunks below re-read the tile other threads just wrote
    if EARLY:
        wait_upstream(USE_PDL)  # (the commit above read only what earlier passes wrote)
    if hv % (HV // H) == 0:
        _store_k_hat(k, k_hat, b, h, N, H, K, BKF, USE_L2, i_v, tl.num_programs(0))

    rt = tl.arange(0, BT)
    mt = rt < N
    prow = tl.load(parents + b * N + rt, mask=mt, other=_PAD)
    incl = _ancestor_matrix(prow, rt, LOG2BT)
    if not GATES:
        gt = tl.load(g + (b * N + rt) * HV + hv, mask=mt, other=0.0).to(tl.float32)
        bt = tl.load(beta + (b * N + rt) * HV + hv, mask=mt, other=0.0).to(tl.float32)
        gamma = tl.sum(tl.where(incl, gt[None, :], 0.0), 1)

    kk = tl.zeros([BT, BT], dtype=tl.float32)
    qk = tl.zeros([BT, BT], dtype=tl.float32)
    ks = tl.zeros([BT, BV], dtype=tl.float32)
    qs = tl.zeros([BT, BV], dtype=tl.float32)
    k_sq = tl.zeros([BT], dtype=tl.float32)
    q_sq = tl.zeros([BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        mk = rk < K
        node_off = ((b * N + rt[:, None]) * H + h) * K + rk[None, :]
        node_mask = mt[:, None] & mk[None, :]
        kc = tl.load(k + node_off, mask=node_mask, other=0.0).to(tl.float32)
        qc = tl.load(q + node_off, mask=node_mask, other=0.0).to(tl.float32)
        sc = tl.load(state_tile + rk[:, None] * SK + rv[None, :] * SV, mask=mk[:, None] & mv[None, :], other=0.0)
        kk += tl.dot(kc, tl.trans(kc), input_precision=PREC)
        qk += tl.dot(qc, tl.trans(kc), input_precision=PREC)
        ks += tl.dot(kc, sc, input_precision=PREC)
        qs += tl.dot(qc, sc, input_precision=PREC)
        k_sq += tl.sum(kc * kc, 1)
        q_sq += tl.sum(qc * qc, 1)
    if USE_L2:
        k_inv = tl.rsqrt(k_sq + _EPS)
        q_inv = tl.rsqrt(q_sq + _EPS)
        kk = kk * k_inv[:, None] * k_inv[None, :]
        qk = qk * q_inv[:, None] * k_inv[None, :]
        ks = ks * k_inv[:, None]
        qs = qs * q_inv[:, None]

    if GATES:  # (after the K loop: fewer registers live across it, measured offline at 32 nodes)
        a_t = tl.load(a + b * SA_ROW + rt * SA_NODE + hv * SA_HEAD, mask=mt, other=0.0).to(tl.float32)
        b_t = tl.load(b_proj + b * SB_ROW + rt * SB_NODE + hv * SB_HEAD, mask=mt, other=0.0).to(tl.float32)
        gt, bt = _gates_of(a_t, b_t, a_log, dt_bias, hv)
        gt, bt = tl.where(mt, gt, 0.0), tl.where(mt, bt, 0.0)
        if i_v == 0:
            tl.store(g + (b * N + rt) * HV + hv, gt, mask=mt)
            tl.store(beta + (b * N + rt) * HV + hv, bt, mask=mt)
        gamma = tl.sum(tl.where(incl, gt[None, :], 0.0), 1)
    decay, t_inv = _ut_inverse(incl, gamma, bt, kk, rt, LOG2BT, PREC)
    val_off = ((b * N + rt[:, None]) * HV + hv) * V + rv[None, :]
    val_mask = mt[:, None] & mv[None, :]
    vt = tl.load(v + val_off, mask=val_mask, other=0.0).to(tl.float32)
    eg = tl.exp(gamma)
    u = tl.dot(t_inv, bt[:, None] * (vt - eg[:, None] * ks), input_precision=PREC)
    out = scale * (eg[:, None] * qs + tl.dot(decay * qk, u, input_precision=PREC))
    tl.store(o + val_off, out.to(o.dtype.element_ty), mask=val_mask)


@triton.jit
def _node_gates(a, b_proj, a_log, dt_bias, row, hv, SA_ROW, SA_HEAD, SB_ROW, SB_HEAD):
    """fla's gates of row ``row``'s value head ``hv`` from their projections (:func:`_gates_of`)."""
    return _gates_of(tl.load(a + row * SA_ROW + hv * SA_HEAD).to(tl.float32),
                     tl.load(b_proj + row * SB_ROW + hv * SB_HEAD).to(tl.float32), a_log, dt_bias, hv)


@triton.jit
def _committed_tile(state, tile_off, tile_mask, pk, pv, pg, pb, num_pending, row, hv, h, A, H: tl.constexpr,
                    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, rk, mk, rv, mv, HAS_PENDING: tl.constexpr):
    """The program's state tile with the row's pending records applied, written back (the delayed commit)."""
    s = tl.load(state + tile_off, mask=tile_mask, other=0.0)
    if HAS_PENDING:
        s = _apply_records(s, pk, pv, pg, pb, num_pending, row, hv, h, A, H, HV, K, V, rk, mk, rv, mv)
        if tl.load(num_pending + row) > 0:  # (nothing to write back where nothing was pending)
            tl.store(state + tile_off, s, mask=tile_mask)
    return s


@triton.jit
def _one_token_gates_kernel(
    q, k, v, a, b_proj, a_log, dt_bias, state, o, k_hat, g_out, beta_out,
    pk, pv, pg, pb, num_pending,
    scale, A, SA_ROW, SA_HEAD, SB_ROW, SB_HEAD,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr,
    USE_L2: tl.constexpr, HAS_PENDING: tl.constexpr, SK: tl.constexpr, SV: tl.constexpr, EARLY: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Plain decoding's step of a GDN layer in one launch: commit the pending records (with EARLY before the PDL
    wait, :func:`.dispatch.commits_before_wait`), then run the one node from the committed state, its gate and beta
    computed here from their projections (``a``, ``b_proj`` at any strides) rather than by a kernel of their own.
    Grid: (V tiles, B * HV)."""
    if not EARLY:
        wait_upstream(USE_PDL)
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    row, hv, h, rk, mk, rv, mv, tile_off, tile_mask = _state_tile(i_v, i_bh, H, HV, K, V, BKF, BV, SK, SV)
    s = _committed_tile(state, tile_off, tile_mask, pk, pv, pg, pb, num_pending, row, hv, h, A, H, HV, K, V,
                        rk, mk, rv, mv, HAS_PENDING)
    if EARLY:
        wait_upstream(USE_PDL)  # (the commit above read only what earlier passes wrote)
    qj, kj, vj = _load_qkv(q, k, v, row, 0, h, hv, 1, H, HV, K, V, rk, mk, rv, mv)
    g, beta = _node_gates(a, b_proj, a_log, dt_bias, row, hv, SA_ROW, SA_HEAD, SB_ROW, SB_HEAD)
    if i_v == 0:  # the node's records: its gates, and its normalized key once per key head
        tl.store(g_out + i_bh, g)
        tl.store(beta_out + i_bh, beta)
        if hv % (HV // H) == 0:
            _store_k_hat(k, k_hat, row, h, 1, H, K, BKF, USE_L2, 0, 1)
    s, oj = _step_out(s, qj, kj, vj, g, beta, scale, USE_L2)
    tl.store(o + (row * HV + hv) * V + rv, oj.to(o.dtype.element_ty), mask=mv)


@triton.jit
def _one_token_conv_gates_kernel(
    xq, xk, xv, SXB_Q, SXD_Q, SXB_K, SXD_K, SXB_V, SXD_V, conv_q, conv_k, conv_v, px_q, px_k, px_v, w_q, w_k, w_v,
    rows_q, rows_k, rows_v, v_out, readers, conv_num, S, AX,
    a, b_proj, a_log, dt_bias, state, o, k_hat, g_out, beta_out,
    pk, pv, pg, pb, num_pending,
    scale, A, SA_ROW, SA_HEAD, SB_ROW, SB_HEAD,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BKF: tl.constexpr, BV: tl.constexpr,
    W: tl.constexpr, BS: tl.constexpr, SILU: tl.constexpr, USE_L2: tl.constexpr, HAS_PENDING: tl.constexpr,
    SK: tl.constexpr, SV: tl.constexpr, EARLY: tl.constexpr, USE_PDL: tl.constexpr,
):
    """:func:`_one_token_gates_kernel` from the projection itself: the node's q/k/v short convs (``x*`` at any
    strides) run here too, from their conv states as committing each row's first ``conv_num`` pending inputs
    (``px_*``) leaves them; the inputs are copied out as the pass's conv records (``rows_*``) and v's conv output as
    its v record (``v_out``). Every V-tile
    program of a key head reads the head's q/k conv windows, so the last of them to finish reading commits those
    (its arrival counted in ``readers [B * H]``, which it leaves at zero); a program commits its own v channels.
    Grid: (V tiles, B * HV)."""
    if not EARLY:
        wait_upstream(USE_PDL)
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1)
    row, hv, h, rk, mk, rv, mv, tile_off, tile_mask = _state_tile(i_v, i_bh, H, HV, K, V, BKF, BV, SK, SV)
    s = _committed_tile(state, tile_off, tile_mask, pk, pv, pg, pb, num_pending, row, hv, h, A, H, HV, K, V,
                        rk, mk, rv, mv, HAS_PENDING)
    if EARLY:
        wait_upstream(USE_PDL)  # (the commit above read only what earlier passes wrote)
    num_x = tl.minimum(tl.load(conv_num + row).to(tl.int32), AX)
    qc, vc = h * K + rk, hv * V + rv  # the channels of key head h and of this V tile
    qj, xq_j = one_node_conv(xq + row * SXB_Q, SXD_Q, conv_q, px_q, w_q, row, qc, mk, num_x, H * K, S, AX, W, SILU)
    kj, xk_j = one_node_conv(xk + row * SXB_K, SXD_K, conv_k, px_k, w_k, row, qc, mk, num_x, H * K, S, AX, W, SILU)
    vj, xv_j = one_node_conv(xv + row * SXB_V, SXD_V, conv_v, px_v, w_v, row, vc, mv, num_x, HV * V, S, AX, W, SILU)
    tl.store(rows_v + row * HV * V + vc, xv_j, mask=mv)
    tl.store(v_out + row * HV * V + vc, vj.to(v_out.dtype.element_ty), mask=mv)
    g, beta = _node_gates(a, b_proj, a_log, dt_bias, row, hv, SA_ROW, SA_HEAD, SB_ROW, SB_HEAD)
    if i_v == 0:  # the node's records: its gates, and once per key head its q/k inputs and normalized key
        tl.store(g_out + i_bh, g)
        tl.store(beta_out + i_bh, beta)
        if hv % (HV // H) == 0:
            tl.store(rows_q + row * H * K + qc, xq_j, mask=mk)
            tl.store(rows_k + row * H * K + qc, xk_j, mask=mk)
            k_norm = kj
            if USE_L2:
                k_norm = kj * tl.rsqrt(tl.sum(kj * kj, 0) + _EPS)
            tl.store(k_hat + (row * H + h) * K + rk, k_norm, mask=mk)
    s, oj = _step_out(s, qj, kj, vj, g, beta, scale, USE_L2)
    tl.store(o + (row * HV + hv) * V + rv, oj.to(o.dtype.element_ty), mask=mv)
    # the conv states' delayed commits, once every thread of the program has read its windows
    tl.debug_barrier()
    shift_in(conv_v, px_v, conv_num, row, vc, mv, AX, HV * V, S, BS)  # (no other program reads these channels)
    arrived = tl.atomic_add(readers + row * H + h, 1, sem="acq_rel")  # (release: this program's reads came first)
    if arrived == tl.num_programs(0) * (HV // H) - 1:  # the head's last reader
        shift_in(conv_q, px_q, conv_num, row, qc, mk, AX, H * K, S, BS)
        shift_in(conv_k, px_k, conv_num, row, qc, mk, AX, H * K, S, BS)
        tl.store(readers + row * H + h, 0)


# --- launchers ------------------------------------------------------------------------------------


class Pending(NamedTuple):
    """Accepted records still to be applied to the durable state (the delayed update)."""

    k: torch.Tensor  # [B, A, H, K], normalized keys
    v: torch.Tensor  # [B, A, HV, V]
    g: torch.Tensor  # [B, A, HV]
    beta: torch.Tensor  # [B, A, HV]
    num: torch.Tensor  # [B]


class GateProjections(NamedTuple):
    """What fla's gates are computed from, where a launch computes them itself (the backend's ``fold_gates``)."""

    a: torch.Tensor  # [B, N, HV], any strides: -exp(A_log) * softplus(a + dt_bias)
    b: torch.Tensor  # [B, N, HV], any strides: sigmoid(b)
    a_log: torch.Tensor  # [HV]
    dt_bias: torch.Tensor  # [HV]


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, triton.next_power_of_2(n))


def state_strides(state: torch.Tensor) -> tuple[int, int] | None:
    """``(K stride, V stride)`` of a ``[B, HV, K, V]`` state that the kernels read and update where it
    lies: contiguous, or the transpose of a contiguous ``[B, HV, V, K]`` (as fla keeps it); else None."""
    dk, dv = state.shape[-2:]
    if state.is_contiguous():
        return dv, 1
    if state.transpose(-1, -2).is_contiguous():
        return 1, dk
    return None


def _strides(state: torch.Tensor) -> tuple[int, int]:
    strides = state_strides(state)
    if strides is None:
        raise ValueError(f"the GDN state must be contiguous as [B, HV, K, V] or [B, HV, V, K], got strides {state.stride()}")
    return strides


def _pending_args(pending: Pending | None, state: torch.Tensor) -> tuple[list[torch.Tensor], int, bool, bool]:
    """The records' kernel arguments, their count, HAS_PENDING, and EARLY: whether the launch may commit them before
    its PDL wait (:func:`.dispatch.commits_before_wait`, and no copy of a record launched here just before it)."""
    if pending is None or pending.k.shape[1] == 0:
        return [state] * 5, 0, False, False  # never read: HAS_PENDING is off
    early = early_commit(state) and enabled(state.device) and all(t.is_contiguous() for t in pending)
    return [t.contiguous() for t in pending], pending.k.shape[1], True, early


def tree_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    *,
    route: str,
    pending: Pending | None = None,
    config: KernelConfig | None = None,
    snapshot: torch.Tensor | None = None,
    gates: GateProjections | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a tree with one route; returns ``(o, k_hat)`` like ``specla::gdn_tree_verify``.

    ``pending`` first commits accepted records into ``state`` in place (``specla::gdn_commit_verify_``).
    ``snapshot [B, HV, N, K, V]`` (serial route only) receives every node's state. ``gates`` (parallel route only):
    the launch computes each node's gate and beta from them (``specla::gdn_gates_commit_verify_``) and writes them
    into ``g`` and ``beta``, contiguous."""
    if route not in ROUTES:
        raise ValueError(f"unknown route {route!r}; expected one of {ROUTES}")
    if snapshot is not None and route != "serial":
        raise ValueError("snapshot is only produced by the serial route")
    if gates is not None and (route != "parallel" or not (g.is_contiguous() and beta.is_contiguous())
                              or gates[0].shape != g.shape or gates[1].shape != g.shape):
        raise ValueError("gates are computed in the parallel route's launch alone, from a and b [B, N, HV] into "
                         "contiguous g and beta of their shape")
    config = config or KernelConfig()
    if pending is not None and config.separate_commit is not None:
        commit_(state, *pending, config=config.separate_commit)
        pending = None
    q, k, v, g, beta, parents = (t.contiguous() for t in (q, k, v, g, beta, parents))
    batch, n, heads, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    o = torch.empty_like(v)
    k_hat = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    (pk, pv, pg, pb, num), n_pending, has_pending, early = _pending_args(pending, state)
    block_v = min(config.block_v, _pow2_at_least(dv, 16))
    if route == "parallel":
        block_v = max(block_v, 16)  # tensor-core products need 16 columns
    grid_v = triton.cdiv(dv, block_v)
    sk, sv = _strides(state)
    shape = dict(H=heads, HV=hv, K=dk, V=dv, BKF=_pow2_at_least(dk, 16), BV=block_v, USE_L2=use_qk_l2norm,
                 HAS_PENDING=has_pending, SK=sk, SV=sv, num_warps=config.num_warps)
    if route == "parallel":
        bt = _pow2_at_least(n, 16)
        a, b, a_log, dt_bias = gates if gates is not None else (g, g, g, g)  # (unread without GATES)
        _parallel_kernel[(grid_v, batch * hv)](
            q, k, v, g, beta, parents, state, o, k_hat, pk, pv, pg, pb, num,
            a, b, a_log.contiguous(), dt_bias.contiguous(), *a.stride(), *b.stride(), scale, n, n_pending,
            BK=min(config.block_k, shape["BKF"]), BT=bt, LOG2BT=bt.bit_length() - 1, GATES=gates is not None,
            EARLY=early,
            # tf32 keeps the error under a bf16 output's rounding; fp32 inputs get fp32-grade products
            PREC="tf32x3" if v.dtype == torch.float32 else "tf32", **shape, **launch_args(q.device),
        )
        return o, k_hat
    hybrid = route == "hybrid"
    bn = _pow2_at_least(n, 16)
    if snapshot is not None:
        parked = snapshot
    else:  # only branch points are written; sized for the worst case, never cleared
        parked = state.new_empty(batch, hv, n, dk, dv) if (n > 2 and not hybrid) else state
    counter = torch.zeros(batch * hv * grid_v, dtype=torch.int32, device=q.device) if (hybrid and has_pending) else num
    _recurrent_kernel[(grid_v, batch * hv, n if hybrid else 1)](
        q, k, v, g, beta, parents, state, o, k_hat, parked, counter, pk, pv, pg, pb, num, scale, n, n_pending,
        BN=bn, LOG2BN=bn.bit_length() - 1, VERIFY=True, HYBRID=hybrid, SNAPSHOT=snapshot is not None,
        EARLY=early and not hybrid, **shape,  # (the hybrid route reads the parents before its commit: it waits first)
        **launch_args(q.device),
    )
    return o, k_hat


def commit_(
    state: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    num_accepted: torch.Tensor,
    *,
    config: KernelConfig | None = None,
) -> None:
    """Apply each row's first ``num_accepted[b]`` records to ``state`` in place (``specla::gdn_commit_``)."""
    config = config or KernelConfig()
    pending = Pending(k, v, g, beta, num_accepted)
    (pk, pv, pg, pb, num), n_pending, has_pending, early = _pending_args(pending, state)
    if not has_pending:
        return
    batch, _, heads, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    sk, sv = _strides(state)
    block_v = min(config.block_v, _pow2_at_least(dv, 16))
    grid_v = triton.cdiv(dv, block_v)
    unused = state  # verify-only pointers (VERIFY is off: any tensor stands in, here state and num)
    _recurrent_kernel[(grid_v, batch * hv, 1)](
        unused, unused, unused, unused, unused, num, state, unused, unused, unused, num,
        pk, pv, pg, pb, num, 1.0, 0, n_pending,
        H=heads, HV=hv, K=dk, V=dv, BKF=_pow2_at_least(dk, 16), BV=block_v, BN=16, LOG2BN=4, USE_L2=False,
        HAS_PENDING=True, VERIFY=False, HYBRID=False, SNAPSHOT=False, SK=sk, SV=sv, EARLY=early,
        num_warps=config.num_warps,
        **launch_args(state.device),
    )


def _one_token_launch(kernel, inputs: tuple, heads: int, dk: int, hv: int, dv: int, dtype: torch.dtype,
                      gates: GateProjections, state: torch.Tensor, scale: float, use_qk_l2norm: bool,
                      pending: Pending | None, config: KernelConfig | None,
                      **constexprs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch a one-node gates kernel over (V tiles, B * HV) after its own ``inputs``; returns ``(o, k_hat, g, beta)``."""
    config = config or KernelConfig()
    a, b, a_log, dt_bias = gates
    batch, device = a.shape[0], a.device
    o = torch.empty(batch, 1, hv, dv, dtype=dtype, device=device)
    k_hat = torch.empty(batch, 1, heads, dk, dtype=torch.float32, device=device)
    g = torch.empty(batch, 1, hv, dtype=torch.float32, device=device)
    beta = torch.empty_like(g)
    (pk, pv, pg, pb, num), n_pending, has_pending, early = _pending_args(pending, state)
    block_v = min(config.block_v, _pow2_at_least(dv, 16))
    sk, sv = _strides(state)
    kernel[(triton.cdiv(dv, block_v), batch * hv)](
        *inputs, a, b, a_log.contiguous(), dt_bias.contiguous(), state, o, k_hat, g, beta, pk, pv, pg, pb, num,
        scale, n_pending, a.stride(0), a.stride(2), b.stride(0), b.stride(2),
        H=heads, HV=hv, K=dk, V=dv, BKF=_pow2_at_least(dk, 16), BV=block_v, USE_L2=use_qk_l2norm,
        HAS_PENDING=has_pending, SK=sk, SV=sv, EARLY=early, num_warps=config.num_warps, **constexprs,
        **launch_args(device),
    )
    return o, k_hat, g, beta


def commit_verify_one_token_gates(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gates: GateProjections, state: torch.Tensor, scale: float,
    use_qk_l2norm: bool, *, pending: Pending | None = None, config: KernelConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A one-node pass (``q [B, 1, H, K]``) with its gates computed from ``gates`` in the launch; returns ``(o, k_hat,
    g, beta)`` like ``specla::gdn_gates_commit_verify_``."""
    if q.shape[1] != 1:
        raise ValueError(f"commit_verify_one_token_gates takes one node a row, got {q.shape[1]}")
    q, k, v = (t.contiguous() for t in (q, k, v))
    return _one_token_launch(_one_token_gates_kernel, (q, k, v), q.shape[2], q.shape[3], v.shape[2], v.shape[3], v.dtype,
                             GateProjections(*gates), state, scale, use_qk_l2norm, pending, config)


_READERS: dict[tuple, torch.Tensor] = {}


def _readers(conv_state: torch.Tensor, count: int) -> torch.Tensor:
    """The arrival counters of ``_one_token_conv_gates_kernel`` for the layer of this q conv state: zeros, allocated
    at its first launch (a warm-up, before any capture) and left at zero by every launch. One set a layer, so that
    launches on two streams of different layers or models never share a counter; kept for the process (4 bytes a row
    and head for each conv state ever seen: the engine allocates its caches once)."""
    key = (conv_state.device, conv_state.data_ptr(), count)
    if key not in _READERS:
        _READERS[key] = torch.zeros(count, dtype=torch.int32, device=conv_state.device)
    return _READERS[key]


def one_token_conv_gates_fits(xs: Sequence[torch.Tensor], state: torch.Tensor) -> bool:
    """Whether ``_one_token_conv_gates_kernel`` takes these: one node a row of q and k of one width, whole key heads
    of the state's K, value heads a multiple of them, and v as wide as the state's value heads."""
    _, hv, dk, dv = state.shape
    width = xs[0].shape[-1]
    return (xs[0].dim() == 3 and xs[0].shape[1] == 1 and xs[1].shape == xs[0].shape and width % dk == 0
            and hv % (width // dk) == 0 and xs[2].shape == (xs[0].shape[0], 1, hv * dv))


def commit_verify_one_token_conv_gates(
    xs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    conv_states: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    conv_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    conv_pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    num_pending: torch.Tensor,
    silu: bool,
    gates: GateProjections,
    state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    *,
    pending: Pending | None = None,
    config: KernelConfig | None = None,
) -> tuple[torch.Tensor, ...]:
    """:func:`commit_verify_one_token_gates` from the projection: the q/k/v short convs of ``xs [B, 1, D]`` (any
    strides, bias-free, contiguous ``conv_weights [D, W]``) from their contiguous ``conv_states [B, D, S]``, into which
    the launch commits the first ``num_pending[b]`` rows of ``conv_pending [B, A, D]``. Returns ``(o, k_hat, g, beta,
    v, *copies of xs)`` like ``specla::gdn_conv_gates_commit_verify_`` (``v [B, 1, HV, V]``: the conv's output as the
    heads the recurrence read)."""
    batch, hv, dk, dv = state.shape
    heads = xs[0].shape[-1] // dk
    if not one_token_conv_gates_fits(xs, state):
        raise ValueError(f"commit_verify_one_token_conv_gates takes one node a row of q/k [B, 1, H * {dk}] (H dividing "
                         f"{hv}) and v [B, 1, {hv} * {dv}], got {[tuple(x.shape) for x in xs]}")
    if not all(t.is_contiguous() for t in (*conv_states, *conv_weights, *conv_pending)):
        raise ValueError("the conv states, weights and pending inputs must be contiguous: the states update in place")
    rows = [torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in xs]
    v = torch.empty(batch, 1, hv, dv, dtype=xs[2].dtype, device=xs[2].device)
    width = conv_states[0].shape[2]
    inputs = (*xs, *(stride for x in xs for stride in (x.stride(0), x.stride(2))), *conv_states, *conv_pending,
              *conv_weights, *rows, v, _readers(conv_states[0], batch * heads), num_pending, width, conv_pending[0].shape[1])
    outputs = _one_token_launch(_one_token_conv_gates_kernel, inputs, heads, dk, hv, dv, xs[0].dtype,
                                GateProjections(*gates), state, scale, use_qk_l2norm, pending, config,
                                W=conv_weights[0].shape[1], BS=triton.next_power_of_2(width), SILU=silu)
    return (*outputs, v, *rows)
