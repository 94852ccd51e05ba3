"""One persistent kernel for a whole plain pass of the GDN-1.3B shape: what would it cost?

Issue 8's plain-decoding target (1.0 ms/token at the GDN-1.3B shape, B=1) is missed at 1.55 ms: a pass runs
about 300 kernels, its GEMMs stream the weights in about 1.0 ms and the small kernels between them take about
0.5 ms more, in series (``docs/speed.md``). Folds, prefetches, faster GEMVs and PDL each moved it a few percent.
This probe measures the other design: one launch of one program per SM that runs every layer in five phases,
each program taking its share of a phase's work, with a grid-wide barrier (an atomic counter) between phases:

  0. the residual's RMS norm (every program computes it for itself) and the fused q/k/v/gate/a/b GEMV;
  1. the recurrence: SiLU and L2 norm of q and k, the decay and write strength, the state update and
     the output, one program per head and 16 value columns;
  2. the gated output norm (every program for itself) and o_proj, added to the residual;
  3. the RMS norm and the MLP's gate/up GEMV with SiLU(gate) * up in its epilogue;
  4. down_proj, added to the residual.

The norms, gates and activations cost no launch and no pass over memory of their own; what a barrier costs
is the question. Left out: the short convolutions (per channel, they belong in phase 0's epilogue), the LM
head and the pending-record bookkeeping of a speculative pass. In the same run, in one CUDA graph each,
median replay: the same phases launched as one kernel each (five a layer instead of the pass's 13), and
cuBLAS's GEMMs of the pass alone (what today's pass spends in GEMMs, about 1.0 ms). Both kernels' results
are checked against a PyTorch reference of the same math.

    python benchmarks/persistent_gpu.py --out benchmarks/results      # H200, about 3 minutes
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from gemv_gpu import graph_ms, save_results, start_run

GDN_1P3B = {"layers": 24, "hidden": 2048, "heads": 8, "head_dim": 256, "intermediate": 5632}
PHASES = 5
EPS = 1e-6
# (BLOCK_N, BLOCK_K, num_warps, DEFER_NORM, PRELOAD): the weight tile of a GEMV step, and the two latencies a
# phase's start can hide (see _gemv_phase and layer_stack_kernel)
CONFIGS = [(16, 512, 16, False, False), (16, 512, 16, True, False), (16, 512, 16, True, True), (16, 512, 8, True, True),
           (8, 512, 4, True, True)]


@triton.jit
def _silu(x):
    return x * tl.sigmoid(x)


@triton.jit
def _grid_sync(bar_ptr, target):
    """Wait until ``target`` arrivals at the counter (this program's included): every program's writes before
    its arrival are then visible in L2, which the phases read with ``.cg`` loads (L1 is not coherent)."""
    tl.debug_barrier()  # (every thread of this program has issued its writes)
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _rms_scale(x_ptr, H: tl.constexpr, eps):
    x = tl.load(x_ptr + tl.arange(0, H), cache_modifier=".cg")
    return tl.rsqrt(tl.sum(x * x, 0) / H + eps)


@triton.jit
def _gemv_input(MODE: tl.constexpr, kk, layer, x_ptr, act_ptr, o_ptr, m_ptr, norm_ptr, onorm_ptr, scale, head_scale,
                H: tl.constexpr, NH: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr):
    """K chunk ``kk`` of a GEMV's input vector (see :func:`_gemv_phase`), float32, and the residual's own chunk
    (MODE 0 and 3; zeros otherwise), whose squares sum to the norm's scale."""
    offs_k = kk * BLOCK_K + tl.arange(0, BLOCK_K)
    residual = tl.zeros((BLOCK_K,), tl.float32)
    if MODE == 0 or MODE == 3:
        residual = tl.load(x_ptr + offs_k, cache_modifier=".cg")
        x = residual * scale * tl.load(norm_ptr + layer * H + offs_k)
    elif MODE == 2:
        heads = offs_k // DV
        x_scale = tl.sum(tl.where(heads[:, None] == tl.arange(0, NH)[None, :], head_scale[None, :], 0.0), 1)
        gate = tl.load(act_ptr + 3 * NH * DV + offs_k, cache_modifier=".cg")
        x = (tl.load(o_ptr + offs_k, cache_modifier=".cg") * x_scale * tl.load(onorm_ptr + layer * DV + offs_k % DV)
             * _silu(gate))
    else:
        x = tl.load(m_ptr + offs_k, cache_modifier=".cg")
    return x, residual


@triton.jit
def _weight_tile(w_ptr, it, steps, pid, P, row_offset, N_OUT, K: tl.constexpr, KI: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Step ``it`` of a program's walk over (its output tile, K chunk) pairs: the weight tile, zeros past the
    walk's end or the output's edge."""
    offs_n = (pid + (it // KI) * P) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = (it % KI) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows = tl.where(it < steps, N_OUT, 0)
    return tl.load(w_ptr + (offs_n + row_offset)[:, None] * K + offs_k[None, :], mask=(offs_n < rows)[:, None], other=0.0)


@triton.jit
def _walk(pid, P, N_OUT, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """How many (tile, K chunk) steps a program walks in a GEMV of N_OUT outputs."""
    return tl.maximum(tl.cdiv(tl.cdiv(N_OUT, BLOCK_N) - pid, P), 0) * (K // BLOCK_K)


@triton.jit
def _first_tiles(w_ptr, layer, pid, P, N, K: tl.constexpr, I: tl.constexpr, MODE: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile(s) a program's walk in a GEMV starts with (the gate's and the up's in MODE 3)."""
    N_OUT = I if MODE == 3 else N
    w_ptr += layer * N * K
    steps = _walk(pid, P, N_OUT, K, BLOCK_N, BLOCK_K)
    w = _weight_tile(w_ptr, 0, steps, pid, P, 0, N_OUT, K, K // BLOCK_K, BLOCK_N, BLOCK_K)
    w_up = w
    if MODE == 3:
        w_up = _weight_tile(w_ptr, 0, steps, pid, P, I, N_OUT, K, K // BLOCK_K, BLOCK_N, BLOCK_K)
    return w, w_up


@triton.jit
def _gemv_phase(MODE: tl.constexpr, layer, pid, P, w_ptr, N, K: tl.constexpr, x_ptr, act_ptr, o_ptr, m_ptr, norm_ptr,
                onorm_ptr, eps, w_first, w_up_first, H: tl.constexpr, NH: tl.constexpr, DV: tl.constexpr,
                I: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DEFER_NORM: tl.constexpr,
                PRELOADED: tl.constexpr):
    """One GEMV of a layer, its output tiles dealt to the programs round-robin. A program walks its (tile, K
    chunk) pairs in one loop, so its loads stream on across tiles: the next step's weight and input load before
    this step's multiply (two tiles in flight), and products add up element-wise, summed once per tile.
    PRELOADED: the walk's first tiles are ``w_first``/``w_up_first``, loaded before the barrier in front of this
    phase. MODE 0: x = norm(residual), act = W x. MODE 2: x = gated norm of o, residual += W x. MODE 3:
    x = norm(residual), m = SiLU(W_gate x) * W_up x (gate row n and up row n + I in one program). MODE 4: x = m,
    residual += W x. DEFER_NORM (MODE 0, 3): the norm's scale multiplies each output, from the squares of the
    residual's chunks the walk loads anyway, instead of a pass over the residual before the walk."""
    KI: tl.constexpr = K // BLOCK_K
    NORMED: tl.constexpr = MODE == 0 or MODE == 3
    N_OUT = I if MODE == 3 else N
    if PRELOADED:
        w, w_up = w_first, w_up_first
    else:
        w, w_up = _first_tiles(w_ptr, layer, pid, P, N, K, I, MODE, BLOCK_N, BLOCK_K)
    w_ptr += layer * N * K
    scale = 1.0
    head_scale = tl.zeros((NH,), tl.float32)
    if NORMED and not DEFER_NORM:
        scale = _rms_scale(x_ptr, H, eps)
    if MODE == 2:  # each head's RMS over its DV outputs
        o = tl.load(o_ptr + tl.arange(0, NH)[:, None] * DV + tl.arange(0, DV)[None, :], cache_modifier=".cg")
        head_scale = tl.rsqrt(tl.sum(o * o, 1) / DV + eps)
    steps = _walk(pid, P, N_OUT, K, BLOCK_N, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    squares = tl.zeros((BLOCK_K,), tl.float32)
    x, residual = _gemv_input(MODE, 0, layer, x_ptr, act_ptr, o_ptr, m_ptr, norm_ptr, onorm_ptr, scale, head_scale,
                              H, NH, DV, BLOCK_K)
    for it in range(steps):
        kk = it % KI
        x_next, residual_next = _gemv_input(MODE, (it + 1) % KI, layer, x_ptr, act_ptr, o_ptr, m_ptr, norm_ptr,
                                            onorm_ptr, scale, head_scale, H, NH, DV, BLOCK_K)
        w_next = _weight_tile(w_ptr, it + 1, steps, pid, P, 0, N_OUT, K, KI, BLOCK_N, BLOCK_K)
        w_up_next = w_next
        if MODE == 3:
            w_up_next = _weight_tile(w_ptr, it + 1, steps, pid, P, I, N_OUT, K, KI, BLOCK_N, BLOCK_K)
        acc += w.to(tl.float32) * x[None, :]
        if MODE == 3:
            acc_up += w_up.to(tl.float32) * x[None, :]
        if NORMED and DEFER_NORM:
            squares += residual * residual
        if kk == KI - 1:
            offs_n = (pid + (it // KI) * P) * BLOCK_N + tl.arange(0, BLOCK_N)
            n_in = offs_n < N_OUT
            y = tl.sum(acc, 1)
            y_up = tl.sum(acc_up, 1)
            if NORMED and DEFER_NORM:
                norm_scale = tl.rsqrt(tl.sum(squares, 0) / H + eps)
                y *= norm_scale
                y_up *= norm_scale
                squares = tl.zeros((BLOCK_K,), tl.float32)
            if MODE == 0:
                tl.store(act_ptr + offs_n, y, mask=n_in)
            elif MODE == 3:
                tl.store(m_ptr + offs_n, _silu(y) * y_up, mask=n_in)
            else:
                residual_tile = tl.load(x_ptr + offs_n, mask=n_in, cache_modifier=".cg")
                tl.store(x_ptr + offs_n, residual_tile + y, mask=n_in)
            acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
            acc_up = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
        x = x_next
        residual = residual_next
        w = w_next
        w_up = w_up_next


@triton.jit
def _recurrence_phase(layer, pid, P, act_ptr, o_ptr, state_ptr, a_log_ptr, dt_bias_ptr, NH: tl.constexpr,
                      DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    """The gated delta rule at one token, one (head, BV value columns) item per program: S = S exp(g),
    S += k (beta (v - S^T k))^T, o = S^T q, with q and k SiLU'd and L2-normalized (q scaled by DK^-1/2)."""
    D: tl.constexpr = NH * DK
    VT: tl.constexpr = DV // BV
    offs_k = tl.arange(0, DK)
    for item in range(pid, NH * VT, P):
        h = item // VT
        offs_v = (item % VT) * BV + tl.arange(0, BV)
        q = _silu(tl.load(act_ptr + h * DK + offs_k, cache_modifier=".cg"))
        k = _silu(tl.load(act_ptr + D + h * DK + offs_k, cache_modifier=".cg"))
        v = _silu(tl.load(act_ptr + 2 * D + h * DV + offs_v, cache_modifier=".cg"))
        q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * (DK ** -0.5)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        a = tl.load(act_ptr + 4 * D + h, cache_modifier=".cg") + tl.load(dt_bias_ptr + layer * NH + h)
        g = -tl.exp(tl.load(a_log_ptr + layer * NH + h)) * tl.where(a > 20.0, a, tl.log(1.0 + tl.exp(a)))
        beta = 1.0 / (1.0 + tl.exp(-tl.load(act_ptr + 4 * D + NH + h, cache_modifier=".cg")))
        s_ptrs = state_ptr + (layer * NH + h) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
        s = tl.load(s_ptrs) * tl.exp(g)
        u = beta * (v - tl.sum(s * k[:, None], 0))
        s += k[:, None] * u[None, :]
        tl.store(s_ptrs, s)
        tl.store(o_ptr + h * DV + offs_v, tl.sum(s * q[:, None], 0))


@triton.jit
def _next_first_tiles(step, end, pid, P, w_qkvg_ptr, w_o_ptr, w_gu_ptr, w_down_ptr, H: tl.constexpr, NH: tl.constexpr,
                      DK: tl.constexpr, DV: tl.constexpr, I: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """The first weight tile(s) of ``step``'s GEMV (zeros for a recurrence step or past ``end``)."""
    layer = step // 5
    phase = step % 5
    w = tl.zeros((BLOCK_N, BLOCK_K), w_qkvg_ptr.dtype.element_ty)
    w_up = w
    if step < end:
        if phase == 0:
            w, w_up = _first_tiles(w_qkvg_ptr, layer, pid, P, 4 * NH * DK + 2 * NH, H, I, 0, BLOCK_N, BLOCK_K)
        elif phase == 2:
            w, w_up = _first_tiles(w_o_ptr, layer, pid, P, H, NH * DV, I, 2, BLOCK_N, BLOCK_K)
        elif phase == 3:
            w, w_up = _first_tiles(w_gu_ptr, layer, pid, P, 2 * I, H, I, 3, BLOCK_N, BLOCK_K)
        elif phase == 4:
            w, w_up = _first_tiles(w_down_ptr, layer, pid, P, H, I, I, 4, BLOCK_N, BLOCK_K)
    return w, w_up


@triton.jit
def layer_stack_kernel(x_ptr, act_ptr, o_ptr, m_ptr, state_ptr, w_qkvg_ptr, w_o_ptr, w_gu_ptr, w_down_ptr, norm1_ptr,
                       norm2_ptr, onorm_ptr, a_log_ptr, dt_bias_ptr, bar_ptr, first_step, num_steps, eps,
                       H: tl.constexpr, NH: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, I: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BV: tl.constexpr, DEFER_NORM: tl.constexpr,
                       PRELOAD: tl.constexpr, PERSISTENT: tl.constexpr):
    """Steps ``first_step`` .. ``+ num_steps`` of the stack (step = layer * 5 + phase). PERSISTENT: one launch
    runs them all, a grid barrier after each step (the grid must be co-resident: one program per SM), and with
    PRELOAD each program loads the next GEMV's first weight tiles before it waits at the barrier (weights
    depend on nothing the barrier orders); else the host launches one step at a time."""
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    D: tl.constexpr = NH * DK
    PRELOADED: tl.constexpr = PERSISTENT and PRELOAD
    end = first_step + num_steps
    w_pre = tl.zeros((BLOCK_N, BLOCK_K), w_qkvg_ptr.dtype.element_ty)
    w_up_pre = w_pre
    if PRELOADED:
        w_pre, w_up_pre = _next_first_tiles(first_step, end, pid, P, w_qkvg_ptr, w_o_ptr, w_gu_ptr, w_down_ptr, H, NH,
                                            DK, DV, I, BLOCK_N, BLOCK_K)
    for step in range(first_step, end):
        layer = step // 5
        phase = step % 5
        if phase == 0:
            _gemv_phase(0, layer, pid, P, w_qkvg_ptr, 4 * D + 2 * NH, H, x_ptr, act_ptr, o_ptr, m_ptr, norm1_ptr,
                        onorm_ptr, eps, w_pre, w_up_pre, H, NH, DV, I, BLOCK_N, BLOCK_K, DEFER_NORM, PRELOADED)
        elif phase == 1:
            _recurrence_phase(layer, pid, P, act_ptr, o_ptr, state_ptr, a_log_ptr, dt_bias_ptr, NH, DK, DV, BV)
        elif phase == 2:
            _gemv_phase(2, layer, pid, P, w_o_ptr, H, D, x_ptr, act_ptr, o_ptr, m_ptr, norm1_ptr, onorm_ptr, eps,
                        w_pre, w_up_pre, H, NH, DV, I, BLOCK_N, BLOCK_K, DEFER_NORM, PRELOADED)
        elif phase == 3:
            _gemv_phase(3, layer, pid, P, w_gu_ptr, 2 * I, H, x_ptr, act_ptr, o_ptr, m_ptr, norm2_ptr, onorm_ptr,
                        eps, w_pre, w_up_pre, H, NH, DV, I, BLOCK_N, BLOCK_K, DEFER_NORM, PRELOADED)
        else:
            _gemv_phase(4, layer, pid, P, w_down_ptr, H, I, x_ptr, act_ptr, o_ptr, m_ptr, norm1_ptr, onorm_ptr,
                        eps, w_pre, w_up_pre, H, NH, DV, I, BLOCK_N, BLOCK_K, DEFER_NORM, PRELOADED)
        if PERSISTENT:
            if PRELOAD:
                w_pre, w_up_pre = _next_first_tiles(step + 1, end, pid, P, w_qkvg_ptr, w_o_ptr, w_gu_ptr, w_down_ptr,
                                                    H, NH, DK, DV, I, BLOCK_N, BLOCK_K)
            _grid_sync(bar_ptr, (step - first_step + 1) * P)


def random_stack(layers: int, hidden: int, heads: int, head_dim: int, intermediate: int, device: str = "cpu",
                 seed: int = 0) -> dict:
    """Random bf16 weights (and fp32 norms, gates, states) of a GDN layer stack, the q/k/v/gate/a/b projections
    fused into one weight and the MLP's gate and up into another; scaled so 24 layers stay finite."""
    gen = torch.Generator().manual_seed(seed)
    d = heads * head_dim

    def rand(*shape, std=1.0, dtype=torch.float32):
        return (std * torch.randn(*shape, generator=gen)).to(dtype).to(device)

    return {
        "w_qkvg": rand(layers, 4 * d + 2 * heads, hidden, std=hidden ** -0.5, dtype=torch.bfloat16),
        "w_o": rand(layers, hidden, d, std=0.5 * d ** -0.5, dtype=torch.bfloat16),
        "w_gu": rand(layers, 2 * intermediate, hidden, std=hidden ** -0.5, dtype=torch.bfloat16),
        "w_down": rand(layers, hidden, intermediate, std=0.5 * intermediate ** -0.5, dtype=torch.bfloat16),
        "norm1": 1 + rand(layers, hidden, std=0.1), "norm2": 1 + rand(layers, hidden, std=0.1),
        "onorm": 1 + rand(layers, head_dim, std=0.1), "a_log": rand(layers, heads, std=0.5),
        "dt_bias": rand(layers, heads, std=0.5), "state": rand(layers, heads, head_dim, head_dim, std=0.1),
        "x": rand(hidden),
    }


def reference_stack(stack: dict, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's math in PyTorch (``dtype``): returns the residual and the states after every layer."""
    x, state = stack["x"].to(dtype), stack["state"].to(dtype).clone()
    layers, heads, dk, _ = state.shape
    d, inter = heads * dk, stack["w_down"].shape[-1]

    def rms(t, weight):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + EPS) * weight

    for layer in range(layers):
        p = {name: t[layer].to(dtype) for name, t in stack.items() if name not in ("x", "state")}
        act = p["w_qkvg"] @ rms(x, p["norm1"])
        q, k, v = (F.silu(act[i * d:(i + 1) * d]).view(heads, -1) for i in range(3))
        q = q * torch.rsqrt(q.pow(2).sum(-1, keepdim=True) + 1e-6) * dk ** -0.5
        k = k * torch.rsqrt(k.pow(2).sum(-1, keepdim=True) + 1e-6)
        g = -p["a_log"].exp() * F.softplus(act[4 * d:4 * d + heads] + p["dt_bias"])
        beta = torch.sigmoid(act[4 * d + heads:])
        s = state[layer] * g.exp()[:, None, None]
        u = beta[:, None] * (v - torch.einsum("hk,hkv->hv", k, s))
        s = s + k[:, :, None] * u[:, None, :]
        state[layer] = s
        o = rms(torch.einsum("hk,hkv->hv", q, s), p["onorm"]).flatten() * F.silu(act[3 * d:4 * d])
        x = x + p["w_o"] @ o
        gate_up = p["w_gu"] @ rms(x, p["norm2"])
        x = x + p["w_down"] @ (F.silu(gate_up[:inter]) * gate_up[inter:])
    return x, state


class LayerStack:
    """The kernel's buffers for one stack and its two launch schedules: :meth:`run_persistent` (one launch of
    ``programs`` programs) and :meth:`run_by_step` (five launches a layer)."""

    def __init__(self, stack: dict, block_n: int, block_k: int, warps: int, defer_norm: bool, preload: bool,
                 programs: int, bv: int = 16):
        self.stack = stack
        layers, self.heads, self.dk, self.dv = stack["state"].shape
        self.layers, self.hidden, self.inter = layers, stack["x"].numel(), stack["w_down"].shape[-1]
        if self.dk != self.dv:
            raise ValueError(f"the kernel lays q/k/v/gates out for head_dim keys and values alike, got {self.dk} and {self.dv}")
        for k in (self.hidden, self.heads * self.dk, self.inter):
            if k % block_k:
                raise ValueError(f"BLOCK_K={block_k} does not divide the GEMV depth {k}")
        device = stack["x"].device
        self.x, self.state = stack["x"].clone(), stack["state"].clone()
        self.act = torch.zeros(4 * self.heads * self.dk + 2 * self.heads, device=device)
        self.o = torch.zeros(self.heads * self.dv, device=device)
        self.m = torch.zeros(self.inter, device=device)
        self.barrier = torch.zeros(1, dtype=torch.int32, device=device)
        self.programs = programs
        self.meta = {"H": self.hidden, "NH": self.heads, "DK": self.dk, "DV": self.dv, "I": self.inter, "BLOCK_N": block_n,
                     "BLOCK_K": block_k, "BV": bv, "DEFER_NORM": defer_norm, "PRELOAD": preload, "num_warps": warps}

    def reset(self) -> None:
        self.x.copy_(self.stack["x"])
        self.state.copy_(self.stack["state"])

    def _args(self, first: int, count: int) -> tuple:
        s = self.stack
        return (self.x, self.act, self.o, self.m, self.state, s["w_qkvg"], s["w_o"], s["w_gu"], s["w_down"], s["norm1"],
                s["norm2"], s["onorm"], s["a_log"], s["dt_bias"], self.barrier, first, count, EPS)

    def _launch(self, first: int, count: int, persistent: bool) -> None:
        layer_stack_kernel[(self.programs,)](*self._args(first, count), PERSISTENT=persistent, **self.meta)

    def registers(self) -> dict:
        """Registers and spilled bytes of the persistent kernel, as timed (a step count of 1 would compile apart:
        Triton specializes an integer argument equal to 1)."""
        compiled = layer_stack_kernel.warmup(*self._args(0, PHASES * self.layers), PERSISTENT=True,
                                             grid=(self.programs,), **self.meta)
        compiled._init_handles()
        return {"regs": compiled.n_regs, "spills": compiled.n_spills}

    def run_persistent(self) -> None:
        self.barrier.zero_()
        self._launch(0, PHASES * self.layers, True)

    def run_by_step(self, phase: int | None = None) -> None:
        """Five launches a layer; or only ``phase``'s launches (to time one phase of every layer)."""
        for step in range(PHASES * self.layers):
            if phase is None or step % PHASES == phase:
                self._launch(step, 1, False)


GEMMS = ("w_qkvg", "w_o", "w_gu", "w_down")


def cublas_gemms(stack: dict, names: tuple[str, ...] = GEMMS) -> callable:
    """The pass's GEMMs (of the weights ``names``) as today's pass runs them: cuBLAS, one row, bf16, nothing
    between them."""
    inputs = {name: torch.zeros(1, stack[name].shape[-1], dtype=torch.bfloat16, device=stack["x"].device) for name in names}

    def run():
        for layer in range(stack["w_qkvg"].shape[0]):
            for name in names:
                F.linear(inputs[name], stack[name][layer])

    return run


def weight_bytes(stack: dict) -> int:
    return sum(stack[name].numel() * stack[name].element_size() for name in GEMMS)


def check(engine: LayerStack, reference: tuple[torch.Tensor, torch.Tensor], how: str) -> float:
    """Relative error of one run of the stack against the float64 reference."""
    engine.reset()
    getattr(engine, f"run_{how}")()
    torch.cuda.synchronize()
    x_ref, state_ref = reference
    return max(((engine.x.double() - x_ref).norm() / x_ref.norm()).item(),
               ((engine.state.double() - state_ref).norm() / state_ref.norm()).item())


def write_report(results: dict, out_dir: str) -> None:
    lines = save_results(results, out_dir, "persistent_gpu", "One persistent kernel for the GDN-1.3B layer stack",
                         f"; {results['layers']} layers, bf16 weights ({results['weight_MB']:.0f} MB), fp32 states, "
                         "one row, one CUDA graph per schedule, median replay")
    by_weight = ", ".join(f"{name[2:]} {ms:.3f}" for name, ms in results.get("cublas_ms_by_weight", {}).items())
    lines += [(f"- cuBLAS's GEMMs alone (96 launches): **{results['cublas_ms']:.3f} ms** "
               f"({results['weight_MB'] / results['cublas_ms'] / 1000:.2f} TB/s); each weight's 24 alone, ms: {by_weight}"), "",
              ("| BLOCK_N | BLOCK_K | warps | deferred norm | preload | programs | registers (spills) | one launch a step, ms "
               "| TB/s | persistent ms | TB/s | rel. error | persistent - by step, max | each phase alone, ms |"),
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for row in results["configs"]:
        config = " | ".join(str(v) for v in row["config"])
        if isinstance(row["error"], str):
            lines.append(f"| {config} | - | - | - | - | - | {row['error']} | - | - |")
            continue
        if "persistent_ms" in row:
            persistent = f"{row['persistent_ms']:.3f} | {results['weight_MB'] / row['persistent_ms'] / 1000:.2f}"
            diff = f"{row['max_diff_by_step']:.1e}"
        else:
            persistent, diff = "not run (more programs than SMs) | -", "-"
        phases = " / ".join(f"{ms:.3f}" for ms in row["phase_ms"])
        lines.append(f"| {config} | {row['regs']} ({row['spills']}) | {row['by_step_ms']:.3f} | "
                     f"{results['weight_MB'] / row['by_step_ms'] / 1000:.2f} | {persistent} | {row['error']:.1e} | {diff} | "
                     f"{phases} |")
    lines += ["", ("Each phase alone: its 24 launches in one graph (0: norm + q/k/v/gate/a/b GEMV, 1: recurrence, 2: gated "
                   "norm + o_proj, 3: norm + gate/up, 4: down).")]
    with open(os.path.join(out_dir, "persistent_gpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--plot", metavar="JSON", help="only write the markdown from an earlier JSON")
    parser.add_argument("--layers", type=int, default=GDN_1P3B["layers"])
    parser.add_argument("--programs-per-sm", type=int, nargs="+", default=[1, 2],
                        help="grid = SMs x this (the persistent launch only at 1: a grid barrier needs every program running)")
    args = parser.parse_args()
    results = start_run(parser, args, write_report)
    if results is None:
        return
    started = time.perf_counter()
    stack = random_stack(**{**GDN_1P3B, "layers": args.layers}, device="cuda")
    reference = tuple(t.cuda() for t in reference_stack({name: t.cpu() for name, t in stack.items()}))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    results.update(layers=args.layers, weight_MB=weight_bytes(stack) / 1e6, sms=sms, configs=[])
    results["cublas_ms"] = graph_ms(cublas_gemms(stack))
    results["cublas_ms_by_weight"] = {name: graph_ms(cublas_gemms(stack, (name,))) for name in GEMMS}
    print(f"cuBLAS GEMMs {results['cublas_ms']:.3f} ms", flush=True)
    for per_sm in args.programs_per_sm:
        for config in CONFIGS:
            row = {"config": [*config, sms * per_sm]}
            try:
                engine = LayerStack(stack, *config, programs=sms * per_sm)
                row["error"] = check(engine, reference, "by_step")
                by_step = engine.x.clone()
                row.update(engine.registers())
                if per_sm == 1:  # (more programs than SMs need not all run at once: a barrier could wait forever)
                    row["error"] = max(row["error"], check(engine, reference, "persistent"))
                    row["max_diff_by_step"] = (by_step - engine.x).abs().max().item()  # (the two compile apart)
                    # (timed without a reset inside: copying the states back is no part of a pass)
                    row["persistent_ms"] = graph_ms(engine.run_persistent, 10)
                row["by_step_ms"] = graph_ms(engine.run_by_step, 10)
                row["phase_ms"] = [graph_ms(functools.partial(engine.run_by_step, phase), 10) for phase in range(PHASES)]
            except triton.runtime.errors.OutOfResources as err:
                row["error"] = str(err)[:80]
            results["configs"].append(row)
            print(json.dumps(row), f"{time.perf_counter() - started:.0f} s", flush=True)
            write_report(results, args.out)


if __name__ == "__main__":
    main()
