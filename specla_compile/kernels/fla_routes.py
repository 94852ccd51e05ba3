"""CUDA route of :func:`specla::gdn_recurrence`: flash-linear-attention's own kernels."""

from __future__ import annotations

import torch

CHUNK_THRESHOLD = 64  # fla's own layer switches from fused_recurrent to chunk above this length


def fla_recurrence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    fn = fused_recurrent_gated_delta_rule if q.shape[1] <= CHUNK_THRESHOLD else chunk_gated_delta_rule
    o, final = fn(
        q=q,
        k=k,
        v=v.to(q.dtype),
        g=g.float(),
        beta=beta.to(q.dtype),
        scale=scale,
        initial_state=state.float(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
    )
    return o.to(v.dtype), final.to(state.dtype)
