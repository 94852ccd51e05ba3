"""``generate`` in transformers' conventions: GenerationConfig, the model's EOS and pad tokens,
unsupported settings refused by name, the cache passed under its current name."""

from __future__ import annotations

import warnings

import pytest
import torch
from models import VOCAB, tiny_model
from test_generator import COMPILE, plain
from transformers import GenerationConfig, LogitsProcessorList

from specla_compile import NgramDrafter, SpecConfig, SpeculativeGenerator
from specla_compile.runtime.generation_args import DEFAULT_MAX_NEW_TOKENS, resolve


class _Model(torch.nn.Module):
    def __init__(self, **generation):
        super().__init__()
        self.generation_config = GenerationConfig(**generation)


def test_keywords_override_the_config_and_eos_and_pad_come_from_the_model():
    model = _Model(eos_token_id=[5, 6], pad_token_id=9, do_sample=True, temperature=0.3, top_k=7)
    args = resolve(model, 4, None, {}, {})
    # only EOS and pad come from the model's own config: its sampling settings are not applied
    assert (args.eos_token_ids, args.pad_token_id, args.do_sample, args.top_k) == ([5, 6], 9, False, None)
    assert args.max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    config = GenerationConfig(do_sample=True, temperature=0.5, top_k=3, top_p=0.9, max_new_tokens=7, eos_token_id=4)
    args = resolve(model, 4, config, {"temperature": 2.0}, {})
    assert (args.do_sample, args.warp, args.max_new_tokens, args.eos_token_ids) == (True, (2.0, 3, 0.9), 7, [4])
    assert resolve(model, 4, GenerationConfig(max_length=10), {}, {}).max_new_tokens == 6
    assert resolve(model, 4, None, {}, {"max_length": 5}).max_new_tokens == 1


def test_unsupported_settings_are_refused_by_name_and_neutral_values_pass():
    model = _Model()
    with pytest.raises(ValueError, match="repetition_penalty, min_new_tokens, num_return_sequences, logits_processor"):
        resolve(model, 3, None, {}, {"repetition_penalty": 1.2, "min_new_tokens": 2, "num_return_sequences": 2,
                                     "logits_processor": LogitsProcessorList([lambda ids, scores: scores])})
    with pytest.raises(ValueError, match="does not support num_beams"):
        resolve(model, 3, GenerationConfig(num_beams=4), {}, {})
    neutral = {"repetition_penalty": 1.0, "num_return_sequences": 1, "logits_processor": LogitsProcessorList()}
    assert resolve(model, 3, GenerationConfig(num_beams=1), {}, neutral).max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_new_token'"):
        resolve(model, 3, None, {}, {"max_new_token": 3})
    with pytest.raises(ValueError, match="no room after the prompt"):
        resolve(model, 3, GenerationConfig(max_length=3), {}, {})
    with pytest.raises(TypeError, match="GenerationConfig"):
        resolve(model, 3, {"max_new_tokens": 3}, {}, {})


def test_generate_stops_at_the_models_eos_and_pads_with_its_pad_token():
    model = tiny_model("fla", layers=2)
    prompts = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(21))
    refs = [plain(model, p, 10)[0][0, 4:].tolist() for p in prompts]
    eos = refs[0][3]
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, VOCAB + 2
    spec = SpeculativeGenerator(model, NgramDrafter(), SpecConfig(mode="chain", depth=3, bucket=4), compile_options=COMPILE)
    out = spec.generate(prompts, generation_config=GenerationConfig(max_new_tokens=10))
    for b, p in enumerate(prompts):
        expected = plain(model, p, 10, eos)[0][0, 4:].tolist()
        row = out.sequences[b, 4:].tolist()
        assert row[: len(expected)] == expected and all(t == VOCAB + 2 for t in row[len(expected) :])
    assert len(plain(model, prompts[0], 10, eos)[0][0, 4:]) <= 4  # row 0 did stop early


def test_hybrid_model_gets_and_reads_its_cache_under_the_current_name(monkeypatch):
    """Neither passing the cache nor reading it from a forward's output uses the deprecated name (transformers
    warns through Python's warnings, or from 5.25 through its logger's warning_once: recorded, not once)."""
    from transformers.utils import generic

    logged = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda message, *args, **kwargs: logged.append(str(message)))
    model = tiny_model("qwen3_5", layers=2)
    spec = SpeculativeGenerator(model, NgramDrafter(), SpecConfig(mode="chain", depth=3, bucket=4), compile_options=COMPILE)
    prompt = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(22))
    for engine in ("static", "dynamic"):
        spec.config = SpecConfig(mode="chain", depth=3, bucket=4, engine=engine)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = spec.generate(prompt, max_new_tokens=4)
            spec.generate(first.sequences[:, -1:], max_new_tokens=3, past_key_values=first.past_key_values)
        said = [str(w.message) for w in caught] + logged
        assert not [m for m in said if "past_key_values" in m], engine


def test_cache_is_past_key_values_under_its_current_name():
    """generate(cache=...) and output.cache: transformers' names since 5.24, for the same cache."""
    model = tiny_model("fla", layers=2)
    spec = SpeculativeGenerator(model, NgramDrafter(), SpecConfig(mode="chain", depth=3, bucket=4), compile_options=COMPILE)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(23))
    expected = plain(model, prompt[0], 9)[0]
    first = spec.generate(prompt, max_new_tokens=4)
    assert first.cache is first.past_key_values
    second = spec.generate(first.sequences[:, -1:], max_new_tokens=5, cache=first.cache)
    assert torch.cat([first.sequences, second.sequences[:, 1:]], 1).tolist() == expected.tolist()
    with pytest.raises(ValueError, match="^pass the cache to continue from as cache= or as past_key_values=, not both"):
        spec.generate(second.sequences[:, -1:], max_new_tokens=2, cache=second.cache, past_key_values=second.cache)
