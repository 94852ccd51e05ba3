"""One-row GEMVs on CUDA cores, with the small work before them folded in: the plain decoding step at B=1.

At one row a GEMM is a weight stream, and what surrounds it in a pass (a norm, a gate) is a kernel of its own
that costs as much as a small GEMM (``docs/speed.md``). ``benchmarks/persistent_gpu.py`` measured, at the
GDN-1.3B shape on an H200, a GEMV that keeps products in registers element-wise (summed once per output tile) and
loads the next weight tile before it multiplies this one: with a layer's gated output norm in its prologue, the
norm and o_proj took 7.0 us a layer, where a pass's norm kernel and cuBLAS's GEMM take 4.0 + 6.2 (``e2e_gpu.md``'s
profile, another call).

:func:`gated_norm_gemv` is that kernel for ``specla::gated_norm_linear`` (reference:
``reference.gated_norm_linear_reference``): each program normalizes the row's heads itself (a row is a few KB),
then streams its tile of output rows' weights. :func:`swiglu_gemv` is the same kernel for ``specla::swiglu_linear``
(an MLP's ``silu(gate) * up`` and down projection), the product made chunk by chunk from the gate/up row: it
replaces inductor's kernel of the product and cuBLAS's split-K GEMM and reduction (1.1-1.7, 8.9 and 1.8-2.1 us a
layer at the 1.3B shape on an H200; the probe's GEMV of down took 10.1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ops import GATED_NORM_GEMV_BLOCK_K, gated_norm_gemv_fits, swiglu_gemv_block_k, swiglu_gemv_fits
from .pdl import launch_args, wait_upstream

BLOCK_N, BLOCK_K, WARPS = 16, GATED_NORM_GEMV_BLOCK_K, 16  # persistent_gpu.md's best one-row GEMV at the 1.3B shape


@triton.jit
def _prologue(x_ptr, gate_ptr, norm_ptr, offs_k, head_scale, heads, K: tl.constexpr, D: tl.constexpr,
              SWIGLU: tl.constexpr):
    """The GEMV's input over the K chunk ``offs_k``, made from the row and rounded to its dtype as the unfused kernel
    before the GEMM writes it: ``silu(gate) * up`` of the row's two halves (SWIGLU), or the gated RMS norm of its
    heads (``head_scale``: each head's ``rsqrt(mean(x^2) + eps)``)."""
    if SWIGLU:
        gate = tl.load(x_ptr + offs_k).to(tl.float32)
        z = gate * tl.sigmoid(gate) * tl.load(x_ptr + K + offs_k).to(tl.float32)
    else:
        scale = tl.sum(tl.where((offs_k // D)[:, None] == heads[None, :], head_scale[None, :], 0.0), 1)
        gate = tl.load(gate_ptr + offs_k).to(tl.float32)
        z = (tl.load(x_ptr + offs_k).to(tl.float32) * scale * tl.load(norm_ptr + offs_k % D).to(tl.float32)
             * gate * tl.sigmoid(gate))
    return z.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _gemv_kernel(x_ptr, gate_ptr, norm_ptr, w_ptr, y_ptr, N, eps, K: tl.constexpr, NH: tl.constexpr, D: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWIGLU: tl.constexpr, USE_PDL: tl.constexpr):
    """y[n-tile] = W[n-tile] @ z for one row, z made by ``_prologue`` chunk by chunk (K a multiple of BLOCK_K; with
    the norm, NH heads of D values)."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_in = offs_n < N
    heads = tl.arange(0, NH)
    w_rows = w_ptr + offs_n[:, None] * K
    w = tl.load(w_rows + tl.arange(0, BLOCK_K)[None, :], mask=n_in[:, None], other=0.0)  # (weights: before the wait)
    wait_upstream(USE_PDL)
    head_scale = tl.zeros((NH,), tl.float32)
    if not SWIGLU:
        x = tl.load(x_ptr + heads[:, None] * D + tl.arange(0, D)[None, :]).to(tl.float32)
        head_scale = tl.rsqrt(tl.sum(x * x, 1) / D + eps)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        next_k = offs_k + BLOCK_K
        w_next = tl.load(w_rows + next_k[None, :], mask=n_in[:, None] & (next_k < K)[None, :], other=0.0)
        z = _prologue(x_ptr, gate_ptr, norm_ptr, offs_k, head_scale, heads, K, D, SWIGLU)
        acc += w.to(tl.float32) * z[None, :]
        w = w_next
    tl.store(y_ptr + offs_n, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=n_in)


def _launch(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
            lead: tuple[int, ...], heads: int, dim: int, swiglu: bool, block_n: int, block_k: int, warps: int) -> torch.Tensor:
    """``y [*lead, N]`` from one launch of ``_gemv_kernel`` over the output tiles."""
    n = weight.shape[0]
    y = torch.empty(*lead, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](x, gate, norm_weight, weight, y, n, eps, K=weight.shape[1], NH=heads, D=dim,
                                             BLOCK_N=block_n, BLOCK_K=block_k, SWIGLU=swiglu, num_warps=warps,
                                             **launch_args(x.device))
    return y


def gated_norm_gemv(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                    block_n: int = BLOCK_N, block_k: int = BLOCK_K, warps: int = WARPS) -> torch.Tensor:
    """``specla::gated_norm_linear`` for one contiguous row (``ops.gated_norm_gemv_fits``): ``[..., H, D]`` ->
    ``[..., N]``. The weight's first tile loads before the kernel waits for the one before it (PDL): the weight
    must be a model's parameter, which no kernel of the pass writes."""
    if not (gated_norm_gemv_fits(x, gate, norm_weight, weight, block_k) and x.is_contiguous() and gate.is_contiguous()
            and norm_weight.is_contiguous()):
        raise ValueError(f"gated_norm_gemv takes one contiguous row of power-of-two heads and a weight of its dtype; got "
                         f"x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    return _launch(x, gate, norm_weight, eps, weight, x.shape[:-2], *x.shape[-2:], False, block_n, block_k, warps)


def swiglu_gemv(gate_up: torch.Tensor, weight: torch.Tensor, block_n: int = BLOCK_N, block_k: int | None = None,
                warps: int = WARPS) -> torch.Tensor:
    """``specla::swiglu_linear`` for one contiguous row of ``[gate, up]`` (``ops.swiglu_gemv_block_k``, whose K chunk
    it takes unless given): ``[..., 2I]`` -> ``[..., N]``. As :func:`gated_norm_gemv`, the weight's first tile loads
    before the kernel waits for the one before it."""
    block_k = block_k or swiglu_gemv_block_k(weight)
    if not (swiglu_gemv_fits(gate_up, weight) and gate_up.is_contiguous() and weight.shape[1] % block_k == 0):
        raise ValueError(f"swiglu_gemv takes one contiguous row of [gate, up] and a contiguous weight of its dtype whose "
                         f"inner size a power of two >= 16 divides; got {tuple(gate_up.shape)} {gate_up.dtype}, weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    return _launch(gate_up, gate_up, weight, 0.0, weight, gate_up.shape[:-1], 1, 1, True, block_n, block_k, warps)  # (no norm: its pointers unread)
