"""Plain autoregressive decoding: the reference speculative decoding must match, and the speed baseline."""

from __future__ import annotations

import torch

from .acceptance import warp_probs
from .cache_layout import cache_argument, returned_cache


@torch.no_grad()
def autoregressive_generate(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    *,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    generator: torch.Generator | None = None,
    past_key_values=None,
) -> tuple[torch.Tensor, object]:
    """Decode one token per forward pass for rows of equal length ``input_ids [B, T]``; returns the
    sequences (prompt and new tokens; a row that met EOS is padded with its EOS) and the cache, which
    holds every token but the last."""
    if input_ids.dim() != 2 or input_ids.numel() == 0:
        raise ValueError("input_ids must be a non-empty [batch, length] tensor")
    eos = torch.tensor([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or []), device=input_ids.device)
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    tokens = input_ids
    step_input = input_ids
    cache = past_key_values
    for _ in range(max_new_tokens):
        out = model(input_ids=step_input, **{cache_argument(model): cache}, use_cache=True)
        cache = returned_cache(out)
        logits = out.logits[:, -1]
        if do_sample:
            token = torch.multinomial(warp_probs(logits, temperature, top_k, top_p), 1, generator=generator)
        else:
            token = logits.argmax(-1, keepdim=True)
        token = torch.where(finished[:, None], tokens[:, -1:], token)
        tokens = torch.cat([tokens, token], dim=1)
        finished |= torch.isin(token[:, 0], eos)
        if finished.all():
            break
        step_input = token
    return tokens, cache
