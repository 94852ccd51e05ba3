"""What the runtime does not support yet is refused with one line that names the limitation."""

from __future__ import annotations

import pytest
import torch
from models import VOCAB, tiny_model
from test_generator import COMPILE

from specla_compile import NgramDrafter, SpecConfig, SpeculativeGenerator
from specla_compile.runtime.cache_layout import cache_slots


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_fla_cache_with_attention_layers_is_refused():
    layer = type("FlaLayer", (), {"state": {"recurrent_state": torch.zeros(1), "attn_state": (torch.zeros(1),)}})()
    cache = type("FlaCache", (), {"layers": [layer]})()
    with pytest.raises(NotImplementedError) as error:
        cache_slots(cache)
    assert "fla models with attention layers are not supported" in _one_line(error)


def test_continuing_a_batched_hybrid_cache_from_elsewhere_is_refused():
    """Which attention columns of each row hold tokens is known only for caches this generator returned."""
    model = tiny_model("qwen3_5", layers=2)
    spec = SpeculativeGenerator(model, NgramDrafter(), SpecConfig(mode="chain", depth=2, bucket=4), compile_options=COMPILE)
    prompts = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(40))
    with torch.no_grad():
        cache = model(prompts[:, :-1], use_cache=True).past_key_values
    with pytest.raises(NotImplementedError) as error:
        spec.generate(prompts[:, -1:], max_new_tokens=3, past_key_values=cache)
    assert "continuing a batched hybrid-model cache needs the cache that a call of this generator returned" in _one_line(error)