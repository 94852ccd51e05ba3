"""``specla-generate``: speculative generation with a specla-compiled GDN model, against plain decoding.

With no arguments it runs offline on an embedded default: a small fla GatedDeltaNet over bytes, built
in-process with a fixed seed and trained for a few seconds on an embedded nursery rhyme (so that its
text, unlike a random model's, is predictable), prompted with the rhyme's first lines and drafted by
prompt lookup. It prints the generated text, the acceptance statistics and the speedup over plain
autoregressive decoding, and checks that greedy output is token-identical to plain decoding.

    specla-generate
    specla-generate --model path/to/checkpoint --prompt "Hello" --drafter eagle:path/to/head

Every argument and path is checked before anything is loaded, trained or compiled; bad input ends
with one ``error: ...`` line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    import torch

    from .runtime.config import SpecConfig
    from .runtime.drafting import Drafter

# torch, fla and transformers are imported inside the functions that use them: parsing and the path
# checks need none of them (and ``import specla_compile`` loads none of them either).

RHYME = (
    "Twinkle, twinkle, little star, how I wonder what you are! Up above the world so high, like a diamond in the sky. "
    "Twinkle, twinkle, little star, how I wonder what you are! When the blazing sun is gone, when he nothing shines "
    "upon, then you show your little light, twinkle, twinkle, all the night. Twinkle, twinkle, little star, how I "
    "wonder what you are! "
)
DEFAULT_PROMPT = RHYME[:120]
DESCRIPTION = "Speculative generation with a specla-compiled GDN model, against plain decoding of the same model."
DTYPES = ("float32", "bfloat16", "float16")
BYTES = "bytes"  # --tokenizer value: token ids are the prompt's UTF-8 bytes (as for the embedded model)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def embedded_model(seed: int = 0, steps: int = 60) -> torch.nn.Module:
    """A small GDN language model over bytes, trained for ``steps`` steps on :data:`RHYME` (seconds on
    a CPU); the same model for the same seed and steps."""
    import torch
    from fla.models import GatedDeltaNetConfig, GatedDeltaNetForCausalLM
    from tqdm import trange

    import specla_compile  # noqa: F401  (routes fla's GPU-only kernels to references on CPU)

    torch.manual_seed(seed)
    config = GatedDeltaNetConfig(
        hidden_size=128,
        num_hidden_layers=2,
        num_heads=2,
        head_dim=64,
        expand_v=1,
        vocab_size=256,
        fuse_cross_entropy=False,
    )
    model = GatedDeltaNetForCausalLM(config).train()
    model.generation_config.eos_token_id = None  # bytes of text: no end-of-text token (fla's default is 2)
    text = torch.tensor(list(RHYME.encode("utf-8")) * 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in (bar := trange(steps, desc="training the embedded model", disable=steps == 0)):
        starts = torch.randint(0, len(RHYME), (8,))
        batch = torch.stack([text[s : s + 65] for s in starts])
        logits = model(batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        bar.set_postfix(loss=f"{loss.item():.3f}")
    return model.eval()


class _Parser(argparse.ArgumentParser):
    """Reports a usage error as one ``error: ...`` line (no usage block) and exits with status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    """The command line of :func:`main`; every option's help shows its default."""
    from .backend_options import INNER_COMPILERS

    parser = _Parser(prog=prog, description=DESCRIPTION, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--model", help="local fla or transformers checkpoint directory; without it, a small GDN trained in-process")
    add("--tokenizer", help=f"tokenizer directory if not the --model one; '{BYTES}': UTF-8 bytes as token ids")
    add("--train-steps", type=int, default=60, help="training steps of the embedded model (without --model)")
    add(
        "--drafter",
        default="ngram",
        help="ngram, eagle:PATH (an EAGLE head directory) or model:PATH (a small causal LM)",
    )
    add("--draft-vocab", type=int, default=None,
        help="eagle drafter: draft only the head's N most frequent training tokens (None: every token)")
    add("--quantize", choices=("none", "int8"), default=None,
        help="eagle drafter: stream the head's weights as int8, or its own weights (if omitted: int8 on CUDA with a "
             "half-precision head, where it drafts faster; the output is unchanged either way)")
    add("--prompt", default=DEFAULT_PROMPT, help="the prompt text")
    add("--max-new-tokens", type=int, default=96, help="tokens to generate")
    add("--mode", choices=("chain", "tree"), default="tree", help="draft shape")
    add("--depth", type=int, default=4, help="draft depth (tokens per chain, levels per tree)")
    add("--tree-top-k", "--top-k", type=int, default=2, help="tree drafts: children per node and beam width")
    add("--budget", type=int, default=12, help="tree drafts: most draft nodes")
    add("--tau", type=float, default=4.0, help="tree drafts: keep nodes within this log-probability of the best")
    add("--do-sample", action="store_true", help="sample (lossless rejection sampling) instead of greedy decoding")
    add("--temperature", type=float, default=1.0, help="sampling temperature (> 0)")
    add("--sample-top-k", type=int, default=None, help="sampling: keep the k most likely tokens (0: all)")
    add("--top-p", type=float, default=None, help="sampling: keep the most likely tokens of this total mass, in (0, 1]")
    add("--device", default="auto", help="torch device; auto: cuda when available, else cpu")
    add("--dtype", choices=("auto", *DTYPES), default="auto", help="auto: bfloat16 on CUDA, float32 on CPU")
    add(
        "--inner",
        choices=("auto", *INNER_COMPILERS),
        default="auto",
        help="inner compiler; auto: inductor on CUDA, aot_eager on CPU",
    )
    add("--seed", type=int, default=0, help="seed of the embedded model and of sampling")
    add("--json", help="also write the statistics to this file")
    return parser


def _check_checkpoint(parser: argparse.ArgumentParser, path: str, what: str) -> None:
    if not os.path.exists(path):
        parser.error(f"{what} {path!r} does not exist")
    if not os.path.isfile(os.path.join(path, "config.json")):
        parser.error(f"{what} {path!r} is not a checkpoint directory: it has no config.json")


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject bad arguments and paths with ``parser.error`` (one line, exit 2) before anything is loaded."""
    if args.model is not None:
        _check_checkpoint(parser, args.model, "--model")
    elif args.tokenizer is not None:
        parser.error("--tokenizer needs --model (the embedded model reads bytes)")
    kind, _, path = args.drafter.partition(":")
    if kind not in ("ngram", "eagle", "model") or (kind == "ngram") == bool(path):
        parser.error(f"--drafter must be ngram, eagle:PATH or model:PATH, got {args.drafter!r}")
    if path:
        _check_checkpoint(parser, path, f"--drafter {kind}: path")
    if args.quantize is not None and kind != "eagle":
        parser.error("--quantize needs --drafter eagle:PATH")
    if args.draft_vocab is not None:
        from .runtime.drafters.eagle_head import has_token_ranking

        if kind != "eagle":
            parser.error("--draft-vocab needs --drafter eagle:PATH")
        if args.draft_vocab < 1:
            parser.error(f"--draft-vocab must be >= 1, got {args.draft_vocab}")
        if not has_token_ranking(path):
            parser.error(f"--draft-vocab: the EAGLE head in {path!r} has no token ranking (train it with "
                         "examples/train_eagle.py, which saves one)")
    tokenizer = args.tokenizer or args.model
    if tokenizer not in (None, BYTES):
        if not os.path.isdir(tokenizer):
            parser.error(f"--tokenizer {tokenizer!r} is not a directory")
        if not any(os.path.isfile(os.path.join(tokenizer, f)) for f in TOKENIZER_FILES):
            flag = "--tokenizer" if args.tokenizer else "--model"
            parser.error(
                f"{flag} {tokenizer!r} has no tokenizer files ({' or '.join(TOKENIZER_FILES)}); "
                f"pass --tokenizer PATH (or --tokenizer {BYTES} for a byte-level model)"
            )
    if args.train_steps < 0:
        parser.error(f"--train-steps must be >= 0, got {args.train_steps}")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.prompt:
        parser.error("--prompt is empty")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        parser.error(f"--json {args.json!r}: its directory does not exist")
    # Checks that need torch: the library's own validation, so that the rules live in one place.
    import torch

    from .runtime.acceptance import warp_probs

    try:
        spec_config(args)
        if args.do_sample or args.sample_top_k is not None or args.top_p is not None:
            warp_probs(torch.zeros(1, 1), args.temperature if args.do_sample else 1.0, args.sample_top_k, args.top_p)
    except (TypeError, ValueError) as exc:  # SpecConfig names its fields, which are our options' names
        parser.error(re.sub(r"SpecConfig\.(\w+)", lambda m: "--" + m[1].replace("_", "-"), str(exc)))
    try:
        device = resolve_device(args.device)
    except RuntimeError as exc:
        parser.error(f"--device {args.device!r}: {exc}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device!r}: CUDA is not available on this machine")


def resolve_device(name: str) -> torch.device:
    """``name`` as a device (``auto``: cuda when available, else cpu); RuntimeError for an unknown one."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def spec_config(args: argparse.Namespace) -> SpecConfig:
    """The :class:`SpecConfig` of the draft options."""
    from .runtime.config import SpecConfig

    return SpecConfig(mode=args.mode, depth=args.depth, tree_top_k=args.tree_top_k, budget=args.budget, tau=args.tau)


def load(args: argparse.Namespace) -> tuple[torch.nn.Module, Any]:
    """The target model and its tokenizer (None: token ids are bytes)."""
    if args.model is None:
        return embedded_model(args.seed, args.train_steps), None
    import fla  # noqa: F401  (registers fla's model classes with transformers' Auto classes)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(args.model)
    tokenizer_path = args.tokenizer or args.model
    return model, None if tokenizer_path == BYTES else AutoTokenizer.from_pretrained(tokenizer_path)


def make_drafter(spec: str, target: torch.nn.Module, device: torch.device, dtype: torch.dtype,
                 draft_vocab: int | None = None, quantize: str | None = None) -> Drafter:
    """The drafter named by ``--drafter`` (already checked by :func:`check_args`)."""
    from .runtime.drafters import EagleDrafter, ModelDrafter, NgramDrafter

    kind, _, path = spec.partition(":")
    if kind == "ngram":
        return NgramDrafter()
    if kind == "eagle":
        return EagleDrafter.from_pretrained(path, target, dtype=dtype, draft_vocab=draft_vocab, quantize=quantize)
    import fla  # noqa: F401  (an fla drafter checkpoint needs fla's Auto classes)

    return ModelDrafter.from_pretrained(path, device=device, dtype=dtype)


def encode(prompt: str, tokenizer: Any, device: torch.device) -> torch.Tensor:
    import torch

    if tokenizer is None:
        return torch.tensor([list(prompt.encode("utf-8"))], device=device)
    return tokenizer(prompt, return_tensors="pt").input_ids.to(device)


def decode(tokens: list[int], tokenizer: Any) -> str:
    if tokenizer is None:
        return bytes(t for t in tokens if t < 256).decode("utf-8", errors="replace")
    return tokenizer.decode(tokens)


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def explain_speed(tokens_per_pass: float, spec_pass_seconds: float, plain_pass_seconds: float, device: torch.device) -> list[str]:
    """Lines that explain a measured speedup: what one speculative pass cost against one plain step, what
    that means on a CPU, and a warning when too few drafts are accepted to pay for the larger passes."""
    cost = spec_pass_seconds / plain_pass_seconds
    lines = [
        (
            f"one speculative pass cost {cost:.2f}x a plain decoding step and emitted {tokens_per_pass:.2f} tokens "
            f"on average: speedup about {tokens_per_pass:.2f} / {cost:.2f} = {tokens_per_pass / cost:.2f}x"
        )
    ]
    if device.type == "cpu":
        lines.append(
            "on a CPU a pass is bound by arithmetic, so verifying a draft of N tokens costs about as much as several "
            "plain steps and speculation gains little; on a GPU a decoding step is bound by reading the weights, "
            "and a pass over a few dozen draft tokens costs about as much as one step"
        )
    if tokens_per_pass < cost:
        lines.append(
            f"warning: acceptance too low to pay off ({tokens_per_pass:.2f} tokens per pass, each pass costing "
            f"{cost:.2f} plain steps): use a drafter that fits the model better, or smaller drafts (--depth, --budget)"
        )
    return lines


def main(argv: Sequence[str] | None = None, prog: str | None = None) -> None:
    """Run the command line ``argv`` (None: ``sys.argv[1:]``)."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    check_args(parser, args)

    import torch

    from .runtime.baseline import autoregressive_generate
    from .runtime.generator import SpeculativeGenerator

    device = resolve_device(args.device)
    dtype = getattr(torch, args.dtype if args.dtype != "auto" else "bfloat16" if device.type == "cuda" else "float32")
    model, tokenizer = load(args)
    model = model.to(device, dtype).eval()  # (the embedded model trains on the CPU in float32 first)
    try:
        drafter = make_drafter(args.drafter, model, device, dtype, args.draft_vocab, args.quantize)
    except ValueError as exc:  # a head or LM that does not fit the target
        parser.error(f"--drafter {args.drafter!r}: {exc}")
    input_ids = encode(args.prompt, tokenizer, device)
    if input_ids.numel() == 0:
        parser.error(f"--prompt {args.prompt!r} encodes to no tokens")
    config = spec_config(args)
    inner = args.inner if args.inner != "auto" else "inductor" if device.type == "cuda" else "aot_eager"
    spec = SpeculativeGenerator(model, drafter, config, compile_options={"inner": inner})
    sampling = {
        "do_sample": args.do_sample,
        "temperature": args.temperature,
        "top_k": args.sample_top_k,
        "top_p": args.top_p,
    }
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:  # (the same EOS for both runs: generate would read it there, the baseline would not)
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)

    print(
        f"model: {args.model or 'embedded GatedDeltaNet (trained in-process)'} on {device} ({dtype}); drafter {args.drafter}; {config}"
    )
    for _ in range(2):  # compile outside the timing (the second call settles Dynamo's dynamic shapes)
        spec.generate(input_ids, max_new_tokens=min(16, args.max_new_tokens), eos_token_id=eos, **sampling)
    autoregressive_generate(model, input_ids, 2)
    torch.manual_seed(args.seed)
    out, spec_seconds = timed(
        lambda: spec.generate(input_ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos, **sampling)
    )
    torch.manual_seed(args.seed)
    (plain, _), plain_seconds = timed(
        lambda: autoregressive_generate(model, input_ids, args.max_new_tokens, eos_token_id=eos, **sampling)
    )

    new = out.sequences[0, input_ids.shape[1] :].tolist()
    stats = out.stats.summary()
    print(f"\nprompt: {args.prompt!r}\ngenerated ({len(new)} tokens): {decode(new, tokenizer)!r}\ntoken ids: {new}")
    print("\nstatistics: " + ", ".join(f"{k}={v}" for k, v in stats.items()))
    speedup = plain_seconds / spec_seconds
    print(
        f"plain decoding {plain_seconds:.3f}s ({plain.shape[1] - input_ids.shape[1]} target passes); "
        f"speculative {spec_seconds:.3f}s ({out.stats.target_passes} target passes): speedup {speedup:.2f}x"
    )
    plain_passes = plain.shape[1] - input_ids.shape[1]
    for line in explain_speed(
        out.stats.tokens_per_target_pass, spec_seconds / out.stats.target_passes, plain_seconds / plain_passes, device
    ):
        print(line)
    identical = plain[0].tolist() == out.sequences[0].tolist()
    if not args.do_sample:
        print(f"greedy output identical to plain decoding: {identical}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {**stats, "speedup": speedup, "identical": identical, "device": str(device), "dtype": str(dtype)},
                f,
                indent=2,
            )
    if not args.do_sample and not identical and dtype == torch.float32:
        raise SystemExit("greedy speculative output differs from plain decoding in float32")
