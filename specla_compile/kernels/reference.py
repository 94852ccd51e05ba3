"""Pure-PyTorch references of every verify / commit / conv / top-k op (any device, fp32 or fp64).

These are the test oracles and the CPU implementation of the custom ops. Shapes (DESIGN.md):
``q, k [B, N, H, K]``, ``v [B, N, HV, V]``, ``g, beta [B, N, HV]``, ``parents [B, N]``,
``state [B, HV, K, V]``; value head ``h`` reads query/key head ``h // (HV // H)``.
Computation runs in float64 when any input is float64, else in float32; outputs ``o`` take ``v``'s dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..tree import ancestor_mask, gather_nodes

L2NORM_EPS = 1e-6  # fla's and transformers' l2norm epsilon


class FactorRecords(NamedTuple):
    """Per-node factors ``(k, v, g, beta)`` that replay a node's state update; ``k`` is already
    L2-normalized when the model normalizes it, so a commit needs nothing else. ``[B, N, ...]``."""

    k: torch.Tensor  # [B, N, H, K]
    v: torch.Tensor  # [B, N, HV, V]
    g: torch.Tensor  # [B, N, HV]
    beta: torch.Tensor  # [B, N, HV]

    def select(self, index: torch.Tensor) -> FactorRecords:
        """Gather nodes ``index [B, A]`` of every row (the accepted path)."""
        return FactorRecords(*(gather_nodes(t, index) for t in self))


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2NORM_EPS)


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def check_gdn_shapes(q, k, v, g, beta, parents, state) -> None:
    """Raise ``ValueError`` unless the shapes follow the contract in the module docstring."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, N, H, K], got {tuple(q.shape)} and {tuple(k.shape)}")
    batch, n, heads, dk = q.shape
    if v.dim() != 4 or v.shape[:2] != (batch, n):
        raise ValueError(f"v must be [B, N, HV, V] with B={batch}, N={n}, got {tuple(v.shape)}")
    hv = v.shape[2]
    if hv % heads:
        raise ValueError(f"value heads ({hv}) must be a multiple of query/key heads ({heads})")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (batch, n, hv):
            raise ValueError(f"{name} must be [B, N, HV] = {(batch, n, hv)}, got {tuple(t.shape)}")
    if parents is not None and parents.shape != (batch, n):
        raise ValueError(f"parents must be [B, N] = {(batch, n)}, got {tuple(parents.shape)}")
    if state is not None and state.shape != (batch, hv, dk, v.shape[3]):
        raise ValueError(f"state must be [B, HV, K, V] = {(batch, hv, dk, v.shape[3])}, got {tuple(state.shape)}")


def _heads_to_value_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[B, N, H, D] -> [B, N, HV, D]: each query/key head serves HV // H consecutive value heads."""
    return x.repeat_interleave(hv // x.shape[2], dim=2)


def _prepare(q, k, v, g, beta, parents, state, scale, use_qk_l2norm):
    check_gdn_shapes(q, k, v, g, beta, parents, state)
    dtype = compute_dtype(q, k, v, state)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    batch, _, hv, dv = v.shape
    if state is None:
        state = torch.zeros(batch, hv, q.shape[-1], dv, dtype=dtype, device=v.device)
    return q, k, v, g, beta, state.to(dtype), scale


def _step(state: torch.Tensor, k, v, g, beta) -> torch.Tensor:
    """One recurrence step for every row/head: S' = alpha S + k (beta (v - (alpha S)^T k))^T."""
    state = state * g.exp()[..., None, None]
    delta = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", state, k))
    return state + k[..., :, None] * delta[..., None, :]


def gdn_tree_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    initial_state: torch.Tensor | None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequential recurrence along parents (the oracle). Returns ``o [B, N, HV, V]`` and every
    node's state ``[B, N, HV, K, V]``."""
    out_dtype = v.dtype
    q, k, v, g, beta, state0, scale = _prepare(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm)
    hv = v.shape[2]
    q, k = _heads_to_value_heads(q, hv), _heads_to_value_heads(k, hv)
    batch, n = parents.shape
    rows = torch.arange(batch, device=v.device)
    states = state0.new_empty(batch, n, *state0.shape[1:])
    for j in range(n):
        p = parents[:, j]
        prev = torch.where((p >= 0)[:, None, None, None], states[rows, p.clamp(min=0)], state0)
        states[:, j] = _step(prev, k[:, j], v[:, j], g[:, j], beta[:, j])
    o = scale * torch.einsum("bnhkv,bnhk->bnhv", states, q)
    return o.to(out_dtype), states


def gdn_chain_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain (chain) recurrence over the sequence keeping only the running state: ``(o, final_state)``.
    What a model's own GDN call computes; memory does not grow with the sequence length."""
    out_dtype = v.dtype
    batch, n = q.shape[:2]
    chain = torch.arange(-1, n - 1, device=q.device).expand(batch, n)
    q, k, v, g, beta, state, scale = _prepare(q, k, v, g, beta, chain, initial_state, scale, use_qk_l2norm)
    hv = v.shape[2]
    q, k = _heads_to_value_heads(q, hv), _heads_to_value_heads(k, hv)
    o = v.new_empty(v.shape)
    for j in range(n):
        state = _step(state, k[:, j], v[:, j], g[:, j], beta[:, j])
        o[:, j] = scale * torch.einsum("bhkv,bhk->bhv", state, q[:, j])
    return o.to(out_dtype), state


def path_log_decay(g: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """gamma[b, j, h]: the sum of g over the root-to-j path, ``[B, N, HV]``."""
    gamma = torch.empty_like(g)
    rows = torch.arange(g.shape[0], device=g.device)
    for j in range(g.shape[1]):
        p = parents[:, j]
        gamma[:, j] = g[:, j] + torch.where((p >= 0)[:, None], gamma[rows, p.clamp(min=0)], 0)
    return gamma


def gdn_tree_factorized(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    initial_state: torch.Tensor | None,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, FactorRecords]:
    """Tree-masked UT form of DESIGN.md: the same outputs as :func:`gdn_tree_reference` without any
    per-node state, plus the per-node factor records."""
    out_dtype = v.dtype
    q, k, v, g, beta, state0, scale = _prepare(q, k, v, g, beta, parents, initial_state, scale, use_qk_l2norm)
    records = FactorRecords(k, v, g, beta)
    hv = v.shape[2]
    # heads first: [B, HV, N, D]
    qh, kh = (_heads_to_value_heads(t, hv).transpose(1, 2) for t in (q, k))
    vh = v.transpose(1, 2)
    gamma = path_log_decay(g, parents).transpose(1, 2)  # [B, HV, N]
    bh = beta.transpose(1, 2)
    strict = ancestor_mask(parents)[:, None]  # [B, 1, N, N]
    inclusive = ancestor_mask(parents, inclusive=True)[:, None]
    log_decay = gamma[..., :, None] - gamma[..., None, :]
    decay_strict = torch.where(strict, log_decay, -torch.inf).exp()
    decay_incl = torch.where(inclusive, log_decay, -torch.inf).exp()
    a = bh[..., None] * decay_strict * (kh @ kh.transpose(-1, -2))
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    t = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    w = t @ ((bh * gamma.exp())[..., None] * kh)
    u = t @ (bh[..., None] * vh) - w @ state0
    attn = scale * decay_incl * (qh @ kh.transpose(-1, -2))
    o = scale * (gamma.exp()[..., None] * qh) @ state0 + attn @ u
    return o.transpose(1, 2).to(out_dtype).contiguous(), records


def gdn_commit_reference(state: torch.Tensor, records: FactorRecords, num_accepted: torch.Tensor) -> torch.Tensor:
    """Apply the first ``num_accepted[b]`` records of each row to ``state`` in order; returns the new
    state (input untouched). Records use normalized keys (see :class:`FactorRecords`)."""
    dtype = compute_dtype(state, *records)
    k, v, g, beta = (t.to(dtype) for t in records)
    k = _heads_to_value_heads(k, v.shape[2])
    new = state.to(dtype)
    for i in range(k.shape[1]):
        take = (num_accepted > i)[:, None, None, None]
        new = torch.where(take, _step(new, k[:, i], v[:, i], g[:, i], beta[:, i]), new)
    return new.to(state.dtype)


def gdn_gates_reference(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A GDN layer's gates from its projections (fla's and transformers' form): ``g = -exp(A_log) * softplus(a +
    dt_bias)``, ``beta = sigmoid(b)``, each ``[B, N, HV]``, in float32 (float64 for float64 inputs)."""
    work = compute_dtype(a, b, a_log, dt_bias)
    g = -a_log.to(work).exp() * torch.nn.functional.softplus(a.to(work) + dt_bias.to(work))
    return g, b.to(work).sigmoid()


def gdn_commit_verify_reference(
    state: torch.Tensor,
    pending: FactorRecords,
    num_pending: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[torch.Tensor, FactorRecords, torch.Tensor]:
    """Delayed update: commit the pending records, then verify the new tree from the advanced state.
    Returns ``(o, records, new_state)``."""
    new_state = gdn_commit_reference(state, pending, num_pending)
    o, records = gdn_tree_factorized(q, k, v, g, beta, parents, new_state, scale=scale, use_qk_l2norm=use_qk_l2norm)
    return o, records, new_state


def check_conv_shapes(x, conv_state, weight, parents=None) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [B, N, D], got {tuple(x.shape)}")
    batch, n, d = x.shape
    if weight.dim() != 2 or weight.shape[0] != d:
        raise ValueError(f"weight must be [D, W] with D={d}, got {tuple(weight.shape)}")
    if conv_state.dim() != 3 or conv_state.shape[:2] != (batch, d) or conv_state.shape[2] < weight.shape[1] - 1:
        raise ValueError(f"conv_state must be [B, D, S] with S >= W - 1 = {weight.shape[1] - 1}, got {tuple(conv_state.shape)}")
    if parents is not None and parents.shape != (batch, n):
        raise ValueError(f"parents must be [B, N] = {(batch, n)}, got {tuple(parents.shape)}")


def tree_conv_reference(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    parents: torch.Tensor,
    *,
    silu: bool = True,
) -> torch.Tensor:
    """Depthwise causal conv over a tree: node j's window is its W-1 nearest ancestors' inputs and its
    own, continuing into the last columns of ``conv_state [B, D, S]`` past the root.
    ``x [B, N, D]``, ``weight [D, W]`` (last tap = current input). Returns ``[B, N, D]`` in x's dtype."""
    check_conv_shapes(x, conv_state, weight, parents)
    dtype = compute_dtype(x, conv_state, weight)
    width = weight.shape[1]
    xs = x.to(dtype)
    root_window = conv_state.to(dtype)[..., conv_state.shape[-1] - (width - 1) :]  # [B, D, W-1]
    rows = torch.arange(x.shape[0], device=x.device)
    windows = xs.new_empty(*x.shape, width)  # [B, N, D, W]
    for j in range(x.shape[1]):
        p = parents[:, j]
        history = torch.where((p >= 0)[:, None, None], windows[rows, p.clamp(min=0), :, 1:], root_window)
        windows[:, j] = torch.cat([history, xs[:, j, :, None]], dim=-1)
    y = (windows * weight.to(dtype)).sum(-1)
    if bias is not None:
        y = y + bias.to(dtype)
    if silu:
        y = torch.nn.functional.silu(y)
    return y.to(x.dtype)


def conv_state_commit_reference(conv_state: torch.Tensor, x: torch.Tensor, num_accepted: torch.Tensor) -> torch.Tensor:
    """New conv state: the last S columns of (old conv state ++ the first ``num_accepted[b]`` inputs
    of ``x [B, A, D]``), per row."""
    width = conv_state.shape[-1]
    full = torch.cat([conv_state, x.transpose(1, 2).to(conv_state.dtype)], dim=-1)  # [B, D, S + A]
    cols = num_accepted.long()[:, None] + torch.arange(width, device=x.device)  # [B, S]
    return full.gather(2, cols[:, None, :].expand(-1, full.shape[1], -1))


def causal_conv_reference(
    x: torch.Tensor, conv_state: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None, *, silu: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain causal depthwise conv over a sequence continuing from ``conv_state [B, D, S]`` (zeros when
    None, with S = W): ``(y [B, T, D], new_state [B, D, S])``, new_state = the last S inputs."""
    batch, n, d = x.shape
    width = weight.shape[1]
    if conv_state is None:
        conv_state = x.new_zeros(batch, d, width)
    check_conv_shapes(x, conv_state, weight)
    full = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [B, D, S + T]
    y = torch.nn.functional.conv1d(full[..., full.shape[-1] - n - (width - 1) :], weight[:, None].to(x.dtype), bias, groups=d)
    if silu:
        y = torch.nn.functional.silu(y)
    # custom-op outputs must be contiguous like their fake implementations
    return y.transpose(1, 2).contiguous(), full[..., n:].to(conv_state.dtype).contiguous()



def vocab_top_k_reference(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest log-probabilities of each row of ``scores [N, V]`` and their token ids, best first,
    ties to the lower id: ``(log_probs [N, k] fp32, ids [N, k] int64)`` (a draft's ranking: fp32 suffices)."""
    log_probs = torch.log_softmax(scores.float(), dim=-1)
    values, ids = log_probs.sort(dim=-1, descending=True, stable=True)
    return values[:, :k].contiguous(), ids[:, :k].contiguous()


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-only int8 of ``weight [N, K]``, symmetric per output row: ``(data [N, K] int8, scale [N] fp32)`` with
    ``weight ~ data * scale[:, None]`` (each row's largest magnitude at 127)."""
    wide = weight.detach().float()
    scale = (wide.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return (wide / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias``, where with ``weight_scale [N]`` an int8 ``weight`` stands for ``weight *
    weight_scale[:, None]`` (:func:`quantize_rows`). fp32 and fp64 rows: the integers times x in their dtype, then each
    column scaled, rounded once as the kernels do. Half-precision rows (the paths that fall back here, e.g. a prompt's
    catch-up of more rows than the kernels take): the weight dequantized in their dtype, a copy of half an fp32 one's
    bytes (the integers' own sums could overflow fp16)."""
    if weight_scale is None:
        return torch.nn.functional.linear(x, weight, bias)
    if x.dtype in (torch.float16, torch.bfloat16):
        return torch.nn.functional.linear(x, weight.to(x.dtype) * weight_scale.to(x.dtype)[:, None], bias)
    y = torch.nn.functional.linear(x, weight.to(x.dtype)) * weight_scale.to(x.dtype)
    return y if bias is None else y + bias


def linear_top_k_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int,
                           weight_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`vocab_top_k_reference` of the scores ``x [N, K] @ weight [V, K]^T + bias`` (in x's dtype; an int8
    weight with its ``weight_scale``, :func:`scaled_linear`)."""
    return vocab_top_k_reference(scaled_linear(x, weight, weight_scale, bias), k)


def gather_paths_reference(srcs: list[torch.Tensor], index: torch.Tensor) -> list[torch.Tensor]:
    """Each ``srcs[i] [B, N, ...]`` along ``index [B, A]``: ``out[b, a] = src[b, index[b, a]]`` (-1 entries
    read node 0), one gather per tensor: a tree's accepted path of every fresh factor record."""
    return [gather_nodes(src, index) for src in srcs]


def check_draft_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``q [R, H, S, d]``, ``keys, values [R, H, T, d]`` (one dtype) and a bool
    ``mask [R or 1, S, T]`` fit together."""
    rows, heads, queries, dim = q.shape
    columns = keys.shape[2]
    if (mask.dtype != torch.bool or not q.dtype == keys.dtype == values.dtype
            or keys.shape != (rows, heads, columns, dim) or values.shape != keys.shape
            or mask.dim() != 3 or mask.shape[0] not in (1, rows) or mask.shape[1:] != (queries, columns)):
        raise ValueError(f"draft_attention: cannot attend q {tuple(q.shape)} {q.dtype} over keys {tuple(keys.shape)} "
                         f"{keys.dtype}, values {tuple(values.shape)} {values.dtype} under mask {tuple(mask.shape)} "
                         f"{mask.dtype} (a bool mask, one dtype for the rest)")


def draft_attention_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                              scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` over the keys each query may see: ``q [R, H, S, d]``, ``keys, values
    [R, H, T, d]``, ``mask [R or 1, S, T]`` (True = may attend); a query that sees no key gets zeros.
    Computed in float64 for float64 inputs, else float32; returns ``q``'s dtype."""
    check_draft_attention(q, keys, values, mask)
    work = compute_dtype(q, keys, values)
    scores = torch.einsum("rhsd,rhtd->rhst", q.to(work), keys.to(work)) * scale
    weights = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), dim=-1).nan_to_num(0.0)
    return torch.einsum("rhst,rhtd->rhsd", weights, values.to(work)).to(q.dtype)


def linear_add_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                         residual_rows: torch.Tensor | None, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight^T + bias + residual`` over the last dimension; with ``residual_rows`` (indices shaped as
    ``x``'s leading dimensions), ``residual`` is a table whose rows they pick (an int8 weight with its
    ``weight_scale``: :func:`scaled_linear`)."""
    return scaled_linear(x, weight, weight_scale, bias) + (residual if residual_rows is None else residual[residual_rows])


def norm_linear_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                          weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``rms_norm(x) @ weight^T`` (the norm scaled by ``norm_weight``, as ``nn.RMSNorm``; an int8 weight with its
    ``weight_scale``, :func:`scaled_linear`)."""
    return scaled_linear(torch.nn.functional.rms_norm(x, (x.shape[-1],), norm_weight, eps), weight, weight_scale)


def gated_linear_reference(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up``, where ``[gate, up]`` are the two halves of ``x @ weight^T`` (an MLP's packed gate/up; an
    int8 weight with its ``weight_scale``, :func:`scaled_linear`)."""
    gate, up = scaled_linear(x, weight, weight_scale).chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def norm_gated_linear_reference(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                                weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``gated_linear_reference`` of ``rms_norm(x)`` (as ``norm_linear_reference``)."""
    return gated_linear_reference(torch.nn.functional.rms_norm(x, (x.shape[-1],), norm_weight, eps), weight, weight_scale)


def rms_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fla's ``RMSNorm`` of ``x`` (plus ``residual``, summed unrounded, as fla's fused prenorm):
    ``h * rsqrt(mean(h^2) + eps) * weight`` over the last dimension in float32 (float64 for float64 inputs),
    rounded once to ``x``'s dtype."""
    work = compute_dtype(x, residual, weight)
    wide = x.to(work) if residual is None else x.to(work) + residual.to(work)
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps) * weight.to(work)).to(x.dtype)


def rms_norm_gated_reference(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fla's ``FusedRMSNormGated`` with its SiLU gate and no bias: ``x * rsqrt(mean(x^2) + eps) * weight * silu(gate)``
    over the last dimension (a head's values) in float32 (float64 for float64 inputs), rounded once to ``x``'s dtype."""
    work = compute_dtype(x, gate, weight)
    wide = x.to(work)
    normed = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps) * weight.to(work)
    return (normed * torch.nn.functional.silu(gate.to(work))).to(x.dtype)


def gated_norm_linear_reference(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                weight: torch.Tensor) -> torch.Tensor:
    """``rms_norm_gated(x, gate)`` of ``[..., H, D]`` heads, flattened to ``[..., H * D]``, then ``@ weight^T``: a GDN
    layer's output norm and o_proj."""
    return torch.nn.functional.linear(rms_norm_gated_reference(x, gate, norm_weight, eps).flatten(-2), weight)


def swiglu_linear_reference(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up @ weight^T``, where ``[gate, up]`` are the two halves of ``gate_up`` (an MLP's packed gate/up
    output and its down projection); the product in float32 (float64 for float64 inputs), rounded to ``gate_up``'s
    dtype as inductor's kernel of it writes it."""
    work = compute_dtype(gate_up, weight)
    gate, up = gate_up.to(work).chunk(2, dim=-1)
    return torch.nn.functional.linear((torch.nn.functional.silu(gate) * up).to(gate_up.dtype), weight)


def check_skip(x: torch.Tensor, skip: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``skip`` has ``x``'s shape and dtype (the add before a folded norm)."""
    if skip.shape != x.shape or skip.dtype != x.dtype:
        raise ValueError(f"add_norm_linear: the skip must have the rows' shape {tuple(x.shape)} and dtype {x.dtype}, "
                         f"got {tuple(skip.shape)} {skip.dtype}")


def add_norm_linear_reference(x: torch.Tensor, skip: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                              weight: torch.Tensor, gated: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm_linear_reference(x + skip), x + skip)`` (``norm_gated_linear_reference`` when ``gated``): a
    residual stream's add, the norm after it and the GEMM after that; the sum rounds to ``x``'s dtype."""
    check_skip(x, skip)
    summed = x + skip
    project = norm_gated_linear_reference if gated else norm_linear_reference
    return project(summed, norm_weight, eps, weight), summed


def add_norm_row_gemv_reference(x: torch.Tensor, skip: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                                weight: torch.Tensor, round_sum: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + skip) @ weight^T, x + skip)``, the sum rounded to ``x``'s dtype; the norm reads the sum as fla's
    fused prenorm does (in float32, unrounded) or, with ``round_sum``, rounded (an add, then a norm of its output)."""
    check_skip(x, skip)
    summed = x + skip
    normed = rms_norm_reference(summed, None, norm_weight, eps) if round_sum else rms_norm_reference(x, skip, norm_weight, eps)
    return torch.nn.functional.linear(normed, weight), summed

