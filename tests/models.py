"""Tiny random models of the three GDN families, built in-process (no hub)."""

from __future__ import annotations

import torch

FAMILIES = ("fla", "qwen3_5", "qwen3_next")
VOCAB = 97


def tiny_model(
    family: str, *, seed: int = 0, layers: int = 4, vocab: int = VOCAB, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """A small random model of ``family`` in eval mode. Hybrid families get full attention on the last
    of every 2 layers; Qwen3-Next is also MoE."""
    import specla_compile  # noqa: F401  (routes fla's GPU-only kernels to references on CPU)

    torch.manual_seed(seed)
    if family == "fla":
        from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM

        cfg = GatedDeltaNetConfig(
            hidden_size=64, num_hidden_layers=layers, num_heads=2, num_v_heads=4, head_dim=16, expand_v=1,
            vocab_size=vocab, fuse_cross_entropy=False,
        )
        model = GatedDeltaNetForCausalLM(cfg)
    elif family == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
            layer_types=["linear_attention", "full_attention"] * (layers // 2),
        )
        model = Qwen3_5ForCausalLM(cfg)
    elif family == "qwen3_next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
            layer_types=["linear_attention", "full_attention"] * (layers // 2),
        )
        model = Qwen3NextForCausalLM(cfg)
    else:
        raise ValueError(f"unknown family {family!r}")
    # random weights emit fla's default EOS (2) by chance: tests name their EOS token explicitly
    model.generation_config.eos_token_id = None
    return model.to(dtype).eval()


def left_padded_batch(lengths: tuple[int, ...], seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Random prompts of ``lengths`` tokens, and the batch of them left-padded to a common width with its
    attention mask: ``(prompts, input_ids, mask)``."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    width = max(lengths)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for b, p in enumerate(prompts):
        input_ids[b, width - p.numel() :], mask[b, width - p.numel() :] = p, 1
    return prompts, input_ids, mask
