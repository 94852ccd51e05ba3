"""Speculative generation with a specla-compiled GDN model, against plain decoding of the same model.

With no arguments it runs offline on an embedded default: a small fla GatedDeltaNet over bytes, built
in-process with a fixed seed and trained for a few seconds on an embedded nursery rhyme (so that its
text, unlike a random model's, is predictable), prompted with the rhyme's first lines and drafted by
prompt lookup. It prints the generated text, the acceptance statistics and the speedup over plain
autoregressive decoding, and checks that greedy output is token-identical to plain decoding.

    python examples/generate.py
    python examples/generate.py --model path/to/checkpoint --prompt "Hello" --drafter eagle:path/to/head
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from specla_compile import EagleDrafter, ModelDrafter, NgramDrafter, SpecConfig, SpeculativeGenerator
from specla_compile.runtime.baseline import autoregressive_generate

RHYME = (
    "Twinkle, twinkle, little star, how I wonder what you are! Up above the world so high, like a diamond in the sky. "
    "Twinkle, twinkle, little star, how I wonder what you are! When the blazing sun is gone, when he nothing shines "
    "upon, then you show your little light, twinkle, twinkle, all the night. Twinkle, twinkle, little star, how I "
    "wonder what you are! "
)
DEFAULT_PROMPT = RHYME[:120]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def embedded_model(seed: int = 0, steps: int = 60) -> torch.nn.Module:
    """A small GDN language model over bytes, trained for ``steps`` steps on :data:`RHYME` (seconds on
    a CPU); the same model for the same seed."""
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    from tqdm import trange

    torch.manual_seed(seed)
    config = GatedDeltaNetConfig(
        hidden_size=128, num_hidden_layers=2, num_heads=2, head_dim=64, expand_v=1, vocab_size=256, fuse_cross_entropy=False
    )
    model = GatedDeltaNetForCausalLM(config).train()
    text = torch.tensor(list(RHYME.encode("utf-8")) * 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in (bar := trange(steps, desc="training the embedded model")):
        starts = torch.randint(0, len(RHYME), (8,))
        batch = torch.stack([text[s : s + 65] for s in starts])
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    return model.eval()


def load(args) -> tuple[torch.nn.Module, object | None]:
    """The target model and its tokenizer (None: token ids are bytes)."""
    if args.model is None:
        return embedded_model(args.seed), None
    import fla  # noqa: F401  (registers fla's model classes with transformers' Auto classes)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer


def make_drafter(spec: str, target: torch.nn.Module, device, dtype):
    kind, _, path = spec.partition(":")
    if kind == "ngram":
        return NgramDrafter()
    if kind == "eagle" and path:
        return EagleDrafter.from_pretrained(path, target, dtype=dtype)
    if kind == "model" and path:
        return ModelDrafter.from_pretrained(path, torch_dtype=dtype).to(device)
    raise SystemExit(f"--drafter must be ngram, eagle:PATH or model:PATH, got {spec!r}")


def encode(prompt: str, tokenizer, device) -> torch.Tensor:
    if tokenizer is None:
        return torch.tensor([list(prompt.encode("utf-8"))], device=device)
    return tokenizer(prompt, return_tensors="pt").input_ids.to(device)


def decode(tokens: list[int], tokenizer) -> str:
    if tokenizer is None:
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
    return tokenizer.decode(tokens)


def timed(fn):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", help="local fla or transformers checkpoint directory (default: embedded random model)")
    parser.add_argument("--drafter", default="ngram", help="ngram, eagle:PATH or model:PATH")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--mode", choices=("chain", "tree"), default="tree")
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--budget", type=int, default=12)
    parser.add_argument("--tau", type=float, default=4.0)
    parser.add_argument("--do-sample", action="store_true")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--sample-top-k", type=int, default=None, help="top-k filter of sampling")
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--inner", default=None, help="inner compiler (default: inductor on CUDA, aot_eager on CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the statistics to this file")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    model, tokenizer = load(args)
    model = model.to(device, dtype).eval()  # (the embedded model trains on the CPU in float32 first)
    drafter = make_drafter(args.drafter, model, device, dtype)
    config = SpecConfig(mode=args.mode, depth=args.depth, top_k=args.top_k, budget=args.budget, tau=args.tau)
    inner = args.inner or ("inductor" if device.type == "cuda" else "aot_eager")
    spec = SpeculativeGenerator(model, drafter, config, compile_options={"inner": inner})
    input_ids = encode(args.prompt, tokenizer, device)
    sampling = dict(do_sample=args.do_sample, temperature=args.temperature, top_k=args.sample_top_k, top_p=args.top_p)
    eos = getattr(tokenizer, "eos_token_id", None)

    print(f"model: {args.model or 'embedded GatedDeltaNet (trained in-process)'} on {device} ({dtype}); drafter {args.drafter}; {config}")
    for _ in range(2):  # compile outside the timing (the second call settles Dynamo's dynamic shapes)
        spec.generate(input_ids, max_new_tokens=16, eos_token_id=eos, **sampling)
    autoregressive_generate(model, input_ids, 2)
    torch.manual_seed(args.seed)
    out, spec_seconds = timed(lambda: spec.generate(input_ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos, **sampling))
    torch.manual_seed(args.seed)
    (plain, _), plain_seconds = timed(lambda: autoregressive_generate(model, input_ids, args.max_new_tokens, eos_token_id=eos, **sampling))

    new = out.sequences[0, input_ids.shape[1] :].tolist()
    stats = out.stats.summary()
    print(f"\nprompt: {args.prompt!r}\ngenerated ({len(new)} tokens): {decode(new, tokenizer)!r}\ntoken ids: {new}")
    print("\nstatistics: " + ", ".join(f"{k}={v}" for k, v in stats.items()))
    speedup = plain_seconds / spec_seconds
    print(f"plain decoding {plain_seconds:.3f}s ({plain.shape[1] - input_ids.shape[1]} target passes); "
          f"speculative {spec_seconds:.3f}s ({out.stats.target_passes} target passes): speedup {speedup:.2f}x")
    identical = plain[0].tolist() == out.sequences[0].tolist()
    if not args.do_sample:
        print(f"greedy output identical to plain decoding: {identical}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**stats, "speedup": speedup, "identical": identical, "device": str(device), "dtype": str(dtype)}, f, indent=2)
    if not args.do_sample and not identical and dtype == torch.float32:
        raise SystemExit("greedy speculative output differs from plain decoding in float32")


if __name__ == "__main__":
    main()
