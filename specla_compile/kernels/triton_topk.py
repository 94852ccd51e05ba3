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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_args, wait_upstream


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
    lse = m + tl.log(tl.sum(tl.where(valid & (x > float("-inf")), tl.exp(x - m), 0.0), 0))
    _pick_k(x - lse, idx, valid, out_lp + row * K, out_ids + row * K, K)


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
def _merge_top_k_kernel(part_m, part_s, part_v, part_i, out_lp, out_ids, CHUNKS: tl.constexpr,
                        CHUNKS_BLOCK: tl.constexpr, K: tl.constexpr, CANDIDATES_BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid: (rows,). A row's log-sum-exp from its chunks' (max, sum), then the K best of its chunks' picks."""
    wait_upstream(USE_PDL)
    row = tl.program_id(0)
    c = tl.arange(0, CHUNKS_BLOCK)
    m = tl.load(part_m + row * CHUNKS + c, mask=c < CHUNKS, other=float("-inf"))
    s = tl.load(part_s + row * CHUNKS + c, mask=c < CHUNKS, other=0.0)
    top = tl.max(m, 0)
    lse = top + tl.log(tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - top), 0.0), 0))
    n = tl.arange(0, CANDIDATES_BLOCK)
    real = n < CHUNKS * K
    v = tl.load(part_v + row * CHUNKS * K + n, mask=real, other=float("-inf"))
    i = tl.load(part_i + row * CHUNKS * K + n, mask=real, other=0)
    _pick_k(v - lse, i, real, out_lp + row * K, out_ids + row * K, K)


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
    log_probs = torch.empty(rows, k, dtype=torch.float32, device=scores.device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    if not rows:
        return log_probs, ids
    if one_block:
        _row_top_k_kernel[(rows,)](scores, log_probs, ids, vocab, K=k, BLOCK=block, num_warps=8, **launch_args(scores.device))
        return log_probs, ids
    chunks = triton.cdiv(vocab, block)
    f32 = {"dtype": torch.float32, "device": scores.device}
    part_m, part_s = torch.empty(rows, chunks, **f32), torch.empty(rows, chunks, **f32)
    part_v = torch.empty(rows, chunks, k, **f32)
    part_i = torch.empty(rows, chunks, k, dtype=torch.int32, device=scores.device)
    _chunk_top_k_kernel[(rows, chunks)](scores, part_m, part_s, part_v, part_i, vocab, K=k, BLOCK=block,
                                        num_warps=4, **launch_args(scores.device))
    _merge_top_k_kernel[(rows,)](part_m, part_s, part_v, part_i, log_probs, ids, CHUNKS=chunks,
                                 CHUNKS_BLOCK=triton.next_power_of_2(chunks), K=k,
                                 CANDIDATES_BLOCK=triton.next_power_of_2(chunks * k), num_warps=4,
                                 **launch_args(scores.device))
    return log_probs, ids
