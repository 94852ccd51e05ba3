"""The arguments of ``generate`` in transformers' conventions: keywords, a ``GenerationConfig`` and the
model's own ``generation_config``, resolved into the few settings speculative decoding supports.

Precedence, as in transformers: explicit keywords, then the ``generation_config`` passed to the call.
From the model's ``generation_config`` only the EOS and pad tokens are taken (its sampling settings,
which many checkpoints ship, would silently turn greedy calls into sampling ones). Every other setting
that would change the output (penalties, extra processors, beams, several sequences per prompt) is
refused by name: applying it per draft node would break the equality with plain decoding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig

DEFAULT_MAX_NEW_TOKENS = 32
SUPPORTED = ("max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id")
# GenerationConfig fields that do not change the tokens generated here
IGNORED = frozenset(
    {"bos_token_id", "decoder_start_token_id", "use_cache", "output_attentions", "output_hidden_states",
     "transformers_version", "_from_model_config", "cache_implementation", "cache_config", "compile_config",
     "disable_compile", "renormalize_logits", "remove_invalid_values"}
)
# values of unsupported fields that leave generation unchanged
NEUTRAL = {
    "num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "min_new_tokens": 0, "min_length": 0,
    "no_repeat_ngram_size": 0, "length_penalty": 1.0, "typical_p": 1.0, "min_p": 0.0, "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0, "diversity_penalty": 0.0, "num_beam_groups": 1, "guidance_scale": 1.0,
    "return_dict_in_generate": False, "output_scores": False, "output_logits": False,
}
# keywords of transformers' generate that are not GenerationConfig fields
CALL_KEYWORDS = frozenset(
    {"logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus", "assistant_model",
     "negative_prompt_ids", "negative_prompt_attention_mask", "use_model_defaults", "custom_generate", "tokenizer"}
)


@dataclass
class GenerationArgs:
    """The resolved settings of one ``generate`` call."""

    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    eos_token_ids: list[int]
    pad_token_id: int | None

    @property
    def warp(self) -> tuple[float, int | None, float | None]:
        """``(temperature, top_k, top_p)``, the arguments of :func:`~.acceptance.warp_probs`."""
        return self.temperature, self.top_k, self.top_p


def token_list(token_ids: int | list[int] | torch.Tensor | None) -> list[int]:
    """EOS token ids in any of transformers' forms as a list (empty: none)."""
    if token_ids is None:
        return []
    if isinstance(token_ids, torch.Tensor):
        return [int(t) for t in token_ids.flatten()]
    return [int(token_ids)] if isinstance(token_ids, int) else [int(t) for t in token_ids]


def _is_set(name: str, value: Any) -> bool:
    if value is None or name in IGNORED:
        return False
    if name in NEUTRAL:
        return value != NEUTRAL[name]
    return not (isinstance(value, (list, tuple, dict)) and not value)


@functools.cache
def _generation_config_fields() -> frozenset[str]:  # (once: building a GenerationConfig costs 0.3 ms)
    return frozenset(GenerationConfig().to_dict())


def unsupported(generation_config: GenerationConfig | None, kwargs: dict[str, Any]) -> list[str]:
    """Names of the settings of ``generation_config`` and ``kwargs`` that speculative decoding here does
    not support (set to a value that would change the output)."""
    fields = _generation_config_fields()
    names = []
    if generation_config is not None:
        names += [n for n, v in generation_config.to_dict().items() if n not in SUPPORTED and _is_set(n, v)]
    for name, value in kwargs.items():
        if name in SUPPORTED:
            continue
        if name in fields or name in CALL_KEYWORDS:
            if _is_set(name, value) and name not in names:
                names.append(name)
        else:
            raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
    return names


def resolve(
    model: torch.nn.Module,
    prompt_length: int,
    generation_config: GenerationConfig | None,
    explicit: dict[str, Any],
    extra: dict[str, Any],
) -> GenerationArgs:
    """The settings of a ``generate`` call on ``model`` (prompts of ``prompt_length`` tokens, padding
    included, for ``max_length``). ``explicit``: the supported keywords as given (None: not given);
    ``extra``: every other keyword. Raises ``ValueError`` naming each unsupported setting."""
    if generation_config is not None and not isinstance(generation_config, GenerationConfig):
        raise TypeError(f"generation_config must be a transformers GenerationConfig, got {type(generation_config).__name__}")
    refused = unsupported(generation_config, extra)
    if refused:
        raise ValueError(
            f"generate does not support {', '.join(refused)}: speculative decoding here supports greedy decoding and "
            f"sampling with temperature, top_k and top_p (settings that change the target's distribution per draft "
            f"node would break the equality with plain decoding)"
        )
    given = generation_config.to_dict() if generation_config is not None else {}
    explicit = {**explicit, **{name: value for name, value in extra.items() if name in SUPPORTED}}
    model_config = getattr(model, "generation_config", None)

    def pick(name: str, model_default: bool = False) -> Any:
        if explicit.get(name) is not None:
            return explicit[name]
        if given.get(name) is not None:
            return given[name]
        return getattr(model_config, name, None) if model_default else None

    max_new_tokens = pick("max_new_tokens")
    if max_new_tokens is None and pick("max_length") is not None:
        max_new_tokens = pick("max_length") - prompt_length
        if max_new_tokens <= 0:
            raise ValueError(f"max_length {pick('max_length')} leaves no room after the prompt of {prompt_length} tokens")
    max_new_tokens = DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    return GenerationArgs(
        max_new_tokens=max_new_tokens,
        do_sample=bool(pick("do_sample")),
        temperature=1.0 if pick("temperature") is None else pick("temperature"),
        top_k=pick("top_k"),
        top_p=pick("top_p"),
        eos_token_ids=token_list(pick("eos_token_id", model_default=True)),
        pad_token_id=pick("pad_token_id", model_default=True),
    )
