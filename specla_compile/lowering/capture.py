"""Capture: route every known GDN entry point through one opaque ``specla::`` op.

:func:`route` (run by :mod:`specla_compile.import_routing` as each module is imported) and
:func:`install` (every module, run by the backend) replace each known entry point of fla and
transformers with a thin wrapper. On CUDA in eager mode the wrapper calls the original, so nothing
changes. While Dynamo traces (``torch.compile``), and on CPU tensors (where fla's Triton kernels cannot
run), it normalizes the call to DESIGN.md's canonical form and calls ``specla::gdn_recurrence``,
``specla::short_conv`` or ``specla::causal_conv1d``: one node each in the graph, which
:mod:`.rewrite` finds and turns into verify ops.

Users with their own GDN code name their recurrence with :func:`register_recurrence`.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..import_routing import (
    FLA_GDN_LAYER,
    FLA_MLP,
    FLA_MODULES,
    ROUTED_MODULES,
    TRANSFORMERS_GDN_FAMILIES,
    transformers_modeling,
)
from ..kernels import ops  # noqa: F401  (registers the torch.ops.specla namespace)
from ..kernels.reference import causal_conv_reference, gdn_chain_reference

log = logging.getLogger(__name__)


@dataclass
class RecurrenceCall:
    """One GDN recurrence call in canonical form (DESIGN.md): ``g`` is the log decay, ``beta`` the
    final write strength, the state ``[B, HV, K, V]`` unless ``state_v_first`` ([B, HV, V, K])."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    initial_state: torch.Tensor | None = None
    output_final_state: bool = False
    scale: float | None = None
    use_qk_l2norm: bool = False
    state_v_first: bool = False
    cu_seqlens: torch.Tensor | None = None  # packed variable-length rows (batch 1): row i is tokens [c_i, c_i+1)


RecurrenceAdapter = Callable[..., RecurrenceCall]
"""Called with an entry point's own ``(*args, **kwargs)``; returns the canonical call."""


def _differentiable_eager() -> bool:
    """Eager autograd (training on CPU): call the differentiable references, not the custom ops,
    which define no backward."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling()


def use_specla_path(x: torch.Tensor) -> bool:
    """Route through specla ops while tracing, or where fla's GPU-only kernels cannot run."""
    return torch.compiler.is_compiling() or x.device.type == "cpu"


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor:
    return next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))


def _reject(what: str, **unsupported: Any) -> None:
    used = [name for name, value in unsupported.items() if value is not None and value is not False]
    if used:
        raise NotImplementedError(f"specla capture of {what} does not support {', '.join(used)}")


@torch.compiler.disable
def run_packed_rows(run_row: Callable[[slice, int], tuple], cu_seqlens: torch.Tensor) -> tuple:
    """Packed variable-length rows (fla unpads a batch called with a padding ``attention_mask`` into one
    row and ``cu_seqlens``), one row at a time: ``run_row(tokens, i)`` returns ``(out [1, T_i, ...],
    final state [1, ...] or None)``; outputs are joined along the tokens, states along the rows. Eager
    (a graph break under ``torch.compile``): the offsets are data, and such calls are plain calls (never
    a verification pass)."""
    bounds = cu_seqlens.tolist()
    outs, states = zip(*(run_row(slice(a, b), i) for i, (a, b) in enumerate(itertools.pairwise(bounds))))
    return torch.cat(outs, dim=1), (None if states[0] is None else torch.cat(states, dim=0))


def run_recurrence(call: RecurrenceCall) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run a canonical call through ``specla::gdn_recurrence``; returns ``(o, final_state or None)``."""
    if call.cu_seqlens is not None:
        def row(tokens: slice, i: int) -> tuple:
            state = None if call.initial_state is None else call.initial_state[i : i + 1]
            part = {name: getattr(call, name)[:, tokens] for name in ("q", "k", "v", "g", "beta")}
            return run_recurrence(dataclasses.replace(call, **part, initial_state=state, cu_seqlens=None))

        return run_packed_rows(row, call.cu_seqlens)
    q, v = call.q, call.v
    state = call.initial_state
    if state is None:
        state = torch.zeros(q.shape[0], v.shape[2], q.shape[3], v.shape[3], dtype=torch.float32, device=q.device)
    elif call.state_v_first:
        state = state.transpose(-1, -2)
    scale = q.shape[-1] ** -0.5 if call.scale is None else call.scale
    if _differentiable_eager():
        o, final = gdn_chain_reference(q, call.k, v, call.g, call.beta, state, scale=scale, use_qk_l2norm=call.use_qk_l2norm)
    else:
        o, final = torch.ops.specla.gdn_recurrence(q, call.k, v, call.g, call.beta, state, scale, call.use_qk_l2norm)
    if call.state_v_first:
        final = final.transpose(-1, -2)
    return o, (final if call.output_final_state else None)


def _wraps(original: Callable) -> Callable[[Callable], Callable]:
    """``functools.wraps`` without the markers ``torch.compiler.disable`` leaves on ``original``: fla
    disables ``chunk_gated_delta_rule`` (its path above 64 tokens), and copied onto our wrapper they
    would make Dynamo skip the wrapper too, so the recurrence would never reach the graph."""

    def decorate(wrapper: Callable) -> Callable:
        wrapper = functools.wraps(original)(wrapper)
        for name in [n for n in vars(wrapper) if n.startswith("_torchdynamo")]:
            delattr(wrapper, name)
        return wrapper

    return decorate


_recurrence_calls = 0


def recurrence_calls() -> int:
    """How many eager calls of a routed GDN recurrence this process has made: an eager forward that leaves
    it unchanged went through no recurrence that specla can verify."""
    return _recurrence_calls


def _recurrence_wrapper(original: Callable, adapter: RecurrenceAdapter) -> Callable:
    @_wraps(original)
    def wrapper(*args, **kwargs):
        global _recurrence_calls
        if not torch.compiler.is_compiling():  # eager calls only: Dynamo would guard on the counter
            _recurrence_calls += 1
        if not use_specla_path(_first_tensor(args, kwargs)):
            return original(*args, **kwargs)
        return run_recurrence(adapter(*args, **kwargs))

    wrapper.__specla_original__ = original
    return wrapper


# --- adapters of the known families --------------------------------------------------------------


def fla_recurrence_adapter(
    q,
    k,
    v,
    g=None,
    beta=None,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    cu_seqlens=None,
    use_gate_in_kernel=False,
    A_log=None,
    dt_bias=None,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    state_v_first=False,
    gk=None,
    gv=None,
    **ignored,
) -> RecurrenceCall:
    """fla's ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule`` (fla >= 0.6)."""
    _reject("fla's gated delta rule", gk=gk, gv=gv)
    if g is None:
        g = q.new_zeros(v.shape[:3], dtype=torch.float32)
    elif use_gate_in_kernel:  # the kernel's fused gate: g = -exp(A_log) * softplus(g + dt_bias)
        g = g.float() + (dt_bias.float() if dt_bias is not None else 0.0)
        g = -A_log.float().exp() * F.softplus(g)
    if beta is None:
        beta = v.new_ones(v.shape[:3])
    elif use_beta_sigmoid_in_kernel:
        beta = beta.float().sigmoid()
        if allow_neg_eigval:
            beta = beta * 2
    return RecurrenceCall(q, k, v, g, beta, initial_state, output_final_state, scale, use_qk_l2norm_in_kernel, state_v_first, cu_seqlens)


def transformers_recurrence_adapter(
    query, key, value, g, beta, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs
) -> RecurrenceCall:
    """transformers' ``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``."""
    _reject("transformers' gated delta rule", cu_seqlens=kwargs.get("cu_seqlens"))
    return RecurrenceCall(query, key, value, g, beta, initial_state, output_final_state, None, use_qk_l2norm_in_kernel)


def _silu_flag(activation: str | None) -> bool:
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"specla capture supports short convolutions with SiLU or no activation, got {activation!r}")
    return activation is not None


def fla_causal_conv1d(
    x, weight=None, bias=None, residual=None, initial_state=None, output_final_state=False, activation=None, cu_seqlens=None, **kwargs
):
    """fla's ``causal_conv1d`` (``x [B, T, D]``, ``weight [D, W]``, state ``[B, D, W]``)."""
    _reject("fla's causal_conv1d", residual=residual)
    if cu_seqlens is not None:
        def row(tokens: slice, i: int) -> tuple:
            state = None if initial_state is None else initial_state[i : i + 1]
            return fla_causal_conv1d(x[:, tokens], weight, bias, None, state, output_final_state, activation)

        return run_packed_rows(row, cu_seqlens)
    if initial_state is None:
        initial_state = x.new_zeros(x.shape[0], x.shape[2], weight.shape[-1])
    silu = _silu_flag(activation)
    if _differentiable_eager():
        y, new_state = causal_conv_reference(x, initial_state, weight, bias, silu=silu)
    else:
        y, new_state = torch.ops.specla.short_conv(x, initial_state, weight, bias, silu)
    return y, (new_state if output_final_state else None)


def fla_short_conv_forward(self, x, residual=None, mask=None, cache=None, output_final_state=False, cu_seqlens=None, **kwargs):
    """fla ``ShortConvolution.forward`` (cache ``[B, D, W]``)."""
    if mask is not None:
        x = x * mask.unsqueeze(-1)
    return fla_causal_conv1d(x, self.weight[:, 0], self.bias, residual, cache, output_final_state, self.activation, cu_seqlens)


def transformers_causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
    """transformers' ``causal_conv1d_fn`` (``hidden_states [B, D, L]``, already prefixed with the conv state)."""
    _reject("transformers' causal_conv1d_fn", seq_idx=kwargs.get("seq_idx"))
    return torch.ops.specla.causal_conv1d(hidden_states, weight, bias, _silu_flag(activation))


def transformers_causal_conv1d_update(hidden_states, conv_state, weight, bias=None, activation=None):
    """transformers' ``causal_conv1d_update`` (a cached decode step, ``hidden_states [B, D, T]``) as its
    multi-token path computes it: the window ``cat([conv_state, x])``, its tail written into the conv
    state, the conv over the window. Capture then sees the conv and its state write in both paths (the
    verification twin commits the state per accepted token instead of writing every token)."""
    window = torch.cat([conv_state, hidden_states], dim=-1)
    conv_state.copy_(window[..., -conv_state.shape[-1] :])
    y = torch.ops.specla.causal_conv1d(window, weight, bias, _silu_flag(activation))
    return y[..., -hidden_states.shape[-1] :]


def transformers_eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' ``eager_attention_forward`` (additive mask, explicit softmax) as the same attention
    through ``scaled_dot_product_attention``, whose mask argument the verification twin replaces by the
    tree mask. Returns no attention weights, as transformers' sdpa attention."""
    groups = query.shape[1] // key.shape[1]
    out = F.scaled_dot_product_attention(
        query,
        key.repeat_interleave(groups, dim=1),
        value.repeat_interleave(groups, dim=1),
        attn_mask=None if attention_mask is None else attention_mask[..., : key.shape[-2]],
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
    )
    return out.transpose(1, 2).contiguous(), None


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def fla_rms_norm_gated_forward(self, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    """fla ``FusedRMSNormGated.forward`` in plain PyTorch (its Triton kernel, reimplemented). The common case (a
    weight, no bias, a SiLU gate) is one ``specla::rms_norm_gated`` node, which a static twin can fold into the
    o_proj after it (``lowering/fold_norms.py``)."""
    _reject("fla's FusedRMSNormGated", residual=residual, prenorm=prenorm)
    if self.weight is not None and self.bias is None and self.activation in ("swish", "silu"):
        return torch.ops.specla.rms_norm_gated(x, g, self.weight, self.eps)
    y = _rms(x.float(), self.eps)
    if self.weight is not None:
        y = y * self.weight.float()
    if self.bias is not None:
        y = y + self.bias.float()
    gate = g.float()
    y = y * (F.silu(gate) if self.activation in ("swish", "silu") else gate.sigmoid())
    return y.to(x.dtype)


def fla_rms_norm_forward(self, x, residual=None, prenorm=False, residual_in_fp32=False):
    """fla ``RMSNorm.forward`` (optionally fused with the residual add) in plain PyTorch. The common case is one
    ``specla::rms_norm`` node (which a static twin can fold into the GEMM after it, ``lowering/fold_norms.py``)."""
    if (self.weight is not None and self.bias is None and not residual_in_fp32
            and (residual is None or residual.dtype == x.dtype)):
        y = torch.ops.specla.rms_norm(x, residual, self.weight, self.eps)
        return (y, x if residual is None else x + residual) if prenorm else y  # (the sum rounded, as fla's)
    if residual is not None:
        x = x.float() + residual.float()
        residual_out = x if residual_in_fp32 else x.to(residual.dtype)
    else:
        residual_out = x.float() if residual_in_fp32 else x
    y = _rms(x.float(), self.eps)
    if self.weight is not None:
        y = y * self.weight.float()
    if self.bias is not None:
        y = y + self.bias.float()
    y = y.to(residual.dtype if residual is not None else x.dtype)
    return (y, residual_out) if prenorm else y


def fla_swiglu_linear_forward(self, x, y, weight, bias):
    """fla ``SwiGLULinear.forward``: ``linear(silu(x) * y)``."""
    return F.linear(F.silu(x) * y, weight, bias)


def fla_rearrange(tensor: torch.Tensor, pattern: str, **axes: int) -> torch.Tensor:
    """einops' ``rearrange`` as fla's GDN layer calls it (heads split off or merged into the last
    dimension), as one ``reshape``. Dynamo traces einops' pattern parsing at every call, which made
    most of the trace of a model (about 0.1 s a call on a CPU, five calls a layer, every compile of
    every graph); other patterns go to einops."""
    if pattern == "... (h d) -> ... h d" and set(axes) == {"d"}:
        return tensor.reshape(*tensor.shape[:-1], tensor.shape[-1] // axes["d"], axes["d"])
    if pattern == "b t h d -> b t (h d)" and not axes:
        return tensor.reshape(*tensor.shape[:-2], tensor.shape[-2] * tensor.shape[-1])
    from einops import rearrange

    return rearrange(tensor, pattern, **axes)


# --- installation ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EntryPoint:
    """``owner.name`` to replace: ``owner`` is a module path, or ``module:Class`` for a method."""

    owner: str
    name: str
    make: Callable[[Callable], Callable]


def _plain_wrapper(replacement: Callable) -> Callable[[Callable], Callable]:
    """Route to ``replacement`` on the specla path, else to the original function or method."""

    def make(original: Callable) -> Callable:
        @_wraps(original)
        def wrapper(*args, **kwargs):
            if use_specla_path(_first_tensor(args, kwargs)):  # (methods: self is skipped, not a tensor)
                return replacement(*args, **kwargs)
            return original(*args, **kwargs)

        wrapper.__specla_original__ = original
        return wrapper

    return make


def _recurrence(adapter: RecurrenceAdapter) -> Callable[[Callable], Callable]:
    return lambda original: _recurrence_wrapper(original, adapter)


KNOWN_ENTRY_POINTS: list[EntryPoint] = [
    EntryPoint(FLA_GDN_LAYER, "chunk_gated_delta_rule", _recurrence(fla_recurrence_adapter)),
    EntryPoint(FLA_GDN_LAYER, "fused_recurrent_gated_delta_rule", _recurrence(fla_recurrence_adapter)),
    EntryPoint(f"{FLA_MODULES}:ShortConvolution", "forward", _plain_wrapper(fla_short_conv_forward)),
    EntryPoint(FLA_GDN_LAYER, "causal_conv1d", _plain_wrapper(fla_causal_conv1d)),
    EntryPoint(FLA_GDN_LAYER, "rearrange", _plain_wrapper(fla_rearrange)),
    EntryPoint(f"{FLA_MODULES}:FusedRMSNormGated", "forward", _plain_wrapper(fla_rms_norm_gated_forward)),
    EntryPoint(f"{FLA_MODULES}:RMSNorm", "forward", _plain_wrapper(fla_rms_norm_forward)),
    EntryPoint(f"{FLA_MLP}:SwiGLULinear", "forward", _plain_wrapper(fla_swiglu_linear_forward)),
    *(
        EntryPoint(transformers_modeling(family), name, make)
        for family in TRANSFORMERS_GDN_FAMILIES
        for name, make in (
            ("torch_chunk_gated_delta_rule", _recurrence(transformers_recurrence_adapter)),
            ("torch_recurrent_gated_delta_rule", _recurrence(transformers_recurrence_adapter)),
            ("causal_conv1d_fn", _plain_wrapper(transformers_causal_conv1d_fn)),
            ("causal_conv1d_update", _plain_wrapper(transformers_causal_conv1d_update)),
            ("eager_attention_forward", _plain_wrapper(transformers_eager_attention)),
        )
    ),
]


def _resolve_owner(owner: str) -> Any:
    module_name, _, class_name = owner.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name) if class_name else module


def _patch(owner: Any, name: str, make: Callable[[Callable], Callable]) -> bool:
    current = getattr(owner, name)
    if hasattr(current, "__specla_original__"):
        return False  # already routed
    setattr(owner, name, make(current))
    return True


def register_recurrence(owner: Any, name: str, adapter: RecurrenceAdapter) -> None:
    """Route your own GDN recurrence ``owner.name`` (a module or class attribute that your model calls
    by that name) through specla, so the ``specla`` backend can verify draft trees through it.

    ``adapter`` receives the call's own ``(*args, **kwargs)`` and returns a :class:`RecurrenceCall`;
    the function must return ``(o [B, T, HV, V], final_state or None)`` like fla's ops. Example::

        def my_adapter(q, k, v, log_decay, beta, state=None):
            return RecurrenceCall(q, k, v, log_decay, beta, initial_state=state, output_final_state=True)

        register_recurrence(my_model_module, "my_gdn", my_adapter)
    """
    if not callable(getattr(owner, name, None)):
        raise ValueError(f"{owner!r} has no callable attribute {name!r} to register as a GDN recurrence")
    _patch(owner, name, _recurrence(adapter))


def route(module_name: str) -> list[str]:
    """Route the known entry points that live in the (imported) module ``module_name``; returns them."""
    routed = []
    for entry in KNOWN_ENTRY_POINTS:
        if entry.owner.partition(":")[0] != module_name:
            continue
        try:
            owner = _resolve_owner(entry.owner)
        except AttributeError:
            continue  # not in this version
        if hasattr(owner, entry.name):
            _patch(owner, entry.name, entry.make)
            routed.append(f"{entry.owner}.{entry.name}")
    return routed


@functools.cache
def install() -> list[str]:
    """Route every known entry point that is importable here; returns the ones routed."""
    routed = []
    for module_name in sorted(ROUTED_MODULES):
        try:
            importlib.import_module(module_name)
        except ImportError:
            continue  # that family is not installed (or not in this version)
        routed += route(module_name)
    log.debug("specla capture routes %s", routed)
    return routed
