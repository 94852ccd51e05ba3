"""A chunked gated delta rule in plain PyTorch, for training where fla's chunk kernels cannot be used.

fla 0.6.0 refuses its gated chunk backward with Triton >= 3.4.0 and < 3.7.1 on Hopper (wrong
gradients, fla issue #640). This module computes the same chain recurrence as
``specla_compile.kernels.reference.gdn_chain_reference`` in chunks (the WY / UT form): inside a chunk
of C tokens the delta-rule updates are one triangular solve and a few matmuls, and only the chunk
boundary states are carried sequentially. Everything is differentiable by autograd and compiles with
inductor (the chunk-parallel part; the solve falls back to the aten kernel); the pass over chunks can also have its
backward written out (:class:`_WrittenScan`: three kernels a chunk each way, the rest batched over chunks).

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
import functools
import importlib
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..kernels.reference import l2norm
from ..lowering.capture import fla_recurrence_adapter

DEFAULT_CHUNK = 64
TRIANGULAR = ("solve", "inverse")  # how (I + L) U = R is solved in a chunk: see chunk_factors
SCANS = ("autograd", "written", "compiled")  # the pass over chunks: see chunked_gdn
FLA_GDN_MODULE = "fla.layers.gated_deltanet"


class ChunkFactors(NamedTuple):
    """The chunk-parallel part of :func:`chunked_gdn`, ``[chunks, B, HV, C, ...]`` (float32/64; chunks first, so that
    each chunk's slice is contiguous)."""

    w: torch.Tensor  # (I + L)^-1 diag(beta exp G) K          [.., C, K]
    u0: torch.Tensor  # (I + L)^-1 diag(beta) V                [.., C, V]
    qk: torch.Tensor  # scale Gamma * (Q K^T), causal          [.., C, C]
    q_decayed: torch.Tensor  # scale exp(G_i) q_i              [.., C, K]
    k_to_end: torch.Tensor  # exp(G_C - G_j) k_j               [.., C, K]
    end_decay: torch.Tensor  # exp(G_C)                        [..]


def chunk_factors(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
    chunk_size: int,
    triangular: str = "solve",
) -> ChunkFactors:
    """Everything that does not depend on the state entering a chunk, for all chunks at once (the
    part worth compiling: elementwise work around a few batched matmuls and one triangular solve).
    ``triangular``: ``"solve"``, the solve as one batched triangular solve; ``"inverse"``, as ``(I + L)^-1``
    from :func:`unit_lower_inverse` times the right-hand sides (matmuls only, whose backward is matmuls too)."""
    heads, hv = q.shape[2], v.shape[2]
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    # each query/key head serves hv // heads consecutive value heads
    q, k = (t.repeat_interleave(hv // heads, dim=2) for t in (q, k))
    pad = -q.shape[1] % chunk_size  # zero-padded tail tokens: g = 0, beta = 0 leave the state untouched
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, 0, 0, pad)), F.pad(beta, (0, 0, 0, pad))
    batch, chunks = q.shape[0], q.shape[1] // chunk_size
    # [B, N, HV, ...] -> [chunks, B, HV, C, ...]
    q, k, v = (t.reshape(batch, chunks, chunk_size, hv, -1).permute(1, 0, 3, 2, 4).contiguous() for t in (q, k, v))
    g = g.reshape(batch, chunks, chunk_size, hv).permute(1, 0, 3, 2).cumsum(-1)
    beta = beta.reshape(batch, chunks, chunk_size, hv).permute(1, 0, 3, 2)

    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp only where i >= j: above the diagonal the difference is positive and could overflow
    gamma = (g[..., :, None] - g[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    strict = (beta[..., :, None] * (k @ k.transpose(-1, -2)) * gamma).tril(-1)
    rhs = torch.cat([(beta * g.exp())[..., None] * k, beta[..., None] * v], dim=-1)
    if triangular == "inverse":
        solved = unit_lower_inverse(strict) @ rhs
    else:
        eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
        solved = torch.linalg.solve_triangular(eye + strict, rhs, upper=False, unitriangular=True)
    dk = k.shape[-1]
    return ChunkFactors(
        w=solved[..., :dk],
        u0=solved[..., dk:],
        qk=(q @ k.transpose(-1, -2)) * gamma * scale,
        q_decayed=q * (g.exp()[..., None] * scale),
        k_to_end=k * (g[..., -1:] - g).exp()[..., None],
        end_decay=g[..., -1].exp(),
    )


def unit_lower_inverse(strict: torch.Tensor, block: int = 16) -> torch.Tensor:
    """``(I + strict)^-1`` for strictly lower-triangular ``strict [..., C, C]`` in small matmuls, no triangular
    solve: each diagonal block of up to ``block`` rows (a divisor of C) by forward substitution, row by row, then
    each block row below the first from the inverse above it, ``X[i, :i] = -D_i^-1 L[i, :i] X[:i, :i]``."""
    c = strict.shape[-1]
    b = next(d for d in range(min(block, c), 0, -1) if c % d == 0)
    eye = torch.eye(b, dtype=strict.dtype, device=strict.device)
    diag = torch.stack([strict[..., i : i + b, i : i + b] for i in range(0, c, b)], dim=-3)  # [..., C / b, b, b]
    rows = [eye[:1].expand(*diag.shape[:-2], 1, b)]
    for r in range(1, b):  # row r of (I + N)^-1 is e_r - N[r, :r] times the rows above it
        rows.append(eye[r : r + 1] - diag[..., r : r + 1, :r] @ torch.cat(rows, dim=-2))
    inverses = torch.cat(rows, dim=-2)
    x = inverses[..., 0, :, :]
    for i in range(1, c // b):
        lo = i * b
        below = -inverses[..., i, :, :] @ (strict[..., lo : lo + b, :lo] @ x)
        x = torch.cat([torch.cat([x, x.new_zeros(*x.shape[:-1], b)], dim=-1),
                       torch.cat([below, inverses[..., i, :, :]], dim=-1)], dim=-2)
    return x


@functools.cache
def _compiled_chunk_factors():
    return torch.compile(chunk_factors, fullgraph=True, dynamic=False)


def sequential_pass(factors: ChunkFactors, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunks in order: each one's output ``[chunks, B, HV, C, V]`` from the state entering it, then the
    state leaving it (four matmuls a chunk)."""
    # unbound once, not indexed per chunk: the backward of ``x[c]`` writes a zero tensor of all of x's chunks and
    # adds it to the gradient, work quadratic in the chunk count; unbind's backward is one stack
    per_chunk = zip(*(t.unbind(0) for t in factors))
    outs = []
    for w, u0, qk, q_decayed, k_to_end, end_decay in per_chunk:
        u = u0 - w @ state
        outs.append(q_decayed @ state + qk @ u)
        state = end_decay[..., None, None] * state + k_to_end.transpose(-1, -2) @ u
    return torch.stack(outs), state


@functools.cache
def _compiled_sequential_pass():
    return torch.compile(sequential_pass, fullgraph=True, dynamic=False)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[chunks, B, HV, ...]`` as ``[chunks, B * HV, ...]``: each chunk one 3-d batch for ``baddbmm`` (a view where
    ``t`` is contiguous, as the factors are)."""
    return t.reshape(t.shape[0], t.shape[1] * t.shape[2], *t.shape[3:])


class _WrittenScan(torch.autograd.Function):
    """:func:`sequential_pass` with its backward written out. Only the state's recurrence runs chunk by chunk
    (three kernels a chunk each way); the outputs and every factor's gradient are batched matmuls over all chunks
    from the states it keeps (``S_c``, entering chunk c) and their gradients. Autograd through the loop ran 746 ops
    for 32 chunks, forward and backward, against 227 (counted on the CPU), summing each chunk's gradients one by one.

    With ``dS_c`` the gradient of ``S_c`` and ``U_c = U0_c - W_c S_c``, ``O_c = Qd_c S_c + QK_c U_c``,
    ``S_{c+1} = e_c S_c + Ke_c^T U_c``::

        dU_c = QK_c^T dO_c + Ke_c dS_{c+1}          dS_c = e_c dS_{c+1} + Qd_c^T dO_c - W_c^T dU_c
        dU0_c = dU_c   dW_c = -dU_c S_c^T   dQK_c = dO_c U_c^T   dQd_c = dO_c S_c^T
        dKe_c = U_c dS_{c+1}^T   de_c = <S_c, dS_{c+1}>
    """

    @staticmethod
    def forward(ctx, w, u0, qk, q_decayed, k_to_end, end_decay, state):
        chunks, batch, heads = w.shape[:3]
        w, u0, qk, q_decayed, k_to_end = (_rows(t) for t in (w, u0, qk, q_decayed, k_to_end))
        decay = _rows(end_decay)[..., None, None]
        states = state.new_empty(chunks + 1, batch * heads, *state.shape[2:])
        states[0] = state.reshape(batch * heads, *state.shape[2:])
        u = torch.empty_like(u0)
        for c in range(chunks):
            torch.baddbmm(u0[c], w[c], states[c], alpha=-1, out=u[c])
            torch.baddbmm(states[c] * decay[c], k_to_end[c].transpose(1, 2), u[c], out=states[c + 1])
        o = q_decayed @ states[:-1] + qk @ u
        ctx.save_for_backward(w, qk, q_decayed, k_to_end, decay, u, states)
        ctx.shape = batch, heads
        return o.reshape(chunks, batch, heads, *o.shape[2:]), states[-1].reshape(state.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, d_o, d_final):
        w, qk, q_decayed, k_to_end, decay, u, states = ctx.saved_tensors
        batch, heads = ctx.shape
        chunks, rows = u.shape[:2]
        d_o = _rows(d_o.contiguous())
        d_states = torch.empty_like(states)  # d_states[c]: the gradient of S_c, its Qd_c^T dO_c term first (batched)
        d_states[-1] = 0 if d_final is None else d_final.reshape(rows, *states.shape[2:])
        torch.matmul(q_decayed.transpose(-1, -2), d_o, out=d_states[:-1])
        d_u = qk.transpose(-1, -2) @ d_o  # (plus Ke_c dS_{c+1}, chunk by chunk below)
        for c in reversed(range(chunks)):
            d_u[c].baddbmm_(k_to_end[c], d_states[c + 1])
            d_states[c].addcmul_(d_states[c + 1], decay[c]).baddbmm_(w[c].transpose(1, 2), d_u[c], alpha=-1)
        entering, leaving = states[:-1], d_states[1:]
        grads = (-(d_u @ entering.transpose(-1, -2)), d_u, d_o @ u.transpose(-1, -2),
                 d_o @ entering.transpose(-1, -2), u @ leaving.transpose(-1, -2))
        # <S_c, dS_{c+1}> as a batched dot product (no temporary of all the states' size)
        d_decay = (entering.flatten(-2)[..., None, :] @ leaving.flatten(-2)[..., :, None])[..., 0, 0]
        return (*(g.reshape(g.shape[0], batch, heads, *g.shape[2:]) for g in (*grads, d_decay)),
                d_states[0].reshape(batch, heads, *states.shape[2:]))


def written_scan(factors: ChunkFactors, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sequential_pass`'s outputs, its backward written out (:class:`_WrittenScan`)."""
    return _WrittenScan.apply(*factors, state)


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
    compile: bool = False,
    scan: str = "autograd",
    triangular: str = "solve",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over a whole sequence, chunk by chunk: ``(o [B, N, HV, V], final state
    [B, HV, K, V])``. Shapes and arguments as :func:`gdn_chain_reference`; computes in float32
    (float64 when ``v`` or the state is float64) with autocast off, returns ``o`` in ``v``'s dtype.
    ``compile``: the chunk-parallel part through inductor (its graph does not grow with the length);
    ``scan``: the pass over chunks, ``"autograd"`` through autograd (:func:`sequential_pass`, the reference),
    ``"written"`` with its backward written out (:func:`written_scan`; train_target's default: one layer of the
    24-layer target 24.2 against 27.8 ms on an H100, 5-7% faster on a 2-core CPU) or ``"compiled"`` by inductor
    (unrolled: one graph per number of chunks); ``triangular``: how each chunk's triangular system is solved
    (:func:`chunk_factors`)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if triangular not in TRIANGULAR:
        raise ValueError(f"triangular must be one of {TRIANGULAR}, got {triangular!r}")
    if scan not in SCANS:
        raise ValueError(f"scan must be one of {SCANS}, got {scan!r}")
    out_dtype, (batch, n, _, dk), (hv, dv) = v.dtype, q.shape, v.shape[2:]
    chunk_size = max(1, min(chunk_size, n))  # a shorter sequence (a decoding step) is one chunk, not padded to one
    dtype = torch.float64 if torch.float64 in (v.dtype, getattr(initial_state, "dtype", None)) else torch.float32
    with torch.autocast(v.device.type, enabled=False):  # the recurrence needs fp32 even in bf16 training
        q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
        scale = dk**-0.5 if scale is None else scale
        factors = (_compiled_chunk_factors() if compile else chunk_factors)(
            q, k, v, g, beta, scale, use_qk_l2norm, chunk_size, triangular
        )
        state = torch.zeros(batch, hv, dk, dv, dtype=dtype, device=q.device)
        if initial_state is not None:
            state = initial_state.to(dtype)
        if scan == "compiled":
            o, state = _compiled_sequential_pass()(factors, state)
        else:
            o, state = (written_scan if scan == "written" else sequential_pass)(factors, state)
        # [chunks, B, HV, C, V] -> [B, N, HV, V]
        o = o.permute(1, 0, 3, 2, 4).reshape(batch, -1, hv, dv)[:, :n]
    return o.to(out_dtype), state


def fla_chunk_replacement(
    chunk_size: int = DEFAULT_CHUNK, compile: bool = False, scan: str = "autograd", triangular: str = "solve"
) -> Callable[..., tuple]:
    """A drop-in for fla's ``chunk_gated_delta_rule`` (same arguments, via the capture adapter that
    applies fla's in-kernel gate and beta sigmoid) computed by :func:`chunked_gdn`."""

    def chunk_gated_delta_rule(*args, **kwargs):
        call = fla_recurrence_adapter(*args, **kwargs)
        state = call.initial_state
        if state is not None and call.state_v_first:
            state = state.transpose(-1, -2)
        o, final = chunked_gdn(
            call.q,
            call.k,
            call.v,
            call.g,
            call.beta,
            state,
            scale=call.scale,
            use_qk_l2norm=call.use_qk_l2norm,
            chunk_size=chunk_size,
            compile=compile,
            scan=scan,
            triangular=triangular,
        )
        if call.state_v_first:
            final = final.transpose(-1, -2)
        return o, (final if call.output_final_state else None)

    return chunk_gated_delta_rule


@contextlib.contextmanager
def torch_chunk_gdn(
    chunk_size: int = DEFAULT_CHUNK, compile: bool = False, scan: str = "autograd", triangular: str = "solve"
) -> Iterator[None]:
    """Inside the block, every fla ``GatedDeltaNet`` layer computes its chunk-mode recurrence with
    :func:`chunked_gdn` instead of fla's Triton kernels (the name the layer module looks up at call
    time is swapped and restored afterwards, so models built before or after are unaffected)."""
    module = importlib.import_module(FLA_GDN_MODULE)
    saved = module.chunk_gated_delta_rule
    module.chunk_gated_delta_rule = fla_chunk_replacement(chunk_size, compile, scan, triangular)
    try:
        yield
    finally:
        module.chunk_gated_delta_rule = saved


@contextlib.contextmanager
def plain_torch_fla(chunk_size: int = DEFAULT_CHUNK) -> Iterator[None]:
    """Inside the block, fla's GDN models run without a single Triton kernel or compilation, on any
    device: the recurrence (chunk and fused-recurrent modes) by :func:`chunked_gdn`, eagerly; the short
    convolutions, RMSNorm, gated RMSNorm and SwiGLU by the PyTorch forms the capture routes them to on
    CPU. For a forward pass whose first call must not wait for fla's Triton autotuning (on the H200,
    about 100 s of compiling every config of the chunk kernels): the EAGLE head's training features, and
    the greedy decoding of its self-distillation (prompt and one-token steps over fla's cache).
    The names are swapped and restored on exit, as in :func:`torch_chunk_gdn`."""
    from ..lowering import capture

    recurrence = fla_chunk_replacement(chunk_size, compile=False)
    swaps = [
        (FLA_GDN_MODULE, "chunk_gated_delta_rule", recurrence),
        (FLA_GDN_MODULE, "fused_recurrent_gated_delta_rule", recurrence),
        (FLA_GDN_MODULE, "causal_conv1d", capture.fla_causal_conv1d),
        ("fla.modules:ShortConvolution", "forward", capture.fla_short_conv_forward),
        ("fla.modules:FusedRMSNormGated", "forward", capture.fla_rms_norm_gated_forward),
        ("fla.modules:RMSNorm", "forward", capture.fla_rms_norm_forward),
        ("fla.modules.mlp:SwiGLULinear", "forward", capture.fla_swiglu_linear_forward),
    ]
    saved = []
    try:
        for owner_name, name, replacement in swaps:
            try:
                owner = capture._resolve_owner(owner_name)
            except (ImportError, AttributeError):  # fla is not installed (a model of another family runs as it is)
                continue
            saved.append((owner, name, getattr(owner, name)))
            setattr(owner, name, replacement)
        yield
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
