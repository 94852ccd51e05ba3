"""Triton kernels: a few rows (up to 32) through one weight, with what surrounds the GEMM fused in: a draft
head's GEMMs, and the target's when its norms are folded into them (``lowering/fold_norms.py``).

An EAGLE draft level runs its head on 1-16 rows. On the H200 each of its GEMMs is one launch that takes
4-8 us, and cuBLAS picks a 64-column tile for the weights with 1,024 output columns: 16 programs stream the
weight at 0.27 TB/s, 7.7-8 us for 2 MB (``gemv_gpu_eagle_head.md``). Here one program per 16 (or 32) output
columns reads its slice of the weight once over the whole depth, 64-128 programs in all (3.8-4.1 us for the
same weight), and the elementwise work around the GEMM happens in the same launch:

- before it, an RMS norm (one kernel fewer), optionally of the rows plus a skip connection's rows (the sum,
  rounded to the rows' dtype, is also written out: the model's next residual). bf16 and fp32 rows enter the GEMM
  times the norm's weight while the same loop sums their squares (the rows loaded a step ahead of the weight), and
  each output row is scaled by its ``rsqrt(mean(x^2) + eps)`` at the end. fp16 rows, whose ``x * weight`` could
  overflow fp16, take a first pass for their ``rsqrt`` and enter normalized: on the H200 that pass doubled a launch (q/k/v 4.5 -> 10.7 us, gate/up 6.5 -> 13 us in a propose,
  ``eagle_profile.md``: eight dependent reads of the rows before the weight's loop starts);
- after it, a bias and a residual, the residual's rows optionally gathered from a table by index (the fuse's
  token table: one kernel fewer);
- or, for a packed gate/up weight ``[2I, K]``, ``silu(gate) * up`` of the two halves (one kernel fewer);
- or, before a GDN layer's o_proj, its gated output norm (``gated_norm_linear``: a drafted pass's rows, where the
  backend's ``fold_gated_norms_drafted`` folds it), one head a step: a head is the norm's whole extent, so no
  first pass over the rows.

A deep, narrow weight (``ops.linear_split``: a draft head's down projection) gives too few column blocks to
stream it well, one program per block over the whole depth (``gemv_gpu_eagle_head.md``: [1024, 4096] 9.2 us
against 6.3 split four ways). There the depth is split across programs, each writing its fp32 partial sums;
the column block's last program to finish adds them in split order (the same sums every run, whichever
finishes last), adds the residual and stores: cuBLAS's split-K needs a reduction kernel and the residual a third.
The same kernel runs a target MLP's down projection for a drafted pass's rows (``swiglu_linear``), forming
``silu(gate) * up`` from the packed gate/up rows as it streams, where inductor's product kernel came first too.

The GEMM's inputs round to the rows' dtype (``x * weight``, or for fp16 the normalized rows, as ``nn.RMSNorm``'s
output does); products accumulate in fp32 (fp32 rows: full fp32 products, not TF32) and the epilogue rounds once
at the store. Same results as ``reference.linear_add_reference``, ``norm_linear_reference`` and
``norm_gated_linear_reference`` up to that rounding (the references round the norm's and the GEMM's outputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ops import LINEAR_MAX_ROWS, gated_norm_rows_fit, linear_split, swiglu_split
from .pdl import launch_args, wait_upstream

MAX_ROWS = LINEAR_MAX_ROWS  # rows the kernels take: tensor cores need 16 (32 past 16), missing rows load as zeros


@triton.jit
def _inverse_rms(x_ptr, M, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``rsqrt(mean(x^2) + eps)`` of each row of ``x [M, K]`` in fp32 (a first pass over the few rows, which
    the weight's loop then reads again from cache)."""
    offs_m = tl.arange(0, BLOCK_M)
    squares = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=(offs_m[:, None] < M) & (offs_k[None, :] < K),
                    other=0.0).to(tl.float32)
        squares += tl.sum(x * x, 1)
    return tl.rsqrt(squares / K + eps)


@triton.jit
def _row_block(x_ptr, skip_ptr, sum_ptr, norm_ptr, inverse_rms, M, K, k0, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns ``k0 : k0 + BLOCK_K`` of the rows: ``(x, x^2 summed over the block)``. ``x`` comes in its dtype
    (plus the skip rows when given, summed in fp32 and rounded, which the first program stores to ``sum_ptr``),
    times the norm's weight when there is one (in fp32, rounded once), and also times ``inverse_rms`` when that
    is given (the two-pass form); rows and columns past ``M`` and ``K`` are zeros."""
    offs_m, offs_k = tl.arange(0, BLOCK_M), k0 + tl.arange(0, BLOCK_K)
    inside = (offs_m[:, None] < M) & (offs_k[None, :] < K)
    x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=inside, other=0.0)
    if skip_ptr is not None:
        x = (x.to(tl.float32) + tl.load(skip_ptr + offs_m[:, None] * K + offs_k[None, :], mask=inside,
                                        other=0.0).to(tl.float32)).to(x.dtype)
        if tl.program_id(0) == 0:
            tl.store(sum_ptr + offs_m[:, None] * K + offs_k[None, :], x, mask=inside)
    squares = tl.zeros((BLOCK_M,), tl.float32)  # (summed only where the one-pass norm needs them)
    if norm_ptr is not None:
        wide = x.to(tl.float32)
        if inverse_rms is None:
            squares = tl.sum(wide * wide, 1)
        else:
            wide = wide * inverse_rms[:, None]
        x = (wide * tl.load(norm_ptr + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)[None, :]).to(x.dtype)
    return x, squares


@triton.jit
def _rows_ahead(x_ptr, skip_ptr, sum_ptr, norm_ptr, inverse_rms, M, K, k0, x_next, squares_next, BLOCK_M: tl.constexpr,
                BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr):
    """``(x, squares)`` of the step at ``k0`` (``_row_block``) and, with PREFETCH, the next step's, loaded now: the
    rows' loads feed no ``tl.dot`` directly and are not pipelined, so the norm's work on them waited for them at every
    step (the 1.3B q/k/v GEMV with norm and skip 28.5 -> 15.8 us on the H200, ``fold_gpu.md``). Returns
    ``(x, squares, x_next, squares_next)``; without PREFETCH the last two pass through."""
    if PREFETCH:
        x, squares = x_next, squares_next
        x_next, squares_next = _row_block(x_ptr, skip_ptr, sum_ptr, norm_ptr, inverse_rms, M, K, k0 + BLOCK_K, BLOCK_M,
                                          BLOCK_K)
    else:
        x, squares = _row_block(x_ptr, skip_ptr, sum_ptr, norm_ptr, inverse_rms, M, K, k0, BLOCK_M, BLOCK_K)
    return x, squares, x_next, squares_next


@triton.jit
def _times(x, w_ptr, offs_n, in_n, K, k0, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, WIDE: tl.constexpr):
    """``x @ W[offs_n, k0 : k0 + BLOCK_K]^T`` in fp32 (``W [*, K]`` row-major, x's dtype or int8; IEEE: fp32
    products, not TF32; WIDE: offsets past 2^31 elements, in int64)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    rows = offs_n[:, None].to(tl.int64) if WIDE else offs_n[:, None]
    w = tl.load(w_ptr + rows * K + offs_k[None, :], mask=in_n[:, None] & (offs_k[None, :] < K), other=0.0)
    w = w.to(x.dtype)  # (an int8 weight's integers, exact in x's dtype; its scale comes after the sum)
    if IEEE:
        product = tl.dot(x, tl.trans(w), input_precision="ieee")
    else:
        product = tl.dot(x, tl.trans(w))
    return product


@triton.jit
def _scaled(acc, scale_ptr, offs_n, in_n):
    """``acc [BLOCK_M, BLOCK_N]`` times an int8 weight's per-column ``scale`` (none: as it is)."""
    if scale_ptr is not None:
        acc *= tl.load(scale_ptr + offs_n, mask=in_n, other=0.0)[None, :]
    return acc


@triton.jit
def _rows_times(x_ptr, w_ptr, offs_m, in_m, offs_n, in_n, K, k0, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                WIDE: tl.constexpr):
    """The rows' block at ``k0`` (``x [M, K]`` as they are: no norm, zeros past M and K) ``@ W[offs_n, k0 : k0 +
    BLOCK_K]^T`` in fp32."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=in_m[:, None] & (offs_k[None, :] < K), other=0.0)
    return _times(x, w_ptr, offs_n, in_n, K, k0, BLOCK_K, IEEE, WIDE)


@triton.jit
def _linear_kernel(x_ptr, skip_ptr, sum_ptr, w_ptr, scale_ptr, norm_ptr, bias_ptr, residual_ptr, residual_rows_ptr, y_ptr,
                   M, N, K, eps,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                   TWO_PASS: tl.constexpr, PREFETCH: tl.constexpr, WIDE: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid: (output column blocks,). ``y = norm?(x + skip?) @ (W * scale?)^T + bias? + residual?[rows?]``."""
    wait_upstream(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    in_n, in_m = offs_n < N, offs_m < M
    inverse_rms = None
    if norm_ptr is not None and TWO_PASS:
        inverse_rms = _inverse_rms(x_ptr, M, K, eps, BLOCK_M, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    squares = tl.zeros((BLOCK_M,), tl.float32)
    x_next, squares_next = x_ptr, squares  # (placeholders, unless prefetched)
    if PREFETCH:
        x_next, squares_next = _row_block(x_ptr, skip_ptr, sum_ptr, norm_ptr, inverse_rms, M, K, 0, BLOCK_M, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        x, block_squares, x_next, squares_next = _rows_ahead(x_ptr, skip_ptr, sum_ptr, norm_ptr, inverse_rms, M, K, k0,
                                                             x_next, squares_next, BLOCK_M, BLOCK_K, PREFETCH)
        squares += block_squares
        acc += _times(x, w_ptr, offs_n, in_n, K, k0, BLOCK_K, IEEE, WIDE)
    acc = _scaled(acc, scale_ptr, offs_n, in_n)
    if norm_ptr is not None and not TWO_PASS:
        acc *= tl.rsqrt(squares / K + eps)[:, None]
    if bias_ptr is not None:
        acc += tl.load(bias_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)[None, :]
    inside = in_m[:, None] & in_n[None, :]
    if residual_ptr is not None:
        rows = offs_m.to(tl.int64)
        if residual_rows_ptr is not None:
            rows = tl.load(residual_rows_ptr + offs_m, mask=in_m, other=0).to(tl.int64)
        acc += tl.load(residual_ptr + rows[:, None] * N + offs_n[None, :], mask=inside, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _gated_kernel(x_ptr, skip_ptr, sum_ptr, w_ptr, scale_ptr, norm_ptr, y_ptr, M, N, K, eps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, IEEE: tl.constexpr, TWO_PASS: tl.constexpr, PREFETCH: tl.constexpr,
                  WIDE: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid: (output column blocks,). ``W = [gate; up]`` of ``2N`` rows; ``y = silu(gate) * up`` of
    ``norm?(x + skip?) @ W^T`` ``[M, N]``: each block of rows read once for both halves."""
    wait_upstream(USE_PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    in_n = offs_n < N
    inverse_rms = None
    if norm_ptr is not None and TWO_PASS:
        inverse_rms = _inverse_rms(x_ptr, M, K, eps, BLOCK_M, BLOCK_K)
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    squares = tl.zeros((BLOCK_M,), tl.float32)
    x_next, squares_next = x_ptr, squares  # (placeholders, unless prefetched)
    if PREFETCH:
        x_next, squares_next = _row_block(x_ptr, skip_ptr, sum_ptr, norm_ptr, inverse_rms, M, K, 0, BLOCK_M, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        x, block_squares, x_next, squares_next = _rows_ahead(x_ptr, skip_ptr, sum_ptr, norm_ptr, inverse_rms, M, K, k0,
                                                             x_next, squares_next, BLOCK_M, BLOCK_K, PREFETCH)
        squares += block_squares
        gate += _times(x, w_ptr, offs_n, in_n, K, k0, BLOCK_K, IEEE, WIDE)
        up += _times(x, w_ptr, offs_n + N, in_n, K, k0, BLOCK_K, IEEE, WIDE)
    gate, up = _scaled(gate, scale_ptr, offs_n, in_n), _scaled(up, scale_ptr, offs_n + N, in_n)
    if norm_ptr is not None and not TWO_PASS:
        scale = tl.rsqrt(squares / K + eps)[:, None]
        gate, up = gate * scale, up * scale
    out = gate * tl.sigmoid(gate) * up
    inside = (offs_m[:, None] < M) & in_n[None, :]
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], out.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _heads_of(x_ptr, gate_ptr, offs_m, in_m, k0, SX, SG, K, D: tl.constexpr):
    """The rows' head at columns ``k0 : k0 + D`` and its gate, as stored (rows ``SX`` and ``SG`` apart; zeros past the
    rows and past K)."""
    offs_k = k0 + tl.arange(0, D)
    inside = in_m[:, None] & (offs_k < K)[None, :]
    return (tl.load(x_ptr + offs_m[:, None] * SX + offs_k[None, :], mask=inside, other=0.0),
            tl.load(gate_ptr + offs_m[:, None] * SG + offs_k[None, :], mask=inside, other=0.0))


@triton.jit
def _gated_norm_kernel(x_ptr, gate_ptr, norm_ptr, w_ptr, y_ptr, M, N, K, SX, SG, eps, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr, WIDE: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """Grid: (output column blocks,). ``y = rms_norm_gated(x, gate) @ W^T`` of rows of D-wide heads: one head a step,
    normalised and gated in the step (a head is the norm's whole extent), rounded to the rows' dtype as the norm's
    output is. The weight's first step loads before the wait for the kernel before (a parameter: no kernel writes
    it); each step loads the next head and the weight's next step before it works on its own (loads that feed no
    ``tl.dot`` directly are not pipelined, ``_rows_ahead``)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m, offs_d = tl.arange(0, BLOCK_M), tl.arange(0, D)
    in_n, in_m = offs_n < N, offs_m < M
    w_rows = w_ptr + (offs_n[:, None].to(tl.int64) if WIDE else offs_n[:, None]) * K
    w = tl.load(w_rows + offs_d[None, :], mask=in_n[:, None], other=0.0)
    wait_upstream(USE_PDL)
    norm = tl.load(norm_ptr + offs_d).to(tl.float32)
    x, gate = _heads_of(x_ptr, gate_ptr, offs_m, in_m, 0, SX, SG, K, D)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, D):
        next_k = k0 + D + offs_d
        w_next = tl.load(w_rows + next_k[None, :], mask=in_n[:, None] & (next_k < K)[None, :], other=0.0)
        x_next, gate_next = _heads_of(x_ptr, gate_ptr, offs_m, in_m, k0 + D, SX, SG, K, D)
        wide, g = x.to(tl.float32), gate.to(tl.float32)
        scale = tl.rsqrt(tl.sum(wide * wide, 1) / D + eps)
        z = (wide * scale[:, None] * norm[None, :] * (g * tl.sigmoid(g))).to(x.dtype)
        if IEEE:
            acc += tl.dot(z, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(z, tl.trans(w))
        w, x, gate = w_next, x_next, gate_next
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=in_m[:, None] & in_n[None, :])


@triton.jit
def _swiglu_halves(x_ptr, offs_m, in_m, K, k0, BLOCK_K: tl.constexpr):
    """The gate and up blocks at ``k0`` of packed ``[gate, up]`` rows (``x [M, 2K]``; zeros past M and K)."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    at = x_ptr + offs_m[:, None] * (2 * K) + offs_k[None, :]
    inside = in_m[:, None] & (offs_k[None, :] < K)
    return tl.load(at, mask=inside, other=0.0), tl.load(at + K, mask=inside, other=0.0)


@triton.jit
def _split_linear_kernel(x_ptr, w_ptr, scale_ptr, residual_ptr, y_ptr, partial_ptr, count_ptr, M, N, K, SPLIT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                         WIDE: tl.constexpr, SWIGLU: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid: (output column blocks, SPLIT). ``y = x @ W^T + residual?`` with the depth split: each program's
    fp32 partial to ``partial_ptr [blocks, SPLIT, BLOCK_M, BLOCK_N]``; ``count_ptr [blocks]`` (zeros) counts a
    block's finished programs, and the last one sums the partials in split order, stores ``y`` and sets the
    count back to zero for the next launch. SWIGLU: x is an MLP's packed ``[gate, up]`` rows ``[M, 2K]`` and the
    GEMM's input ``silu(gate) * up`` (in fp32, rounded to x's dtype as inductor's kernel of it writes it), the
    halves loaded a step ahead (loads that feed no ``tl.dot`` directly are not pipelined: ``docs/speed.md``)."""
    wait_upstream(USE_PDL)
    block, split = tl.program_id(0), tl.program_id(1)
    offs_n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    in_n, in_m = offs_n < N, offs_m < M
    depth = tl.cdiv(K, SPLIT * BLOCK_K) * BLOCK_K
    start, stop = split * depth, tl.minimum((split + 1) * depth, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if SWIGLU:
        gate, up = _swiglu_halves(x_ptr, offs_m, in_m, K, start, BLOCK_K)
        for k0 in range(start, stop, BLOCK_K):
            gate_next, up_next = _swiglu_halves(x_ptr, offs_m, in_m, K, k0 + BLOCK_K, BLOCK_K)
            g = gate.to(tl.float32)
            z = (g * tl.sigmoid(g) * up.to(tl.float32)).to(x_ptr.dtype.element_ty)
            acc += _times(z, w_ptr, offs_n, in_n, K, k0, BLOCK_K, IEEE, WIDE)
            gate, up = gate_next, up_next
    else:
        for k0 in range(start, stop, BLOCK_K):
            acc += _rows_times(x_ptr, w_ptr, offs_m, in_m, offs_n, in_n, K, k0, BLOCK_K, IEEE, WIDE)
    tile = offs_m[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(partial_ptr + (block * SPLIT + split) * BLOCK_M * BLOCK_N + tile, acc)
    # (every warp's stores before the count, whose release makes them visible to the program that counts last,
    # which loads them from L2: the barrier does not leave that order to where the compiler puts its own)
    tl.debug_barrier()
    if tl.atomic_add(count_ptr + block, 1, sem="acq_rel") == SPLIT - 1:
        total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for part in tl.static_range(SPLIT):
            total += tl.load(partial_ptr + (block * SPLIT + part) * BLOCK_M * BLOCK_N + tile, cache_modifier=".cg")
        total = _scaled(total, scale_ptr, offs_n, in_n)
        inside = in_m[:, None] & in_n[None, :]
        if residual_ptr is not None:
            total += tl.load(residual_ptr + offs_m[:, None] * N + offs_n[None, :], mask=inside, other=0.0).to(tl.float32)
        tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], total.to(y_ptr.dtype.element_ty), mask=inside)
        tl.atomic_xchg(count_ptr + block, 0)


Tiles = tuple[int, int, int]  # (BLOCK_N, BLOCK_K, num_stages)


def _tiles(n: int, k: int, gated: bool = False, normed: bool = False, int8: bool = False) -> Tiles:
    """The head's (depth 1,024): 16 columns over 256-deep steps up to 2,048 columns (64-128 programs), else 32
    over 128, four stages (the best of each shape in ``gemv_gpu_eagle_head.md``); the GDN-1.3B pass's (depth
    2,048 and more), by the best at 1 row in ``fold_gpu.md``'s bare sweep: o_proj [2048, 2048] 32 over 256 and
    down [2048, 5632] 16 over 256, four stages; q/k/v/gates [8208, 2048] 64 over 256 and the gated gate/up
    [11264, 2048] 64 over 128, four stages; the LM head [32000, 2048] 64 over 128, three stages (its best at
    16 rows). A gated weight with the norm in its loop at depth 2,048 and more: 32 over 256, four stages (the
    1.3B-sized head's gate/up [16384, 2048] 21.4-22.2 us against 25.7-26.3 at 64 over 128, ``fold_gpu_head.md``;
    the target's folded gate/up best at 32 over 256 too, ``fold_gpu.md``). An int8 weight of more than 2,048
    columns at depth 2,048 and more takes steps twice as deep (the same bytes a step: the 1.3B-sized head's q/k/v
    8.3 -> 7.9 us, gate/up 14.2 -> 13.0 at 4 rows on the H200; at hidden 1,024 and for narrower weights deeper
    steps were slower)."""
    if int8 and k >= 2048 and n > 2048:
        block_n, block_k, stages = _tiles(n, k, gated, normed)
        return block_n, 2 * block_k, stages
    if k < 2048:
        return (16, 256, 4) if n <= 2048 else (32, 128, 4)
    if gated and normed:
        return (32, 256, 4)
    if n <= 2048:
        return (32 if k <= 2048 else 16, 256, 4)
    if n > 16384:
        return (64, 128, 3)
    return (64, 128, 4) if gated else (64, 256, 4)


SPLIT_TILES = (32, 256, 4)  # a split GEMM's (BLOCK_N, BLOCK_K, num_stages): the best of gemv_gpu_eagle_head.md's down


_counts: dict[torch.device, torch.Tensor] = {}  # per device: split GEMMs' block counters, zeros between launches
MAX_SPLIT_BLOCKS = 256  # column blocks a split GEMM may have (8,192 columns at SPLIT_TILES)


def _block_counts(blocks: int, device: torch.device) -> torch.Tensor:
    """The device's block counters, at zero (each split launch leaves them so), allocated once: a captured graph
    keeps their address. Every split launch on the device shares them, so they run in one stream's order, as a
    pass's and a propose's kernels do."""
    if blocks > MAX_SPLIT_BLOCKS:
        raise ValueError(f"a split GEMM takes at most {MAX_SPLIT_BLOCKS} column blocks, got {blocks}")
    if device not in _counts:
        _counts[device] = torch.zeros(MAX_SPLIT_BLOCKS, dtype=torch.int32, device=device)
    return _counts[device]


def _check(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, skip: torch.Tensor | None,
           skip_sum: torch.Tensor | None, weight_scale: torch.Tensor | None = None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1] or x.shape[0] > MAX_ROWS:
        raise ValueError(f"the linear kernels take x [M <= {MAX_ROWS}, K] and a weight [N, K], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    _check_vector(norm_weight, x.shape[1], "norm weight")
    check_weight(x, weight, weight_scale)
    if (skip is None) != (skip_sum is None) or (skip is not None and any(
            t.shape != x.shape or t.dtype != x.dtype or not t.is_contiguous() for t in (skip, skip_sum))):
        raise ValueError(f"the linear kernels take a skip and its sum's output together, contiguous, of x's shape "
                         f"{tuple(x.shape)} and dtype")
    if skip_sum is not None and skip_sum.untyped_storage().data_ptr() in {
            t.untyped_storage().data_ptr() for t in (x, skip, weight)}:  # (program 0 writes it while others read)
        raise ValueError("the linear kernels write the skip's sum to memory of its own, not x's, the skip's or the weight's")
    if skip is not None and x.dtype == torch.float16:  # (the two-pass norm of fp16 reads x before the sum exists)
        raise ValueError("the linear kernels add a skip to float32 or bfloat16 rows only")


def weight_fits(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> bool:
    """The weight in the rows' dtype, or int8 with its fp32 per-row scale (the kernels widen its integers)."""
    if weight_scale is None:
        return weight.dtype == x.dtype
    return weight.dtype == torch.int8 and weight_scale.dtype == torch.float32


def check_weight(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> None:
    """Contiguous rows and weight, and a weight that :func:`weight_fits` them."""
    if not (x.is_contiguous() and weight.is_contiguous() and weight_fits(x, weight, weight_scale)):
        scale = "no scale" if weight_scale is None else f"a {weight_scale.dtype} scale"
        raise ValueError(f"the linear kernels take contiguous x and weight of one dtype, or an int8 weight with its scale "
                         f"in float32; got {x.dtype}, {weight.dtype} and {scale}")
    _check_vector(weight_scale, weight.shape[0], "weight scale")


def _check_vector(t: torch.Tensor | None, size: int, what: str) -> None:
    """An optional contiguous ``[size]`` input (the kernels read it with unit stride)."""
    if t is not None and (t.shape != (size,) or not t.is_contiguous()):
        raise ValueError(f"the linear kernels take a contiguous {what} [{size}], got {tuple(t.shape)} "
                         f"with strides {t.stride()}")


PREFETCH = True  # the rows a step ahead where the norm works on them (``_rows_ahead``; fold_gpu.py's probe A/Bs it)


def _launch(kernel, x: torch.Tensor, weight: torch.Tensor, columns: int, tiles: Tiles, *args, prefetch: bool,
            warps: int, **kwargs) -> None:
    block_n, block_k, stages = tiles
    rows = x.shape[0]
    if rows:
        kernel[(triton.cdiv(columns, block_n),)](*args, BLOCK_M=16 if rows <= 16 else 32, BLOCK_N=block_n, BLOCK_K=block_k,
                                                 IEEE=x.dtype == torch.float32, TWO_PASS=x.dtype == torch.float16,
                                                 num_warps=warps, num_stages=stages, PREFETCH=PREFETCH and prefetch,
                                                 WIDE=weight.numel() >= 2**31, **launch_args(x.device), **kwargs)


def _split_launch(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, residual: torch.Tensor | None,
                  y: torch.Tensor, split: int, tiles: Tiles, swiglu: bool, warps: int = 4) -> None:
    """One launch of ``_split_linear_kernel`` into ``y [M, N]`` (M >= 1), the depth in ``split`` slices."""
    block_n, block_k, stages = tiles
    rows, n, depth = y.shape[0], weight.shape[0], weight.shape[1]
    block_m, blocks = 16 if rows <= 16 else 32, triton.cdiv(n, block_n)
    partials = torch.empty(blocks, split, block_m, block_n, dtype=torch.float32, device=x.device)
    _split_linear_kernel[(blocks, split)](x, weight, weight_scale, residual, y, partials, _block_counts(blocks, x.device), rows,
                                         n, depth, SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                         IEEE=x.dtype == torch.float32, WIDE=weight.numel() >= 2**31, SWIGLU=swiglu,
                                         num_warps=warps, num_stages=stages, **launch_args(x.device))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, residual_rows: torch.Tensor | None = None,
           norm_weight: torch.Tensor | None = None, eps: float = 0.0, skip: torch.Tensor | None = None,
           skip_sum: torch.Tensor | None = None, tiles: Tiles | None = None,
           weight_scale: torch.Tensor | None = None, warps: int = 4) -> torch.Tensor:
    """``x [M, K]`` -> ``rms_norm(x + skip) @ weight^T + bias + residual[residual_rows]`` ``[M, N]``, each term
    optional (without ``residual_rows``, ``residual`` is ``[M, N]``; with it, a table ``[V, N]``). With ``skip``,
    ``x + skip`` (rounded to x's dtype) is written to ``skip_sum``. ``weight_scale [N]``: the weight is int8,
    standing for ``weight * weight_scale[:, None]``. ``tiles`` and ``warps``: a benchmark's choice (the split
    kernel, where the weight splits, takes its own)."""
    _check(x, weight, norm_weight, skip, skip_sum, weight_scale)
    rows, n = x.shape[0], weight.shape[0]
    _check_vector(bias, n, "bias")
    _check_vector(residual_rows, rows, "residual_rows")
    if residual is not None and (not residual.is_contiguous() or residual.shape[1:] != (n,)
                                 or (residual_rows is None and residual.shape[0] != rows)):
        raise ValueError(f"linear: residual must be contiguous [{rows} or table rows, {n}], got {tuple(residual.shape)}")
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    split = linear_split(weight)
    plain = norm_weight is None and skip is None and bias is None and residual_rows is None
    if split > 1 and plain and tiles is None and rows:
        _split_launch(x, weight, weight_scale, residual, y, split, SPLIT_TILES, swiglu=False)
        return y
    _launch(_linear_kernel, x, weight, n, tiles or _tiles(n, x.shape[1], int8=weight_scale is not None), x, skip, skip_sum,
            weight, weight_scale, norm_weight, bias, residual, residual_rows, y, rows, n, x.shape[1], eps,
            prefetch=norm_weight is not None or skip is not None, warps=warps)
    return y


def gated_norm_linear(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                      block_n: int | None = None, warps: int = 4) -> torch.Tensor:
    """``x [M, H, D]`` heads and their ``gate`` (M up to ``MAX_ROWS``) -> ``rms_norm_gated(x, gate)`` flattened ``@
    weight^T`` ``[M, N]`` (``reference.gated_norm_linear_reference``: a GDN layer's output norm and o_proj) in one
    launch (``ops.gated_norm_rows_fit``). Each row's heads lie contiguously, the rows at any stride (the gate is a
    slice of the packed projections' output: read where it lies, no copy). ``block_n`` (output columns a program:
    16, 32 or 64; by default 16 up to 1,024 columns, else 32) and ``warps``: a benchmark's choice."""
    if not (x.dim() == 3 and gated_norm_rows_fit(x, gate, norm_weight, weight) and norm_weight.is_contiguous()
            and all(t.stride()[1:] == (x.shape[2], 1) for t in (x, gate)) and block_n in (None, 16, 32, 64)):
        raise ValueError(f"gated_norm_linear takes up to {MAX_ROWS} rows of heads [M, H, D] (D a power of two from 16 to "
                         f"256, each row's heads contiguous), their gate alike, a norm weight [D], a contiguous weight "
                         f"[N, H * D] of their dtype and 16, 32 or 64 columns a program; got x {tuple(x.shape)} "
                         f"{x.dtype} strides {x.stride()}, gate {tuple(gate.shape)} strides {gate.stride()}, norm weight "
                         f"{tuple(norm_weight.shape)}, weight {tuple(weight.shape)} {weight.dtype}, block_n {block_n}")
    rows, n = x.shape[0], weight.shape[0]
    block_n = block_n or (16 if n <= 1024 else 32)
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _gated_norm_kernel[(triton.cdiv(n, block_n),)](x, gate, norm_weight, weight, y, rows, n, weight.shape[1],
                                                   x.stride(0), gate.stride(0), eps, BLOCK_M=16 if rows <= 16 else 32,
                                                   BLOCK_N=block_n, D=x.shape[2], IEEE=x.dtype == torch.float32,
                                                   WIDE=weight.numel() >= 2**31, num_warps=warps, **launch_args(x.device))
    return y


def gated_linear(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 0.0,
                 skip: torch.Tensor | None = None, skip_sum: torch.Tensor | None = None,
                 tiles: Tiles | None = None, weight_scale: torch.Tensor | None = None, warps: int = 4) -> torch.Tensor:
    """``x [M, K]``, ``weight [2N, K]`` (gate rows, then up rows) -> ``silu(gate) * up`` ``[M, N]`` of
    ``rms_norm(x + skip) @ weight^T`` (norm and skip optional; the sum written to ``skip_sum``, an int8 weight's
    ``weight_scale [2N]``: as ``linear``)."""
    _check(x, weight, norm_weight, skip, skip_sum, weight_scale)
    if weight.shape[0] % 2:
        raise ValueError(f"gated_linear: the weight holds gate and up rows, an even count, got {weight.shape[0]}")
    rows, n = x.shape[0], weight.shape[0] // 2
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    tiles = tiles or _tiles(2 * n, x.shape[1], gated=True, normed=norm_weight is not None, int8=weight_scale is not None)
    _launch(_gated_kernel, x, weight, n, tiles, x, skip, skip_sum, weight, weight_scale, norm_weight, y,
            rows, n, x.shape[1], eps, prefetch=norm_weight is not None or skip is not None, warps=warps)
    return y


SWIGLU_TILES, SWIGLU_WARPS = (64, 128, 4), 8  # swiglu_linear's (BLOCK_N, BLOCK_K, num_stages) and warps (ops.swiglu_split)


def swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor, split: int | None = None, tiles: Tiles | None = None,
                  warps: int = SWIGLU_WARPS) -> torch.Tensor:
    """``gate_up [M, 2I]`` (M up to ``MAX_ROWS``: an MLP's packed gate/up output) -> ``silu(gate) * up @ weight^T``
    ``[M, N]`` (``reference.swiglu_linear_reference``) in one launch, the depth I split ``split`` ways (default
    ``ops.swiglu_split``): where inductor runs the product, then cuBLAS its split-K GEMM and reduction. ``split``,
    ``tiles`` and ``warps``: a benchmark's choice."""
    if not (gate_up.dim() == weight.dim() == 2 and gate_up.shape[0] <= MAX_ROWS and gate_up.shape[1] == 2 * weight.shape[1]
            and gate_up.is_contiguous()):
        raise ValueError(f"swiglu_linear takes contiguous rows [M <= {MAX_ROWS}, 2I] of [gate, up] and a weight [N, I]; "
                         f"got {tuple(gate_up.shape)} and {tuple(weight.shape)}")
    check_weight(gate_up, weight, None)
    split = split or swiglu_split(weight)
    y = torch.empty(gate_up.shape[0], weight.shape[0], dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0]:
        _split_launch(gate_up, weight, None, None, y, split, tiles or SWIGLU_TILES, swiglu=True, warps=warps)
    return y
