"""A chunked gated delta rule in plain PyTorch, for training where fla's chunk kernels cannot be used.

fla 0.6.0 refuses its gated chunk backward with Triton >= 3.4.0 and < 3.7.1 on Hopper (wrong
gradients, fla issue #640). This module computes the same chain recurrence as
``specla_compile.kernels.reference.gdn_chain_reference`` in chunks (the WY / UT form): inside a chunk
of C tokens the delta-rule updates are one triangular solve and a few matmuls, and only the chunk
boundary states are carried sequentially. Everything is differentiable by autograd and compiles with
inductor (the solve falls back to the aten kernel).

Per value head, with cumulative log decay ``G`` inside a chunk, ``Gamma[i, j] = exp(G_i - G_j)`` (i >= j)
and ``S`` the state entering the chunk (``[K, V]``)::

    (I + L) U = diag(beta) (V - diag(exp G) K S),   L[i, j] = beta_i (k_i . k_j) Gamma[i, j]  (i > j)
    o_i      = exp(G_i) q_i S + sum_{j <= i} Gamma[i, j] (q_i . k_j) U_j
    S'       = exp(G_C) S + sum_j exp(G_C - G_j) k_j U_j^T

``U`` is solved as ``W = (I+L)^-1 diag(beta exp G) K`` and ``U0 = (I+L)^-1 diag(beta) V`` once per chunk
(independent of ``S``), then ``U = U0 - W S`` in the sequential pass.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..kernels.reference import l2norm
from ..lowering.capture import fla_recurrence_adapter

DEFAULT_CHUNK = 64
FLA_GDN_MODULE = "fla.layers.gated_deltanet"


def chunked_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a whole sequence, chunk by chunk: ``(o [B, N, HV, V], final state
    [B, HV, K, V])``. Shapes and arguments as :func:`gdn_chain_reference`; computes in float32
    (float64 when ``v`` or the state is float64) with autocast off, returns ``o`` in ``v``'s dtype."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    out_dtype = v.dtype
    dtype = torch.float64 if torch.float64 in (v.dtype, getattr(initial_state, "dtype", None)) else torch.float32
    with torch.autocast(v.device.type, enabled=False):  # the recurrence needs fp32 even in bf16 training
        batch, n, heads, dk = q.shape
        hv, dv = v.shape[2], v.shape[3]
        q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
        if use_qk_l2norm:
            q, k = l2norm(q), l2norm(k)
        scale = dk**-0.5 if scale is None else scale
        # [B, HV, N, D]: each query/key head serves hv // heads consecutive value heads
        q, k = (t.repeat_interleave(hv // heads, dim=2).transpose(1, 2) for t in (q, k))
        v, g, beta = v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2)
        pad = -n % chunk_size  # zero-padded tail tokens: g = 0, beta = 0 leave the state untouched
        if pad:
            q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
            g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
        chunks = (n + pad) // chunk_size
        q, k, v = (t.reshape(batch, hv, chunks, chunk_size, -1) for t in (q, k, v))
        g = g.reshape(batch, hv, chunks, chunk_size).cumsum(-1)
        beta = beta.reshape(batch, hv, chunks, chunk_size)

        lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
        # exp only where i >= j: above the diagonal the difference is positive and could overflow
        gamma = (g[..., :, None] - g[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        strict = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * gamma).tril(-1)
        eye = torch.eye(chunk_size, dtype=dtype, device=q.device)
        rhs = torch.cat([(beta * g.exp())[..., None] * k, beta[..., None] * v], dim=-1)
        solved = torch.linalg.solve_triangular(eye + strict, rhs, upper=False, unitriangular=True)
        w, u0 = solved[..., :dk], solved[..., dk:]
        qk = (q @ k.transpose(-1, -2)) * gamma * scale  # intra-chunk attention, causal through gamma
        q_decayed = q * (g.exp()[..., None] * scale)
        k_to_end = k * (g[..., -1:] - g).exp()[..., None]
        end_decay = g[..., -1].exp()

        state = torch.zeros(batch, hv, dk, dv, dtype=dtype, device=q.device)
        if initial_state is not None:
            state = initial_state.to(dtype)
        outs = []
        for c in range(chunks):
            u = u0[:, :, c] - w[:, :, c] @ state
            outs.append(q_decayed[:, :, c] @ state + qk[:, :, c] @ u)
            state = end_decay[:, :, c, None, None] * state + k_to_end[:, :, c].transpose(-1, -2) @ u
        o = torch.stack(outs, dim=2).reshape(batch, hv, chunks * chunk_size, dv)[:, :, :n]
    return o.transpose(1, 2).to(out_dtype), state


def fla_chunk_replacement(chunk_size: int = DEFAULT_CHUNK, compile: bool = False):
    """A drop-in for fla's ``chunk_gated_delta_rule`` (same arguments, via the capture adapter that
    applies fla's in-kernel gate and beta sigmoid) computed by :func:`chunked_gdn`."""
    core = torch.compile(chunked_gdn, fullgraph=True, dynamic=False) if compile else chunked_gdn

    def chunk_gated_delta_rule(*args, **kwargs):
        call = fla_recurrence_adapter(*args, **kwargs)
        state = call.initial_state
        if state is not None and call.state_v_first:
            state = state.transpose(-1, -2)
        o, final = core(
            call.q,
            call.k,
            call.v,
            call.g,
            call.beta,
            state,
            scale=call.scale,
            use_qk_l2norm=call.use_qk_l2norm,
            chunk_size=chunk_size,
        )
        if call.state_v_first:
            final = final.transpose(-1, -2)
        return o, (final if call.output_final_state else None)

    return chunk_gated_delta_rule


@contextlib.contextmanager
def torch_chunk_gdn(chunk_size: int = DEFAULT_CHUNK, compile: bool = False) -> Iterator[None]:
    """Inside the block, every fla ``GatedDeltaNet`` layer computes its chunk-mode recurrence with
    :func:`chunked_gdn` instead of fla's Triton kernels (the name the layer module looks up at call
    time is swapped and restored afterwards, so models built before or after are unaffected)."""
    module = importlib.import_module(FLA_GDN_MODULE)
    saved = module.chunk_gated_delta_rule
    module.chunk_gated_delta_rule = fla_chunk_replacement(chunk_size, compile)
    try:
        yield
    finally:
        module.chunk_gated_delta_rule = saved
