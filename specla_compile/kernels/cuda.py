"""CUDA implementations of the ``specla::`` custom ops, backed by the Triton kernels.

Importing this module registers them (``kernels/__init__`` does it when CUDA and Triton are present).
Contracts are those of ``ops.py``: same shapes and dtypes, commits mutate the state in place, outputs
never alias inputs. The kernels compute in fp32; a float64 state asks for the oracle, so the op's
reference implementation runs instead. The verify route comes from :mod:`.dispatch`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import (
    cuda_gemv,
    dispatch,
    ops,
    pdl,
    reference,
    triton_attention,
    triton_conv,
    triton_gather,
    triton_gemv,
    triton_linear,
    triton_topk,
    triton_verify,
)


def _reference_of(op: torch.library.CustomOpDef) -> Callable:
    return op._init_fn  # the pure-PyTorch implementation ops.py defined the op with


def _kernel_layout(state: torch.Tensor) -> bool:
    """Whether the recurrent kernels update ``state`` where it lies."""
    return triton_verify.state_strides(state) is not None


def _in_place(state: torch.Tensor, update: Callable[[torch.Tensor], object], fits: Callable[[torch.Tensor], bool]) -> object:
    """Run ``update`` on ``state`` if its layout ``fits`` the kernel, else on a contiguous copy that is
    written back (two copies of the state: avoid them)."""
    work = state if fits(state) else state.contiguous()
    out = update(work)
    if work is not state:
        state.copy_(work)
    return out


def _verify(q, k, v, g, beta, parents, state, scale, use_qk_l2norm, pending=None) -> tuple[torch.Tensor, torch.Tensor]:
    route = dispatch.choose_route(parents.shape[1])
    config = dispatch.kernel_config(route, parents.shape[1], pending is not None, batch=parents.shape[0])
    return triton_verify.tree_verify(
        q, k, v, g, beta, parents, state, scale, use_qk_l2norm, route=route, pending=pending, config=config)


@ops.gdn_tree_verify.register_kernel("cuda")
def _gdn_tree_verify(q, k, v, g, beta, parents, state, scale, use_qk_l2norm):
    if state.dtype != torch.float32:
        return _reference_of(ops.gdn_tree_verify)(q, k, v, g, beta, parents, state, scale, use_qk_l2norm)
    return _verify(q, k, v, g, beta, parents, state if _kernel_layout(state) else state.contiguous(), scale, use_qk_l2norm)


@ops.gdn_commit_.register_kernel("cuda")
def _gdn_commit_(state, k, v, g, beta, num_accepted):
    if state.dtype != torch.float32:
        return _reference_of(ops.gdn_commit_)(state, k, v, g, beta, num_accepted)
    _in_place(state, lambda s: triton_verify.commit_(s, k, v, g, beta, num_accepted), _kernel_layout)


@ops.gdn_commit_verify_.register_kernel("cuda")
def _gdn_commit_verify_(state, pending_k, pending_v, pending_g, pending_beta, num_pending,
                        q, k, v, g, beta, parents, scale, use_qk_l2norm):
    if state.dtype != torch.float32:
        return _reference_of(ops.gdn_commit_verify_)(state, pending_k, pending_v, pending_g, pending_beta, num_pending,
                                                     q, k, v, g, beta, parents, scale, use_qk_l2norm)
    pending = triton_verify.Pending(pending_k, pending_v, pending_g, pending_beta, num_pending)
    return _in_place(state, lambda s: _verify(q, k, v, g, beta, parents, s, scale, use_qk_l2norm, pending), _kernel_layout)


@ops.gdn_gates_commit_verify_.register_kernel("cuda")
def _gdn_gates_commit_verify_(state, pending_k, pending_v, pending_g, pending_beta, num_pending,
                              q, k, v, a, b, a_log, dt_bias, parents, scale, use_qk_l2norm):
    """In float32 state, one launch where the verify's route computes the gates itself: a one-node pass on the serial
    route (plain decoding's step) and any pass on the parallel route; else (the serial and hybrid routes' longer
    passes, float64) the gates, then the verify op."""
    records = (pending_k, pending_v, pending_g, pending_beta, num_pending)
    batch, nodes = parents.shape
    route = dispatch.choose_route(nodes)
    if (state.dtype != torch.float32 or torch.float64 in {t.dtype for t in (q, k, v, a, b, a_log, dt_bias)}
            or not (route == "parallel" or (route == "serial" and nodes == 1))):
        g, beta = reference.gdn_gates_reference(a, b, a_log, dt_bias)
        return (*_gdn_commit_verify_(state, *records, q, k, v, g, beta, parents, scale, use_qk_l2norm), g, beta)
    pending, gates = triton_verify.Pending(*records), triton_verify.GateProjections(a, b, a_log, dt_bias)
    config = dispatch.kernel_config(route, nodes, pending=True, batch=batch)
    if route == "serial":
        return _in_place(state, lambda s: triton_verify.commit_verify_one_token_gates(
            q, k, v, gates, s, scale, use_qk_l2norm, pending=pending, config=config), _kernel_layout)
    g, beta = (torch.empty(a.shape, dtype=torch.float32, device=a.device) for _ in range(2))
    o, k_hat = _in_place(state, lambda s: triton_verify.tree_verify(
        q, k, v, g, beta, parents, s, scale, use_qk_l2norm, route=route, pending=pending, config=config,
        gates=gates), _kernel_layout)
    return o, k_hat, g, beta


@ops.commit_tree_conv_.register_kernel("cuda")
def _commit_tree_conv_(conv_state, pending_x, num_pending, x, weight, bias, parents, silu):
    if torch.float64 in (x.dtype, conv_state.dtype, weight.dtype):
        return _reference_of(ops.commit_tree_conv_)(conv_state, pending_x, num_pending, x, weight, bias, parents, silu)
    return _in_place(conv_state, lambda s: triton_conv.tree_conv(x, s, weight, bias, parents, silu, pending=(pending_x, num_pending)),
                     torch.Tensor.is_contiguous)


@ops.commit_three_tree_convs_.register_kernel("cuda")
def _commit_three_tree_convs_(state0, state1, state2, pending0, pending1, pending2, num_pending, x0, x1, x2,
                              weight0, weight1, weight2, parents, silu):
    states, pendings, xs, weights = (state0, state1, state2), (pending0, pending1, pending2), (x0, x1, x2), (weight0, weight1, weight2)
    if torch.float64 in {t.dtype for t in (*states, *xs, *weights)} or not triton_conv.fits_three_tree_convs(xs, states, weights, pendings):
        return ops.three_convs_outputs(
            _commit_tree_conv_(s, p, num_pending, x, w, None, parents, silu) for s, p, x, w in zip(states, pendings, xs, weights))
    return triton_conv.three_tree_convs(xs, states, weights, pendings, num_pending, parents, silu)


@ops.gdn_conv_gates_commit_verify_.register_kernel("cuda")
def _gdn_conv_gates_commit_verify_(conv_states, conv_pending, xs, conv_weights, silu, state, pending_k, pending_v,
                                   pending_g, pending_beta, num_pending, a, b, a_log, dt_bias, parents, scale, use_qk_l2norm):
    """One launch where the one-node gates kernel runs (:func:`_gdn_gates_commit_verify_`) and the three convs share
    one (``triton_conv.fits_three_tree_convs``); else the convs' launch, then the gates and recurrence op."""
    records = (pending_k, pending_v, pending_g, pending_beta, num_pending)
    conv_tensors = (*conv_states, *xs, *conv_weights)
    if (parents.shape[1] != 1 or state.dtype != torch.float32 or dispatch.choose_route(1) != "serial"
            or torch.float64 in {t.dtype for t in (*conv_tensors, a, b, a_log, dt_bias)}
            or not triton_conv.fits_three_tree_convs(xs, conv_states, conv_weights, conv_pending)
            or not triton_verify.one_token_conv_gates_fits(xs, state)):
        ys_rows = _commit_three_tree_convs_(*conv_states, *conv_pending, num_pending, *xs, *conv_weights, parents, silu)
        q, k, v = ops.conv_heads(ys_rows[:3], state)
        return (*_gdn_gates_commit_verify_(state, *records, q, k, v, a, b, a_log, dt_bias, parents, scale, use_qk_l2norm),
                v, *ys_rows[3:])
    config = dispatch.kernel_config("serial", 1, pending=True, batch=parents.shape[0])
    weights, pending_xs = ([t.contiguous() for t in ts] for ts in (conv_weights, conv_pending))
    gates = triton_verify.GateProjections(a, b, a_log, dt_bias)
    return _in_place(state, lambda s: triton_verify.commit_verify_one_token_conv_gates(
        xs, conv_states, weights, pending_xs, num_pending, silu, gates, s, scale, use_qk_l2norm,
        pending=triton_verify.Pending(*records), config=config), _kernel_layout)


@ops.conv_state_commit_.register_kernel("cuda")
def _conv_state_commit_(conv_state, x, num_accepted):
    _in_place(conv_state, lambda s: triton_conv.conv_state_commit_(s, x, num_accepted), torch.Tensor.is_contiguous)


ops.vocab_top_k.register_kernel("cuda")(triton_topk.vocab_top_k)
ops.gather_paths_.register_kernel("cuda")(triton_gather.gather_paths_)


@ops.linear_top_k.register_kernel("cuda")
def _linear_top_k(x, weight, bias, k, weight_scale=None):
    if not (_few_half_rows(x, bias) and triton_linear.weight_fits(x, weight, weight_scale) and triton_topk.linear_top_k_fits(weight, k)):
        # (an int8 weight's scores from specla's GEMM, which takes it; a float one's from the framework's, as before)
        scores = torch.nn.functional.linear(x, weight, bias) if weight_scale is None else ops.linear(x, weight, weight_scale, bias)
        return triton_topk.vocab_top_k(scores, k)
    return triton_topk.linear_top_k(x.contiguous(), weight.contiguous(), _vector(bias), k, _vector(weight_scale))


@ops.draft_attention.register_kernel("cuda")
def _draft_attention(q, keys, values, mask, scale):
    if torch.float64 in (q.dtype, keys.dtype, values.dtype):
        return _reference_of(ops.draft_attention)(q, keys, values, mask, scale)
    if q.shape[2] > triton_attention.MAX_QUERIES:  # (a prompt's catch-up: many queries, one uncaptured call)
        reference.check_draft_attention(q, keys, values, mask)
        out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], scale=scale)
        return out.masked_fill(~mask.any(-1)[:, None, :, None], 0).transpose(1, 2).contiguous()
    return triton_attention.draft_attention(q, keys, values, mask, scale)


def _few_half_rows(x: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    """A few rows in half precision: where the head's linear kernels beat cuBLAS (``gemv_gpu_eagle_head.md``,
    measured in bf16; fp32 and fp64 keep the reference)."""
    return (x.numel() <= triton_linear.MAX_ROWS * x.shape[-1] and x.dtype in (torch.bfloat16, torch.float16)
            and all(t.dtype == x.dtype for t in tensors if t is not None))


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def _vector(t: torch.Tensor | None) -> torch.Tensor | None:
    """An optional bias, norm weight or row index as the kernels read it: flat, unit stride (a column of a
    drafter's input buffer is a strided view)."""
    return None if t is None else t.reshape(-1).contiguous()


@ops.linear_add.register_kernel("cuda")
def _linear_add(x, weight, bias, residual, residual_rows, weight_scale=None):
    if not (_few_half_rows(x, bias, residual) and triton_linear.weight_fits(x, weight, weight_scale)):
        return _reference_of(ops.linear_add)(x, weight, bias, residual, residual_rows, weight_scale)
    table = residual_rows is not None
    y = triton_linear.linear(_rows(x), weight.contiguous(), _vector(bias), residual.contiguous() if table else _rows(residual),
                             _vector(residual_rows), weight_scale=_vector(weight_scale))
    return y.view(*x.shape[:-1], weight.shape[0])


@ops.linear.register_kernel("cuda")
def _linear(x, weight, weight_scale=None, bias=None):
    if not (_few_half_rows(x, bias) and triton_linear.weight_fits(x, weight, weight_scale)):
        return _reference_of(ops.linear)(x, weight, weight_scale, bias)
    return triton_linear.linear(_rows(x), weight.contiguous(), _vector(bias), weight_scale=_vector(weight_scale)).view(
        *x.shape[:-1], weight.shape[0])


@ops.gated_linear.register_kernel("cuda")
def _gated_linear(x, weight, weight_scale=None):
    if not (_few_half_rows(x) and triton_linear.weight_fits(x, weight, weight_scale)):
        return _reference_of(ops.gated_linear)(x, weight, weight_scale)
    return triton_linear.gated_linear(_rows(x), weight.contiguous(), weight_scale=_vector(weight_scale)).view(
        *x.shape[:-1], weight.shape[0] // 2)


@ops.norm_linear.register_kernel("cuda")
def _norm_linear(x, norm_weight, eps, weight, weight_scale=None):
    if not (_few_half_rows(x, norm_weight) and triton_linear.weight_fits(x, weight, weight_scale)):
        return _reference_of(ops.norm_linear)(x, norm_weight, eps, weight, weight_scale)
    return triton_linear.linear(_rows(x), weight.contiguous(), norm_weight=_vector(norm_weight), eps=eps,
                                weight_scale=_vector(weight_scale)).view(*x.shape[:-1], weight.shape[0])


@ops.norm_gated_linear.register_kernel("cuda")
def _norm_gated_linear(x, norm_weight, eps, weight, weight_scale=None):
    if not (_few_half_rows(x, norm_weight) and triton_linear.weight_fits(x, weight, weight_scale)):
        return _reference_of(ops.norm_gated_linear)(x, norm_weight, eps, weight, weight_scale)
    return triton_linear.gated_linear(_rows(x), weight.contiguous(), _vector(norm_weight), eps,
                                      weight_scale=_vector(weight_scale)).view(*x.shape[:-1], weight.shape[0] // 2)


def _add_norm_linear(op: torch.library.CustomOpDef, project: str) -> Callable:
    """The CUDA implementation of ``op`` (add_norm_linear or its gated twin): one launch of
    ``triton_linear.<project>`` (looked up at each call, as the linear ops above do) that also writes the sum, for a few
    bf16 rows (fp16's two-pass norm would read the rows before the sum)."""

    def run(x, skip, norm_weight, eps, weight):
        reference.check_skip(x, skip)
        if not (_few_half_rows(x, skip, norm_weight, weight) and x.dtype == torch.bfloat16):
            return _reference_of(op)(x, skip, norm_weight, eps, weight)
        rows, summed = _rows(x), torch.empty(x.shape, dtype=x.dtype, device=x.device)
        y = getattr(triton_linear, project)(rows, weight.contiguous(), norm_weight=_vector(norm_weight), eps=eps,
                                            skip=_rows(skip), skip_sum=summed.view(rows.shape))
        return y.view(*x.shape[:-1], y.shape[-1]), summed

    return run


ops.add_norm_linear.register_kernel("cuda")(_add_norm_linear(ops.add_norm_linear, "linear"))
ops.add_norm_gated_linear.register_kernel("cuda")(_add_norm_linear(ops.add_norm_gated_linear, "gated_linear"))


def _head_rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., H, D]`` heads as ``[M, H, D]`` rows, each row's heads contiguous, the rows at any one stride: a view
    where one does (a slice of a packed projection's output), else a copy."""
    rows = x.reshape(-1, *x.shape[-2:])
    return rows if rows.stride()[1:] == (x.shape[-1], 1) else rows.contiguous()


@ops.gated_norm_linear.register_kernel("cuda")
def _gated_norm_linear(x, gate, norm_weight, eps, weight):
    """One bf16 row in one launch of the one-row GEMV (the plain step at B=1, where the backend folds the norm); up to
    32 half-precision rows in one launch of the few-row kernel (the twins of more tokens, ``fold_gated_norms_drafted``);
    else the reference."""
    if x.dtype == torch.bfloat16 and ops.gated_norm_gemv_fits(x, gate, norm_weight, weight):
        # (a row and gate that lie otherwise are copied: a few KB; the weight never is)
        return triton_gemv.gated_norm_gemv(x.contiguous(), gate.contiguous(), norm_weight, eps, weight)
    if x.dtype in (torch.bfloat16, torch.float16) and ops.gated_norm_rows_fit(x, gate, norm_weight, weight):
        y = triton_linear.gated_norm_linear(_head_rows(x), _head_rows(gate), norm_weight.contiguous(), eps, weight)
        return y.view(*x.shape[:-2], weight.shape[0])
    return _reference_of(ops.gated_norm_linear)(x, gate, norm_weight, eps, weight)


@ops.row_gemv.register_kernel("cuda")
def _row_gemv(x, weight, prologue, gate=None, norm_weight=None, eps=0.0):
    """The CUDA C GEMV where it takes the shapes and addresses (16-byte loads); else the reference."""
    x, gate = x.contiguous(), None if gate is None else gate.contiguous()  # (a row of a few KB)
    if prologue not in ops.ROW_GEMV_PROLOGUES or not cuda_gemv.fits(x, weight, prologue, gate, norm_weight):
        # (the reference raises the op's error for a prologue it does not take)
        return _reference_of(ops.row_gemv)(x, weight, prologue, gate, norm_weight, eps)
    return cuda_gemv.row_gemv(x, weight, prologue, pdl.enabled(x.device), gate, norm_weight, eps)


@ops.add_norm_row_gemv.register_kernel("cuda")
def _add_norm_row_gemv(x, skip, norm_weight, eps, weight, round_sum):
    """The CUDA C GEMV with the add and norm in its prologue where it takes the shapes and addresses; else the
    reference."""
    reference.check_skip(x, skip)
    x, skip = x.contiguous(), skip.contiguous()  # (a row of a few KB)
    if not cuda_gemv.fits(x, weight, "add_norm", skip, norm_weight):
        return _reference_of(ops.add_norm_row_gemv)(x, skip, norm_weight, eps, weight, round_sum)
    return cuda_gemv.add_norm_row_gemv(x, skip, norm_weight, eps, weight, round_sum, pdl.enabled(x.device))


@ops.swiglu_linear.register_kernel("cuda")
def _swiglu_linear(gate_up, weight):
    """One bf16 row in one launch of the one-row GEMV (the plain step at B=1, where the backend folds the product); up
    to 32 half-precision rows in one launch of the split few-row kernel (the twins of more tokens,
    ``fold_swiglu_drafted``); else the reference."""
    if gate_up.dtype == torch.bfloat16 and ops.swiglu_gemv_fits(gate_up, weight):
        return triton_gemv.swiglu_gemv(gate_up.contiguous(), weight)  # (a row of a few KB; the weight never copied)
    if _few_half_rows(gate_up) and weight.dtype == gate_up.dtype and gate_up.shape[-1] == 2 * weight.shape[-1]:
        return triton_linear.swiglu_linear(_rows(gate_up), weight.contiguous()).view(*gate_up.shape[:-1], weight.shape[0])
    return _reference_of(ops.swiglu_linear)(gate_up, weight)
