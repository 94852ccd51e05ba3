"""Triton kernels: a few queries attending over a long, masked key buffer, split across the keys.

An EAGLE draft level runs 1-16 queries per row (the frontier, or a catch-up's new pairs) over the head's
whole key buffer (hundreds to thousands of columns) under a mask. Attention kernels built for long query
blocks give each (row, head) one program that walks every key: 8 programs for a whole GPU, 17 us per
level on the H200 (cuDNN). Here one program per (row, head, block of keys) computes its block's partial
softmax (max, sum, weighted values; blocks with nothing visible load no keys), and a second kernel merges
the blocks per query. Same result as ``reference.draft_attention_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import launch_args, wait_upstream
from .reference import check_draft_attention

MAX_QUERIES = 16  # queries per (row, head) that the kernels take in one block


@triton.jit
def _block_kernel(q, keys, values, mask, part_m, part_l, part_acc, scale, H, S, T, D,
                  sq_r, sq_h, sq_s, sk_r, sk_h, sk_t, sv_r, sv_h, sv_t, sm_r, sm_s, sm_t,
                  S_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_T: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid: (R * H, key blocks). Partial softmax of every query of (row, head) over one block of keys:
    its max ``m``, its sum ``l`` of exp(score - m) and the sum of exp(score - m) * value (fp32)."""
    wait_upstream(USE_PDL)
    rh, block = tl.program_id(0).to(tl.int64), tl.program_id(1)
    blocks = tl.num_programs(1)
    r, h = (rh // H).to(tl.int64), (rh % H).to(tl.int64)
    s = tl.arange(0, S_PAD)
    t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, D_PAD)
    in_s, in_t, in_d = s < S, t < T, d < D
    visible = tl.load(mask + r * sm_r + s[:, None] * sm_s + t[None, :] * sm_t,
                      mask=in_s[:, None] & in_t[None, :], other=0) != 0
    slot = rh * blocks + block
    if tl.max(visible.to(tl.int32)) > 0:
        qs = tl.load(q + r * sq_r + h * sq_h + s[:, None] * sq_s + d[None, :], mask=in_s[:, None] & in_d[None, :], other=0)
        k = tl.load(keys + r * sk_r + h * sk_h + t[:, None] * sk_t + d[None, :], mask=in_t[:, None] & in_d[None, :], other=0)
        if IEEE:
            scores = tl.dot(qs, tl.trans(k), input_precision="ieee")
        else:
            scores = tl.dot(qs, tl.trans(k))
        scores = tl.where(visible, scores * scale, float("-inf"))
        m = tl.max(scores, 1)
        p = tl.exp(scores - tl.where(m > float("-inf"), m, 0.0)[:, None])  # (exp(-inf) = 0 where hidden)
        v = tl.load(values + r * sv_r + h * sv_h + t[:, None] * sv_t + d[None, :], mask=in_t[:, None] & in_d[None, :], other=0)
        if IEEE:
            acc = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = tl.dot(p.to(v.dtype), v)
        tl.store(part_m + slot * S_PAD + s, m)
        tl.store(part_l + slot * S_PAD + s, tl.sum(p, 1))
        tl.store(part_acc + (slot * S_PAD + s[:, None]) * D_PAD + d[None, :], acc)
    else:
        tl.store(part_m + slot * S_PAD + s, tl.full([S_PAD], float("-inf"), tl.float32))
        tl.store(part_l + slot * S_PAD + s, tl.zeros([S_PAD], tl.float32))


@triton.jit
def _merge_kernel(part_m, part_l, part_acc, out, H, S, D, BLOCKS,
                  S_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCKS_PAD: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid: (R * H, S). One query's output from its key blocks' partials (zeros if it saw no key), stored
    at ``out[r, s, h]`` of an ``[R, S, H, d]`` buffer."""
    wait_upstream(USE_PDL)
    rh, s = tl.program_id(0).to(tl.int64), tl.program_id(1)
    b = tl.arange(0, BLOCKS_PAD)
    d = tl.arange(0, D_PAD)
    slots = (rh * BLOCKS + b) * S_PAD + s
    m = tl.load(part_m + slots, mask=b < BLOCKS, other=float("-inf"))
    l = tl.load(part_l + slots, mask=b < BLOCKS, other=0.0)
    top = tl.max(m, 0)
    weight = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)
    total = tl.sum(weight * l, 0)
    # (a block that saw nothing stored no values: its lanes are not read)
    acc = tl.load(part_acc + slots[:, None] * D_PAD + d[None, :], mask=(weight > 0)[:, None] & (d < D)[None, :], other=0.0)
    o = tl.sum(weight[:, None] * acc, 0) / tl.where(total > 0, total, 1.0)
    r, h = rh // H, rh % H
    tl.store(out + ((r * S + s) * H + h) * D + d, o.to(out.dtype.element_ty), mask=d < D)


def key_block(columns: int) -> int:
    """Keys per program: 64, more for long buffers (at most about 16 blocks per (row, head), up to 256)."""
    return min(256, max(64, triton.next_power_of_2(triton.cdiv(columns, 16))))


def draft_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
                    *, block_t: int | None = None) -> torch.Tensor:
    """``q [R, H, S, d]`` (S <= ``MAX_QUERIES``) over ``keys, values [R, H, T, d]`` under ``mask [R or 1, S, T]``
    -> ``[R, S, H, d]`` in ``q``'s dtype (the heads side by side). Sums in fp32; the softmax weights are
    rounded to the inputs' dtype before their product with the values (as FlashAttention does), and fp32
    inputs multiply in full fp32."""
    check_draft_attention(q, keys, values, mask)
    rows, heads, queries, dim = q.shape
    columns = keys.shape[2]
    if queries > MAX_QUERIES:
        raise ValueError(f"draft_attention: at most {MAX_QUERIES} queries per (row, head), got {queries}")
    if not (q.stride(3) == keys.stride(3) == values.stride(3) == 1):
        q, keys, values = q.contiguous(), keys.contiguous(), values.contiguous()
    out = torch.empty(rows, queries, heads, dim, dtype=q.dtype, device=q.device)
    if out.numel() == 0 or columns == 0:
        return out.zero_()
    block_t = block_t or key_block(columns)
    blocks = triton.cdiv(columns, block_t)
    s_pad, d_pad = 16, max(16, triton.next_power_of_2(dim))  # (tl.dot takes blocks of 16 or more)
    f32 = {"dtype": torch.float32, "device": q.device}
    part_m, part_l = torch.empty(rows * heads, blocks, s_pad, **f32), torch.empty(rows * heads, blocks, s_pad, **f32)
    part_acc = torch.empty(rows * heads, blocks, s_pad, d_pad, **f32)
    mask = mask.view(torch.uint8)
    mask_row = 0 if mask.shape[0] == 1 else mask.stride(0)
    _block_kernel[(rows * heads, blocks)](
        q, keys, values, mask, part_m, part_l, part_acc, scale, heads, queries, columns, dim,
        *q.stride()[:3], *keys.stride()[:3], *values.stride()[:3], mask_row, *mask.stride()[1:],
        S_PAD=s_pad, D_PAD=d_pad, BLOCK_T=block_t, IEEE=q.dtype == torch.float32, **launch_args(q.device),
    )
    _merge_kernel[(rows * heads, queries)](part_m, part_l, part_acc, out, heads, queries, dim, blocks,
                                           S_PAD=s_pad, D_PAD=d_pad, BLOCKS_PAD=max(2, triton.next_power_of_2(blocks)),
                                           **launch_args(q.device))
    return out
