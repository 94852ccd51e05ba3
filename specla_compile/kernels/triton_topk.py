"""Triton kernels: the ``k`` most likely tokens of each row of scores, as log-probabilities, in one or two launches.

Same result as ``reference.vocab_top_k_reference`` (``log_softmax`` then ``topk``; ties go to the lower
token id). A drafter's tree level needs only the top ``k`` of 32,000+ log-probabilities per frontier node:
the framework writes them all and runs a radix select over them (4 kernels). Here the vocabulary is cut
into chunks of one block each, one program per (row, chunk): each finds its chunk's max, sum of exponentials
and ``k`` best tokens from registers; a second kernel merges a row's chunks. (One program per row, reading
its 32,000 scores ``k + 1`` times, took 20 us for a few rows on the H200: a few SMs busy, the rest idle.)
A row that fits one block in registers (a draft vocabulary of up to ``ROW_BLOCK`` tokens) takes one program
and one launch: at a few rows a level's two launches cost 7 us on the H200, each of them a few us whatever
its work.

A draft head's tree level scores a few rows through the LM head first: ``linear_top_k`` computes each
block of those scores in the GEMM's own launch and keeps only its per-row partials (max, sum of
exponentials, ``k`` best), which the merge kernel then reads: the scores never reach memory, and the
LM head's GEMM launches with PDL like the rest of the level.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_args, wait_upstream
from .triton_linear import MAX_ROWS, _rows_times, _scaled, _tiles, check_weight


@triton.jit
def _pick_k(values, ids, alive, out_v, out_i, K: tl.constexpr):
    """Store the ``K`` best of the ``alive`` lanes of ``values``/``ids`` (ids distinct) at ``out_v``/``out_i``
    in (value descending, id ascending) order."""
    for j in tl.static_range(K):
        best_v = tl.max(tl.where(alive, values, float("-inf")), 0)
        best_i = tl.min(tl.where(alive & (values == best_v), ids, 2147483647), 0)
        tl.store(out_v + j, best_v)
        tl.store(out_i + j, best_i)
        alive = alive & (ids != best_i)


ROW_BLOCK = 8192  # the largest vocabulary that one program holds in registers (one launch)


@triton.jit
def _row_top_k_kernel(scores, out_lp, out_ids, V, K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid: (rows,). A whole row in one block: its log-sum-exp, then its K best tokens as log-probabilities."""
    wait_upstream(USE_PDL)
    row = tl.program_id(0)
    idx = tl.arange(0, BLOCK)
    valid = idx < V
    x = tl.load(scores + row.to(tl.int64) * V + idx, mask=valid, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    log_sum = tl.log(tl.sum(tl.where(valid & (x > float("-inf")), tl.exp(x - m), 0.0), 0))
    _pick_k((x - m) - log_sum, idx, valid, out_lp + row * K, out_ids + row * K, K)  # (as log_softmax: the max first)


@triton.jit
def _chunk_top_k_kernel(scores, part_m, part_s, part_v, part_i, V, K: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid: (rows, chunks). One chunk of a row: its max, its sum of exp(x - max) and its K best tokens.
    Lanes past the vocabulary are -inf at ids >= V, which sort after every real token."""
    wait_upstream(USE_PDL)
    row, chunk = tl.program_id(0), tl.program_id(1)
    chunks = tl.num_programs(1)
    idx = chunk * BLOCK + tl.arange(0, BLOCK)
    valid = idx < V
    x = tl.load(scores + row.to(tl.int64) * V + idx, mask=valid, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    s = tl.sum(tl.where(valid & (x > float("-inf")), tl.exp(x - m), 0.0), 0)
    slot = row * chunks + chunk
    tl.store(part_m + slot, m)
    tl.store(part_s + slot, s)
    _pick_k(x, idx, idx >= 0, part_v + slot * K, part_i + slot * K, K)


@triton.jit
def _linear_top_k_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, part_m, part_s, part_v, part_i, M, N, K, TOP: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                         WIDE: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid: (column blocks,). One block of the scores ``x [M, K] @ (W * scale?)^T + bias`` (rounded to x's dtype,
    as ``F.linear`` rounds them) and, per row, ``_chunk_top_k_kernel``'s partials of that block."""
    wait_upstream(USE_PDL)
    chunk, chunks = tl.program_id(0), tl.num_programs(0)
    offs_n = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    in_n, in_m = offs_n < N, offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc += _rows_times(x_ptr, w_ptr, offs_m, in_m, offs_n, in_n, K, k0, BLOCK_K, IEEE, WIDE)
    acc = _scaled(acc, scale_ptr, offs_n, in_n)
    if bias_ptr is not None:
        acc += tl.load(bias_ptr + offs_n, mask=in_n, other=0.0).to(tl.float32)[None, :]
    scores = tl.where(in_n[None, :], acc.to(x_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
    m = tl.max(scores, 1)
    s = tl.sum(tl.where(scores > float("-inf"), tl.exp(scores - m[:, None]), 0.0), 1)
    slot = offs_m * chunks + chunk
    tl.store(part_m + slot, m, mask=in_m)
    tl.store(part_s + slot, s, mask=in_m)
    # (columns past N are -inf at ids >= N: they sort after every real token, as in _chunk_top_k_kernel)
    ids = offs_n[None, :] + tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    alive = ids >= 0
    for j in tl.static_range(TOP):
        best_v = tl.max(tl.where(alive, scores, float("-inf")), 1)
        best_i = tl.min(tl.where(alive & (scores == best_v[:, None]), ids, 2147483647), 1)
        tl.store(part_v + slot * TOP + j, best_v, mask=in_m)
        tl.store(part_i + slot * TOP + j, best_i, mask=in_m)
        alive = alive & (ids != best_i[:, None])


@triton.jit
def _merge_top_k_kernel(part_m, part_s, part_v, part_i, out_lp, out_ids, CHUNKS: tl.constexpr,
                        CHUNKS_BLOCK: tl.constexpr, K: tl.constexpr, CANDIDATES_BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid: (rows,). A row's log-sum-exp from its chunks' (max, sum), then the K best of its chunks' picks."""
    wait_upstream(USE_PDL)
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS_BLOCK)
    m = tl.load(part_m + row * CHUNKS + c, mask=c < CHUNKS, other=float("-inf"))
    s = tl.load(part_s + row * CHUNKS + c, mask=c < CHUNKS, other=0.0)
    top = tl.max(m, 0)
    log_sum = tl.log(tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - top), 0.0), 0))
    n = tl.arange(0, CANDIDATES_BLOCK)
    real = n < CHUNKS * K
    v = tl.load(part_v + row * CHUNKS * K + n, mask=real, other=float("-inf"))
    i = tl.load(part_i + row * CHUNKS * K + n, mask=real, other=0)
    # (the max subtracted first, as log_softmax does: v - (top + log_sum) loses digits where scores are large)
    _pick_k((v - top) - log_sum, i, real, out_lp + row * K, out_ids + row * K, K)


def _merge(part_m: torch.Tensor, part_s: torch.Tensor, part_v: torch.Tensor, part_i: torch.Tensor,
           k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``k`` best log-probabilities and ids from its chunks' partials ``[rows, chunks(, k)]``."""
    rows, chunks = part_m.shape
    log_probs = torch.empty(rows, k, dtype=torch.float32, device=part_m.device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=part_m.device)
    if rows:
        _merge_top_k_kernel[(rows,)](part_m, part_s, part_v, part_i, log_probs, ids, CHUNKS=chunks,
                                     CHUNKS_BLOCK=triton.next_power_of_2(chunks), K=k,
                                     CANDIDATES_BLOCK=triton.next_power_of_2(chunks * k), num_warps=4,
                                     **launch_args(part_m.device))
    return log_probs, ids


def _partials(rows: int, chunks: int, k: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    f32 = {"dtype": torch.float32, "device": device}
    return (torch.empty(rows, chunks, **f32), torch.empty(rows, chunks, **f32), torch.empty(rows, chunks, k, **f32),
            torch.empty(rows, chunks, k, dtype=torch.int32, device=device))


def vocab_top_k(scores: torch.Tensor, k: int, *, block: int = 2048,
                row_block: int = ROW_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores [N, V]`` (any float dtype) -> ``(log_probs [N, k] fp32, ids [N, k] int64)``, best first: one
    program per row where ``V`` fits ``row_block``, else one per (row, chunk of ``block`` tokens) and a merge."""
    if scores.dim() != 2 or not 1 <= k <= scores.shape[1]:
        raise ValueError(f"vocab_top_k takes scores [N, V] and 1 <= k <= V, got {tuple(scores.shape)} and k={k}")
    scores = scores.contiguous()
    rows, vocab = scores.shape
    one_block = triton.next_power_of_2(vocab) <= row_block
    block = triton.next_power_of_2(vocab) if one_block else min(block, triton.next_power_of_2(vocab))
    if k > block:
        raise ValueError(f"vocab_top_k picks at most {block} tokens per row (one block), got k={k}")
    if one_block:
        log_probs = torch.empty(rows, k, dtype=torch.float32, device=scores.device)
        ids = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
        if rows:
            _row_top_k_kernel[(rows,)](scores, log_probs, ids, vocab, K=k, BLOCK=block, num_warps=8,
                                       **launch_args(scores.device))
        return log_probs, ids
    parts = _partials(rows, triton.cdiv(vocab, block), k, scores.device)
    if rows:
        _chunk_top_k_kernel[(rows, parts[0].shape[1])](scores, *parts, vocab, K=k, BLOCK=block, num_warps=4,
                                                       **launch_args(scores.device))
    return _merge(*parts, k)


MAX_MERGED = 4096  # candidates (column blocks x k) a row's merge takes in one program; more spill its registers


def linear_top_k_fits(weight: torch.Tensor, k: int) -> bool:
    """Whether :func:`linear_top_k` takes ``weight [V, K]`` and ``k``: k within a column block and the blocks'
    candidates within one merge program (a 150k-token vocabulary at hidden 1,024 would be 4,748 blocks: the
    scores then go through ``vocab_top_k``'s 2,048-token chunks)."""
    block_n = _tiles(*weight.shape)[0]
    return 1 <= k <= min(weight.shape[0], block_n) and triton.cdiv(weight.shape[0], block_n) * k <= MAX_MERGED


def linear_top_k(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int,
                 weight_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``vocab_top_k(F.linear(x, weight, bias), k)`` for ``x [M <= MAX_ROWS, K]`` (contiguous, the weight's
    dtype) and a weight and ``k`` that :func:`linear_top_k_fits`: the scores' blocks and their partials in the
    GEMM's launch (``triton_linear``'s tiles for the weight), then the merge. ``weight_scale [N]``: the weight is
    int8, standing for ``weight * weight_scale[:, None]`` (as ``triton_linear.linear``)."""
    if (x.dim() != 2 or weight.dim() != 2 or x.shape[0] > MAX_ROWS or x.shape[1] != weight.shape[1]
            or not linear_top_k_fits(weight, k)
            or (bias is not None and (bias.shape != weight.shape[:1] or not bias.is_contiguous()))):
        raise ValueError(f"linear_top_k takes x [M <= {MAX_ROWS}, K], a weight [N, K], "
                         f"a contiguous bias [N] or None and a k that linear_top_k_fits; got {tuple(x.shape)} "
                         f"{x.dtype}, {tuple(weight.shape)} {weight.dtype} and k={k}")
    check_weight(x, weight, weight_scale)
    n = weight.shape[0]
    block_n, block_k, stages = _tiles(n, weight.shape[1])
    rows, chunks = x.shape[0], triton.cdiv(n, block_n)
    parts = _partials(rows, chunks, k, x.device)
    if rows:
        _linear_top_k_kernel[(chunks,)](x, weight, weight_scale, bias, *parts, rows, n, x.shape[1], TOP=k,
                                        BLOCK_M=16 if rows <= 16 else 32, BLOCK_N=block_n, BLOCK_K=block_k,
                                        IEEE=x.dtype == torch.float32, WIDE=weight.numel() >= 2**31, num_warps=4,
                                        num_stages=stages, **launch_args(x.device))
    return _merge(*parts, k)
