"""Triton kernel: the ``k`` most likely tokens of each row of scores, as log-probabilities, in one launch.

Same result as ``reference.vocab_top_k_reference`` (``log_softmax`` then ``topk``; ties go to the lower
token id). A drafter's tree level needs only the top ``k`` of 32,000+ log-probabilities per frontier node:
the framework writes them all and runs a radix select over them (4 kernels); here one program per row
reads its scores ``k + 1`` times from L2 instead (a small ``k``: a tree's width), reducing across its lanes
twice per pick.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _vocab_top_k_kernel(scores, out_lp, out_ids, V, K: tl.constexpr, BLOCK: tl.constexpr):
    """Grid: (rows,). First the row's log-sum-exp (online over blocks), then its K best tokens one by one:
    the best of those after the previous pick in (score descending, id ascending) order."""
    row = tl.program_id(0)
    base = scores + row.to(tl.int64) * V
    offs = tl.arange(0, BLOCK)
    m = tl.full([BLOCK], float("-inf"), tl.float32)  # per lane: running max and sum of exp(x - max)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(base + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
        new = tl.maximum(m, x)
        shift = tl.where(new == float("-inf"), 0.0, new)  # (a lane with nothing finite yet keeps s = 0)
        s = s * tl.exp(m - shift) + tl.exp(x - shift)
        m = new
    top = tl.max(m, 0)
    lse = top + tl.log(tl.sum(s * tl.exp(m - top), 0))
    prev_v = tl.full([], float("inf"), tl.float32)
    prev_i = tl.full([], -1, tl.int32)
    for j in tl.static_range(K):
        # per lane, the best token after the previous pick (blocks go up in id: a tie keeps the lower one);
        # one reduction across lanes per pick, none per block
        lane_v = tl.full([BLOCK], float("-inf"), tl.float32)
        lane_i = tl.zeros([BLOCK], tl.int32) + V
        for start in range(0, V, BLOCK):
            idx = start + offs
            x = tl.load(base + idx, mask=idx < V, other=float("-inf")).to(tl.float32)
            after = (idx < V) & ((x < prev_v) | ((x == prev_v) & (idx > prev_i)))
            take = after & ((x > lane_v) | (lane_i == V))
            lane_v = tl.where(take, x, lane_v)
            lane_i = tl.where(take, idx, lane_i)
        best_v = tl.max(lane_v, 0)
        best_i = tl.min(tl.where((lane_i < V) & (lane_v == best_v), lane_i, V), 0)
        tl.store(out_lp + row * K + j, best_v - lse)
        tl.store(out_ids + row * K + j, best_i.to(tl.int64))
        prev_v = best_v
        prev_i = best_i


def vocab_top_k(scores: torch.Tensor, k: int, *, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """``scores [N, V]`` (any float dtype) -> ``(log_probs [N, k] fp32, ids [N, k] int64)``, best first."""
    if scores.dim() != 2 or not 1 <= k <= scores.shape[1]:
        raise ValueError(f"vocab_top_k takes scores [N, V] and 1 <= k <= V, got {tuple(scores.shape)} and k={k}")
    scores = scores.contiguous()
    rows, vocab = scores.shape
    log_probs = torch.empty(rows, k, dtype=torch.float32, device=scores.device)
    ids = torch.empty(rows, k, dtype=torch.int64, device=scores.device)
    if rows:
        _vocab_top_k_kernel[(rows,)](scores, log_probs, ids, vocab, K=k, BLOCK=min(block, triton.next_power_of_2(vocab)),
                                     num_warps=8)
    return log_probs, ids
