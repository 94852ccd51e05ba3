"""``torch.library`` custom ops that compiled graphs call, with fake (meta) implementations.

Each op's body is its PyTorch reference (:mod:`.reference`), which CPUs run; on CUDA, :mod:`.cuda` registers
Triton kernels over the same ops (``register_kernel("cuda")``), so a compiled graph calls one op either way.
The verification twins call :func:`gdn_commit_verify_` (the rewrite puts it in place of each recurrence,
``lowering/rewrite.py``); :func:`gdn_tree_verify` is the same verify without pending records. Records (see
:class:`~specla_compile.kernels.reference.FactorRecords`) travel as four tensors ``(k, v, g, beta)``; the verify ops
emit the normalized keys ``k_hat`` and the graph supplies ``v, g, beta`` itself. Commits mutate the durable state in place.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import reference as ref


def _own_copy(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A fresh contiguous tensor: custom-op outputs must never alias their inputs."""
    return t.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)


# The conv kernels (and gdn_gates_commit_verify_'s gates) read their inputs at any strides (a slice of a fused
# projection's output, or a transposed input, where it lies), so inductor need not copy them to the strides they
# were traced with. With its default (exact strides)
# it did on the H200 (3 copy kernels per layer of a 16-node pass, profiled), most likely because it pads
# the rows of the fused q/k/v/g/a/b GEMM's output on GPUs (8208 columns at the 1.3B shape, not a
# multiple of 128 bytes); its CPU output code, unpadded, passes the slices as they are.
_ANY_INPUT_STRIDES = (torch.Tag.flexible_layout,)


# --- plain (undrafted) calls: what a captured model runs outside verification ----------------------


@torch.library.custom_op("specla::gdn_recurrence", mutates_args=())
def gdn_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A model's own GDN call over a sequence: ``(o [B, T, HV, V], final_state [B, HV, K, V])``."""
    if q.is_cuda:
        from .fla_routes import fla_recurrence  # fla kernels only run on GPUs

        return fla_recurrence(q, k, v, g, beta, state, scale, use_qk_l2norm)
    o, final = ref.gdn_chain_reference(q, k, v, g, beta, state, scale=scale, use_qk_l2norm=use_qk_l2norm)
    return o, final.to(state.dtype)


@gdn_recurrence.register_fake
def _(q, k, v, g, beta, state, scale, use_qk_l2norm):
    ref.check_gdn_shapes(q, k, v, g, beta, None, state)
    return v.new_empty(v.shape), state.new_empty(state.shape)


@torch.library.custom_op("specla::short_conv", mutates_args=())
def short_conv(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A model's own short conv over a sequence ``x [B, T, D]`` from ``conv_state [B, D, S]``:
    ``(y [B, T, D], new_state [B, D, S])``."""
    return ref.causal_conv_reference(x, conv_state, weight, bias, silu=silu)


@short_conv.register_fake
def _(x, conv_state, weight, bias, silu):
    ref.check_conv_shapes(x, conv_state, weight)
    return x.new_empty(x.shape), conv_state.new_empty(conv_state.shape)


@torch.library.custom_op("specla::causal_conv1d", mutates_args=())
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """Causal depthwise conv over a channel-first window ``x [B, D, L]`` with zero left padding (the
    transformers convention, where ``x`` already starts with the cached conv state)."""
    width = weight.shape[-1]
    y = torch.nn.functional.conv1d(x.to(weight.dtype), weight[:, None], bias, padding=width - 1, groups=x.shape[1])
    y = y[..., : x.shape[-1]]
    return (torch.nn.functional.silu(y) if silu else y).to(x.dtype).contiguous()


@causal_conv1d.register_fake
def _(x, weight, bias, silu):
    return x.new_empty(x.shape)


# --- recurrent state ------------------------------------------------------------------------------


@torch.library.custom_op("specla::gdn_tree_verify", mutates_args=())
def gdn_tree_verify(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify a tree from ``state``: returns ``o [B, N, HV, V]`` and normalized keys ``k_hat [B, N, H, K]`` (no
    pending records: the twins call :func:`gdn_commit_verify_`; tests and benchmarks call this)."""
    o, records = ref.gdn_tree_factorized(q, k, v, g, beta, parents, state, scale=scale, use_qk_l2norm=use_qk_l2norm)
    return o, _own_copy(records.k, state.dtype)


@gdn_tree_verify.register_fake
def _(q, k, v, g, beta, parents, state, scale, use_qk_l2norm):
    ref.check_gdn_shapes(q, k, v, g, beta, parents, state)
    return v.new_empty(v.shape), k.new_empty(k.shape, dtype=state.dtype)


@torch.library.custom_op("specla::gdn_commit_", mutates_args=("state",))
def gdn_commit_(
    state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, num_accepted: torch.Tensor
) -> None:
    """Apply each row's first ``num_accepted[b]`` records to the durable ``state`` in place."""
    state.copy_(ref.gdn_commit_reference(state, ref.FactorRecords(k, v, g, beta), num_accepted))


@gdn_commit_.register_fake
def _(state, k, v, g, beta, num_accepted):
    return None


@torch.library.custom_op("specla::gdn_commit_verify_", mutates_args=("state",))
def gdn_commit_verify_(
    state: torch.Tensor,
    pending_k: torch.Tensor,
    pending_v: torch.Tensor,
    pending_g: torch.Tensor,
    pending_beta: torch.Tensor,
    num_pending: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    parents: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Delayed update then verify: commit the pending records into ``state`` in place, then verify the
    new tree from it. Returns ``(o, k_hat)`` like :func:`gdn_tree_verify`."""
    return _commit_verify(state, ref.FactorRecords(pending_k, pending_v, pending_g, pending_beta), num_pending,
                          q, k, v, g, beta, parents, scale, use_qk_l2norm)


def _commit_verify(state, pending, num_pending, q, k, v, g, beta, parents, scale, use_qk_l2norm) -> tuple[torch.Tensor, torch.Tensor]:
    o, records, new_state = ref.gdn_commit_verify_reference(
        state, pending, num_pending, q, k, v, g, beta, parents, scale=scale, use_qk_l2norm=use_qk_l2norm
    )
    state.copy_(new_state)
    return o, _own_copy(records.k, state.dtype)


@gdn_commit_verify_.register_fake
def _(state, pending_k, pending_v, pending_g, pending_beta, num_pending, q, k, v, g, beta, parents, scale, use_qk_l2norm):
    ref.check_gdn_shapes(q, k, v, g, beta, parents, state)
    return v.new_empty(v.shape), k.new_empty(k.shape, dtype=state.dtype)


@torch.library.custom_op("specla::gdn_gates_commit_verify_", mutates_args=("state",), tags=_ANY_INPUT_STRIDES)
def gdn_gates_commit_verify_(
    state: torch.Tensor,
    pending_k: torch.Tensor,
    pending_v: torch.Tensor,
    pending_g: torch.Tensor,
    pending_beta: torch.Tensor,
    num_pending: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    parents: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gdn_commit_verify_` that first computes the gates from their projections ``a, b [B, N, HV]`` and the
    layer's ``A_log, dt_bias [HV]`` (``reference.gdn_gates_reference``; on GPUs inside the recurrence's launch for a
    one-node pass). Returns ``(o, k_hat, g, beta)``: the gates are the pass's records too."""
    g, beta = ref.gdn_gates_reference(a, b, a_log, dt_bias)
    o, k_hat = _commit_verify(state, ref.FactorRecords(pending_k, pending_v, pending_g, pending_beta), num_pending,
                              q, k, v, g, beta, parents, scale, use_qk_l2norm)
    return o, k_hat, g, beta


def _gates_verify_fake(state, q, k, v, a, b, a_log, dt_bias, parents) -> tuple[torch.Tensor, ...]:
    ref.check_gdn_shapes(q, k, v, a, b, parents, state)
    if a_log.shape != (a.shape[-1],) or dt_bias.shape != a_log.shape:
        raise ValueError(f"A_log and dt_bias must be [HV] = [{a.shape[-1]}], got {tuple(a_log.shape)} and {tuple(dt_bias.shape)}")
    gates = a.new_empty(a.shape, dtype=ref.compute_dtype(a, b, a_log, dt_bias))
    return v.new_empty(v.shape), k.new_empty(k.shape, dtype=state.dtype), gates, gates.new_empty(gates.shape)


@gdn_gates_commit_verify_.register_fake
def _(state, pending_k, pending_v, pending_g, pending_beta, num_pending, q, k, v, a, b, a_log, dt_bias, parents, scale,
      use_qk_l2norm):
    return _gates_verify_fake(state, q, k, v, a, b, a_log, dt_bias, parents)


# --- short convolution ----------------------------------------------------------------------------


@torch.library.custom_op("specla::commit_tree_conv_", mutates_args=("conv_state",), tags=_ANY_INPUT_STRIDES)
def commit_tree_conv_(
    conv_state: torch.Tensor,
    pending_x: torch.Tensor,
    num_pending: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    parents: torch.Tensor,
    silu: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Delayed update then tree conv, one launch on GPUs: shift each row's first ``num_pending[b]``
    inputs of ``pending_x [B, A, D]`` into ``conv_state`` in place, then :func:`tree_conv` from it.
    Returns the conv's output and a contiguous copy of ``x`` (the pass's factor record of this conv:
    ``x`` may be a strided slice of a fused projection, which copies slowly when the record is kept)."""
    return _commit_then_tree_conv(conv_state, pending_x, num_pending, x, weight, bias, parents, silu)


def _commit_then_tree_conv(conv_state, pending_x, num_pending, x, weight, bias, parents, silu) -> tuple[torch.Tensor, torch.Tensor]:
    conv_state.copy_(ref.conv_state_commit_reference(conv_state, pending_x, num_pending))
    return ref.tree_conv_reference(x, conv_state, weight, bias, parents, silu=silu), _own_copy(x, x.dtype)


@commit_tree_conv_.register_fake
def _(conv_state, pending_x, num_pending, x, weight, bias, parents, silu):
    ref.check_conv_shapes(x, conv_state, weight, parents)
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("specla::commit_three_tree_convs_", mutates_args=("state0", "state1", "state2"),
                         tags=_ANY_INPUT_STRIDES)
def commit_three_tree_convs_(
    state0: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor,
    pending0: torch.Tensor, pending1: torch.Tensor, pending2: torch.Tensor,
    num_pending: torch.Tensor,
    x0: torch.Tensor, x1: torch.Tensor, x2: torch.Tensor,
    weight0: torch.Tensor, weight1: torch.Tensor, weight2: torch.Tensor,
    parents: torch.Tensor,
    silu: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three bias-free :func:`commit_tree_conv_` calls (fla's q, k and v convs), one launch on GPUs:
    the three outputs, then the three copies of the inputs."""
    return three_convs_outputs(
        _commit_then_tree_conv(state, pending, num_pending, x, weight, None, parents, silu)
        for state, pending, x, weight in zip((state0, state1, state2), (pending0, pending1, pending2), (x0, x1, x2),
                                             (weight0, weight1, weight2))
    )


def three_convs_outputs(per_conv) -> tuple[torch.Tensor, ...]:
    """``(y, x copy)`` of each conv as :func:`commit_three_tree_convs_` returns them: ``y0, y1, y2, x0, x1, x2``."""
    ys, rows = zip(*per_conv)
    return (*ys, *rows)


@commit_three_tree_convs_.register_fake
def _(state0, state1, state2, pending0, pending1, pending2, num_pending, x0, x1, x2, weight0, weight1, weight2, parents, silu):
    for x, state, weight in zip((x0, x1, x2), (state0, state1, state2), (weight0, weight1, weight2)):
        ref.check_conv_shapes(x, state, weight, parents)
    return tuple(x.new_empty(x.shape) for x in (x0, x1, x2, x0, x1, x2))


def conv_heads(ys: Sequence[torch.Tensor], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The q/k/v conv outputs ``[B, N, D]`` as the heads the state ``[B, HV, K, V]`` reads: ``[B, N, D / K, K]`` for q
    and k, ``[B, N, HV, V]`` for v."""
    q, k, v = ys
    _, hv, dk, dv = state.shape
    return q.unflatten(-1, (-1, dk)), k.unflatten(-1, (-1, dk)), v.unflatten(-1, (hv, dv))


@torch.library.custom_op("specla::gdn_conv_gates_commit_verify_", mutates_args=("conv_states", "state"),
                         tags=_ANY_INPUT_STRIDES)
def gdn_conv_gates_commit_verify_(
    conv_states: list[torch.Tensor],
    conv_pending: list[torch.Tensor],
    xs: list[torch.Tensor],
    conv_weights: list[torch.Tensor],
    silu: bool,
    state: torch.Tensor,
    pending_k: torch.Tensor,
    pending_v: torch.Tensor,
    pending_g: torch.Tensor,
    pending_beta: torch.Tensor,
    num_pending: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    parents: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor]:
    """:func:`commit_three_tree_convs_` of fla's q/k/v projections ``xs`` (their conv states, pending inputs and bias-free
    weights), the outputs as heads (:func:`conv_heads`), then :func:`gdn_gates_commit_verify_` (on GPUs one launch for
    a one-node pass). Returns ``(o, k_hat, g, beta)``, v's heads and the three copies of ``xs``: the pass's records."""
    ys_rows = commit_three_tree_convs_(*conv_states, *conv_pending, num_pending, *xs, *conv_weights, parents, silu)
    q, k, v = conv_heads(ys_rows[:3], state)
    return (*gdn_gates_commit_verify_(state, pending_k, pending_v, pending_g, pending_beta, num_pending, q, k, v, a, b,
                                      a_log, dt_bias, parents, scale, use_qk_l2norm), v, *ys_rows[3:])


@gdn_conv_gates_commit_verify_.register_fake
def _(conv_states, conv_pending, xs, conv_weights, silu, state, pending_k, pending_v, pending_g, pending_beta, num_pending,
      a, b, a_log, dt_bias, parents, scale, use_qk_l2norm):
    for x, conv_state, weight in zip(xs, conv_states, conv_weights):
        ref.check_conv_shapes(x, conv_state, weight, parents)
    q, k, v = conv_heads(xs, state)
    return (*_gates_verify_fake(state, q, k, v, a, b, a_log, dt_bias, parents), v.new_empty(v.shape),
            *(x.new_empty(x.shape) for x in xs))


@torch.library.custom_op("specla::conv_state_commit_", mutates_args=("conv_state",))
def conv_state_commit_(conv_state: torch.Tensor, x: torch.Tensor, num_accepted: torch.Tensor) -> None:
    """Shift each row's first ``num_accepted[b]`` inputs of ``x [B, A, D]`` into ``conv_state`` in place."""
    conv_state.copy_(ref.conv_state_commit_reference(conv_state, x, num_accepted))


@conv_state_commit_.register_fake
def _(conv_state, x, num_accepted):
    return None


@torch.library.custom_op("specla::gather_paths_", mutates_args=("dsts",))
def gather_paths_(dsts: list[torch.Tensor], srcs: list[torch.Tensor], index: torch.Tensor) -> None:
    """``dsts[i][b, a] = srcs[i][b, index[b, a]]`` for every pair (``[B, N, ...]`` into ``[B, A, ...]``,
    -1 entries read node 0): a static tree pass's accepted path of every layer's fresh records, written
    into the pending buffers (``reference.gather_paths_reference``)."""
    for dst, gathered in zip(dsts, ref.gather_paths_reference(srcs, index), strict=True):
        dst.copy_(gathered)


@gather_paths_.register_fake
def _(dsts, srcs, index):
    return None


# --- drafting --------------------------------------------------------------------------------------


@torch.library.custom_op("specla::vocab_top_k", mutates_args=())
def vocab_top_k(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree level's children: the ``k`` best log-probabilities of each row of ``scores [N, V]`` and
    their token ids, best first, ties to the lower id (``reference.vocab_top_k_reference``)."""
    return ref.vocab_top_k_reference(scores, k)


@vocab_top_k.register_fake
def _(scores, k):
    if scores.dim() != 2 or not 1 <= k <= scores.shape[1]:
        raise ValueError(f"vocab_top_k takes scores [N, V] and 1 <= k <= V, got {tuple(scores.shape)} and k={k}")
    return scores.new_empty(scores.shape[0], k, dtype=torch.float32), scores.new_empty(scores.shape[0], k, dtype=torch.long)


@torch.library.custom_op("specla::linear_top_k", mutates_args=())
def linear_top_k(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, k: int,
                 weight_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A draft head's tree level through its LM head: :func:`vocab_top_k` of ``x [N, K] @ weight [V, K]^T + bias``
    (``reference.linear_top_k_reference``); on CUDA, for a few half-precision rows, the scores stay in the
    GEMM's launch (``triton_topk.linear_top_k``). ``weight_scale``: as in :func:`linear_add`."""
    return ref.linear_top_k_reference(x, weight, bias, k, weight_scale)


@linear_top_k.register_fake
def _(x, weight, bias, k, weight_scale=None):
    if x.dim() != 2 or x.shape[1] != weight.shape[1] or not 1 <= k <= weight.shape[0]:
        raise ValueError(f"linear_top_k takes x [N, K], a weight [V, K] and 1 <= k <= V, got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)} and k={k}")
    return x.new_empty(x.shape[0], k, dtype=torch.float32), x.new_empty(x.shape[0], k, dtype=torch.long)


@torch.library.custom_op("specla::draft_attention", mutates_args=())
def draft_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """A draft head's attention: ``q [R, H, S, d]`` over ``keys, values [R, H, T, d]`` under ``mask [R or 1,
    S, T]`` (True = may attend) -> ``[R, S, H, d]``, contiguous (the heads side by side: the output projection
    reads them without a copy; a plain shape, where a transposed layout left inductor assuming another); a query
    that sees no key gets zeros (``reference.draft_attention_reference``)."""
    return ref.draft_attention_reference(q, keys, values, mask, scale).transpose(1, 2).contiguous()


@draft_attention.register_fake
def _(q, keys, values, mask, scale):
    return q.new_empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3])


LINEAR_MAX_ROWS = 32  # rows the linear ops below take to their CUDA kernels (kernels/triton_linear.py); more: the reference
LINEAR_SPLIT_DEPTH = 1024  # the depth each program streams where a deep, narrow weight's GEMM is split (below)


def linear_split(weight: torch.Tensor) -> int:
    """In how many depth slices the CUDA kernels of ``linear`` and ``linear_add`` (no norm, bias or table rows)
    stream ``weight [N, K]``: ``K // LINEAR_SPLIT_DEPTH`` for a deep, narrow one (K >= 4,096, N <= 1,024: a
    draft head's down projection at hidden 1,024, whose propose replays 4% faster on the H200 than with cuBLAS's
    split-K, its reduction and the residual's add; at [2048, 8192] it was 1% slower in bf16; in int8, which cuBLAS
    does not take, N <= 2,048: one program per 16 columns over the whole depth took 14.9 us there against
    cuBLAS's bf16 12.7); 1 otherwise."""
    n, k = weight.shape
    widest = 2048 if weight.dtype == torch.int8 else 1024
    return k // LINEAR_SPLIT_DEPTH if k >= 4 * LINEAR_SPLIT_DEPTH and n <= widest else 1


SWIGLU_SPLIT_DEPTH = 704  # about the depth each program of ``swiglu_linear``'s few-row kernel streams (below)


def swiglu_split(weight: torch.Tensor) -> int:
    """In how many depth slices ``swiglu_linear``'s few-row CUDA kernel streams a down projection's ``weight [N, I]``:
    one per ``SWIGLU_SPLIT_DEPTH`` of I, at least one: 8 at the GDN-1.3B shape's I = 5,632, its best at 9 and 16 rows
    on an H100 with ``triton_linear.SWIGLU_TILES`` (``fold_gpu.py --sections swiglu_down``: 13.2 us a layer at 9 rows,
    13.4 in 4 slices, 15.2 in 4 of 32 columns and 4 warps; inductor's product and cuBLAS's split-K 13.3)."""
    return max(1, weight.shape[1] // SWIGLU_SPLIT_DEPTH)


# A draft head's GEMMs with what surrounds them (the norm before, the residual after, the gate): on CUDA one
# Triton launch each for a few rows (``triton_linear``), where the framework runs two or three kernels.


@torch.library.custom_op("specla::linear_add", mutates_args=())
def linear_add(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
               residual_rows: torch.Tensor | None, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]^T + bias + residual`` -> ``[..., N]``; ``residual`` is ``[..., N]``, or a
    table ``[V, N]`` whose rows ``residual_rows [...]`` picks (``reference.linear_add_reference``).
    ``weight_scale [N]``: ``weight`` is int8, standing for ``weight * weight_scale[:, None]``
    (``reference.quantize_rows``; the linear ops below alike)."""
    return ref.linear_add_reference(x, weight, bias, residual, residual_rows, weight_scale)


@linear_add.register_fake
def _(x, weight, bias, residual, residual_rows, weight_scale=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("specla::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ weight [N, K]^T + bias`` -> ``[..., N]``: a target's GEMM routed to specla's kernel
    (``lowering/fold_norms.route_linears``), an EAGLE head's q/k/v (``head_gemms="triton"``), or an int8 LM head's
    scores (the bias added before the one rounding); on CUDA it launches with PDL on Hopper."""
    return ref.scaled_linear(x, weight, weight_scale, bias)


@linear.register_fake
def _(x, weight, weight_scale=None, bias=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("specla::gated_linear", mutates_args=())
def gated_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``x @ weight^T``, ``weight = [gate; up]`` of ``2N`` rows -> ``[..., N]``
    (``reference.gated_linear_reference``): a target's MLP, or an EAGLE head's (``head_gemms="triton"``)."""
    return ref.gated_linear_reference(x, weight, weight_scale)


@gated_linear.register_fake
def _(x, weight, weight_scale=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)


@torch.library.custom_op("specla::norm_linear", mutates_args=())
def norm_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``rms_norm(x) @ weight^T`` -> ``[..., N]`` (``reference.norm_linear_reference``)."""
    return ref.norm_linear_reference(x, norm_weight, eps, weight, weight_scale)


@norm_linear.register_fake
def _(x, norm_weight, eps, weight, weight_scale=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("specla::norm_gated_linear", mutates_args=())
def norm_gated_linear(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                      weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``rms_norm(x) @ weight^T``, ``weight = [gate; up]`` of ``2N`` rows -> ``[..., N]``
    (``reference.norm_gated_linear_reference``)."""
    return ref.norm_gated_linear_reference(x, norm_weight, eps, weight, weight_scale)


@norm_gated_linear.register_fake
def _(x, norm_weight, eps, weight, weight_scale=None):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)


@torch.library.custom_op("specla::add_norm_linear", mutates_args=())
def add_norm_linear(x: torch.Tensor, skip: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + skip) @ weight^T, x + skip)`` (``reference.add_norm_linear_reference``)."""
    return ref.add_norm_linear_reference(x, skip, norm_weight, eps, weight)


@add_norm_linear.register_fake
def _(x, skip, norm_weight, eps, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0]), torch.empty_like(x)


@torch.library.custom_op("specla::add_norm_gated_linear", mutates_args=())
def add_norm_gated_linear(x: torch.Tensor, skip: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm_gated_linear(x + skip), x + skip)`` (``reference.add_norm_linear_reference``, gated)."""
    return ref.add_norm_linear_reference(x, skip, norm_weight, eps, weight, gated=True)


@add_norm_gated_linear.register_fake
def _(x, skip, norm_weight, eps, weight):
    return x.new_empty(*x.shape[:-1], weight.shape[0] // 2), torch.empty_like(x)


GATED_NORM_GEMV_BLOCK_K = 512  # the K chunk of gated_norm_linear's one-row CUDA kernel (kernels/triton_gemv.py)


def gated_norm_gemv_heads_fit(heads: int, dim: int, weight: torch.Tensor, block_k: int = GATED_NORM_GEMV_BLOCK_K) -> bool:
    """Whether the one-row kernel takes ``heads`` x ``dim`` heads (powers of two filling whole ``block_k`` chunks)
    and the contiguous ``weight`` with that many columns (the fold's test, on a graph's example values)."""
    return (heads & (heads - 1) == 0 and dim & (dim - 1) == 0 and (heads * dim) % block_k == 0 and weight.dim() == 2
            and weight.shape[1] == heads * dim and weight.is_contiguous())


def gated_norm_gemv_fits(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor,
                         block_k: int = GATED_NORM_GEMV_BLOCK_K) -> bool:
    """Whether ``gated_norm_linear``'s one-row CUDA kernel takes these: one row of ``[..., H, D]`` heads
    (:func:`gated_norm_gemv_heads_fit`), its gate alike, a norm weight of D values, and a weight of the row's dtype.
    (The row and gate may lie anyhow: the caller copies a few KB.)"""
    if x.dim() < 2:
        return False
    heads, dim = x.shape[-2:]
    return (x.numel() == heads * dim and gate.shape == x.shape and gate.dtype == x.dtype and weight.dtype == x.dtype
            and norm_weight.numel() == dim and gated_norm_gemv_heads_fit(heads, dim, weight, block_k))


GATED_NORM_ROWS_DIMS = (16, 32, 64, 128, 256)  # head sizes the few-row kernel normalises a step at a time (triton_linear)


def gated_norm_rows_heads_fit(heads: int, dim: int, weight: torch.Tensor) -> bool:
    """Whether the few-row kernel takes ``heads`` x ``dim`` heads (a power of two from 16 to 256 values: one step of
    its loop, the norm's whole extent) and the contiguous ``weight`` with that many columns (the fold's test, on a
    graph's example values)."""
    return (dim in GATED_NORM_ROWS_DIMS and weight.dim() == 2 and weight.shape[1] == heads * dim
            and weight.is_contiguous())


def gated_norm_rows_fit(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``gated_norm_linear``'s few-row CUDA kernel takes these: 1 to ``LINEAR_MAX_ROWS`` rows of ``[..., H,
    D]`` heads (:func:`gated_norm_rows_heads_fit`), the gate alike, a norm weight of D values, and a weight of the
    rows' dtype."""
    if x.dim() < 2 or x.numel() == 0:
        return False
    heads, dim = x.shape[-2:]
    return (x.numel() <= LINEAR_MAX_ROWS * heads * dim and gate.shape == x.shape and gate.dtype == x.dtype == weight.dtype
            and norm_weight.numel() == dim and gated_norm_rows_heads_fit(heads, dim, weight))


@torch.library.custom_op("specla::gated_norm_linear", mutates_args=())
def gated_norm_linear(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor) -> torch.Tensor:
    """A GDN layer's gated output norm and o_proj: ``[..., H, D]`` heads -> ``[..., N]``
    (``reference.gated_norm_linear_reference``)."""
    return ref.gated_norm_linear_reference(x, gate, norm_weight, eps, weight)


@gated_norm_linear.register_fake
def _(x, gate, norm_weight, eps, weight):
    return x.new_empty(*x.shape[:-2], weight.shape[0])


def swiglu_gemv_block_k(weight: torch.Tensor) -> int | None:
    """The K chunk with which ``swiglu_linear``'s one-row CUDA kernel streams a down projection's ``weight [N, I]``:
    the largest power of two up to ``GATED_NORM_GEMV_BLOCK_K``, at least 16, that divides I (fla's MLPs are multiples
    of 256); None where it takes no chunk or the weight is not contiguous (the fold's test, on example values)."""
    if weight.dim() != 2 or not weight.is_contiguous():
        return None
    block_k = GATED_NORM_GEMV_BLOCK_K
    while block_k >= 16 and weight.shape[1] % block_k:
        block_k //= 2
    return block_k if block_k >= 16 else None


def swiglu_gemv_fits(gate_up: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``swiglu_linear``'s one-row CUDA kernel takes these: one row of ``[gate, up]``, each as wide as the
    weight's rows, of the weight's dtype (:func:`swiglu_gemv_block_k`)."""
    return (gate_up.numel() == gate_up.shape[-1] == 2 * weight.shape[-1] and gate_up.dtype == weight.dtype
            and swiglu_gemv_block_k(weight) is not None)


@torch.library.custom_op("specla::swiglu_linear", mutates_args=())
def swiglu_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """An MLP's ``silu(gate) * up`` and down projection, from its packed gate/up output: ``[..., 2I]`` -> ``[..., N]``
    (``reference.swiglu_linear_reference``)."""
    return ref.swiglu_linear_reference(gate_up, weight)


@swiglu_linear.register_fake
def _(gate_up, weight):
    return gate_up.new_empty(*gate_up.shape[:-1], weight.shape[0])


ROW_GEMV_PROLOGUES = ("none", "swiglu", "gated_norm")  # (the CUDA GEMV's add_norm has an op of its own: two outputs)


@torch.library.custom_op("specla::row_gemv", mutates_args=())
def row_gemv(x: torch.Tensor, weight: torch.Tensor, prologue: str, gate: torch.Tensor | None = None,
             norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """A bias-free ``linear`` of one row, ``[..., K]`` -> ``[..., N]``, of x as ``prologue`` forms it: ``"none"``;
    ``"swiglu"``, ``silu(gate) * up`` from an MLP's packed ``[gate, up]`` row ``[..., 2K]``
    (``reference.swiglu_linear_reference``); ``"gated_norm"``, fla's gated output norm of ``[..., H, D]`` heads with
    ``gate``, ``norm_weight`` and ``eps`` (``reference.gated_norm_linear_reference``). On CUDA, the CUDA C GEMV of
    ``kernels/cuda_gemv.cu`` where it takes the shapes (the backend's ``cuda_gemvs`` option routes to it)."""
    if prologue not in ROW_GEMV_PROLOGUES:
        raise ValueError(f"row_gemv's prologue must be one of {ROW_GEMV_PROLOGUES}, got {prologue!r}")
    if prologue == "swiglu":
        return ref.swiglu_linear_reference(x, weight)
    if prologue == "gated_norm":
        return ref.gated_norm_linear_reference(x, gate, norm_weight, eps, weight)
    return torch.nn.functional.linear(x, weight)


@row_gemv.register_fake
def _(x, weight, prologue, gate=None, norm_weight=None, eps=0.0):
    return x.new_empty(*x.shape[: -2 if prologue == "gated_norm" else -1], weight.shape[0])


@torch.library.custom_op("specla::add_norm_row_gemv", mutates_args=())
def add_norm_row_gemv(x: torch.Tensor, skip: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                      round_sum: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add, the RMS norm after it and the bias-free ``linear`` after that, of one row: ``[..., K]`` twice ->
    ``([..., N], x + skip)``, the sum normalised in float32 as fla's fused prenorm does, or rounded first
    (``round_sum``) as an add and then a norm do (``reference.add_norm_row_gemv_reference``). On CUDA, the CUDA C GEMV
    of ``kernels/cuda_gemv.cu`` where it takes the shapes (the backend's ``cuda_gemvs`` option folds the norms in)."""
    return ref.add_norm_row_gemv_reference(x, skip, norm_weight, eps, weight, round_sum)


@add_norm_row_gemv.register_fake
def _(x, skip, norm_weight, eps, weight, round_sum):
    return x.new_empty(*x.shape[:-1], weight.shape[0]), torch.empty_like(x)


# A captured model's RMS norms (fla's, routed by lowering/capture.py), plain and gated: one node each in Dynamo's
# graph, which a static twin folds into the GEMM after it (lowering/fold_norms.py). Composite: wherever it is not folded,
# AOTAutograd traces its PyTorch ops, which inductor fuses with what surrounds them as before.
_NORMS = torch.library.Library("specla", "FRAGMENT")
_NORMS.define("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> Tensor")
_NORMS.impl("rms_norm", ref.rms_norm_reference, "CompositeImplicitAutograd")
_NORMS.define("rms_norm_gated(Tensor x, Tensor gate, Tensor weight, float eps) -> Tensor")
_NORMS.impl("rms_norm_gated", ref.rms_norm_gated_reference, "CompositeImplicitAutograd")
