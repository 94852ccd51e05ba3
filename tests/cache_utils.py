"""Test helpers: read every tensor of a model cache (fla ``Cache`` or transformers ``DynamicCache``)."""

from __future__ import annotations

import torch


def cache_tensors(cache) -> list[torch.Tensor]:
    """All state tensors of ``cache`` in a fixed order: recurrent, conv and attention K/V per layer."""
    out: list[torch.Tensor] = []
    for layer in cache.layers:
        state = getattr(layer, "state", None)
        if isinstance(state, dict):  # fla
            for name in ("recurrent_state", "conv_state", "attn_state"):
                value = state.get(name)
                if value is not None:
                    out += list(value) if isinstance(value, (tuple, list)) else [value]
            continue
        for name in ("recurrent_states", "conv_states"):  # transformers linear-attention layers
            states = getattr(layer, name, None) or {}
            out += [states[i] for i in sorted(states)] if isinstance(states, dict) else list(states)
        for name in ("keys", "values"):
            value = getattr(layer, name, None)
            if isinstance(value, torch.Tensor):
                out.append(value)
    return out


def max_cache_diff(a, b) -> float:
    ta, tb = cache_tensors(a), cache_tensors(b)
    assert len(ta) == len(tb) and ta, "caches hold different sets of tensors"
    for x, y in zip(ta, tb):
        assert x.shape == y.shape, f"cache tensor shapes differ: {tuple(x.shape)} vs {tuple(y.shape)}"
    return max((x.float() - y.float()).abs().max().item() for x, y in zip(ta, tb))
