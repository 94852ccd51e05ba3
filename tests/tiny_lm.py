"""Tiny non-GDN causal LMs built in-process (they run on CPU without fla's kernels); no hub."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM


def tiny_lm(
    kind: str = "llama",
    *,
    vocab: int = 300,
    hidden: int = 32,
    layers: int = 2,
    seed: int = 0,
    init_std: float = 0.02,
    dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """A random ``kind`` ("llama" or "qwen3") causal LM in eval mode; weights drawn with ``init_std``
    (a larger one makes attention sharp, so positions and masks change the logits visibly)."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=init_std,
    )
    if kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // 4, **common))
    else:
        raise ValueError(f"unknown kind {kind!r}")
    return model.to(dtype).eval()


def features_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model's last hidden state over a 1-D token sequence, ``[T, D]``."""
    with torch.no_grad():
        return model(input_ids=tokens[None], output_hidden_states=True).hidden_states[-1][0]
