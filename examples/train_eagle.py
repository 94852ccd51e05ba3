"""Train an EAGLE draft head for a target causal LM on a text corpus.

    python examples/train_eagle.py --target path/to/target --data corpus.txt more.jsonl --out eagle-head

The target (any Hugging Face-style causal LM that returns hidden states and has input/output
embeddings) runs eagerly on blocks of the corpus to produce its features (last hidden state) and
logits; the head learns to predict the next feature (Smooth-L1) and the target's next-token
distribution from it (cross-entropy), as in EAGLE. Plain-text files are read whole; ``.jsonl`` files
give one document per line in a "text" field. The tokenizer comes from the target directory (or
``--tokenizer PATH``); ``--tokenizer none`` uses raw UTF-8 bytes as token ids (targets with >= 256
tokens). The head is saved to ``--out`` with ``save_pretrained`` (load it with
``EagleDrafter.from_pretrained(out, target)``); ``--resume`` continues from the checkpoint there. The
head also keeps its training tokens ranked by frequency (``EagleDrafter(draft_vocab=N)`` drafts the N
most frequent ones).

The target's forward for the features runs in plain PyTorch by default (``--features-backend torch``:
``specla_compile.training.chunked_gdn.plain_torch_fla``, the chunked recurrence of the target's own
training and PyTorch norms, convolutions and SwiGLU, eagerly): fla's Triton kernels would autotune
every config of their chunk kernels at the first step (about 100 s on the H200). ``model`` runs the
model's own kernels. ``--max-minutes`` counts training time after the first step (see
``specla_compile.training.budget``); ``--max-wall-minutes`` caps the whole run.

Without ``--data`` it trains on the corpus of ``examples/train_target.py`` (same options, same
held-out split; the token streams cached in the target folder are reused when they were cut from
the same corpus) and reports the head's top-1 agreement with the target on held-out blocks of
each source, every ``--eval-every`` steps and at the end (``--out/report.json``):

    python examples/train_eagle.py --target runs/target --out runs/eagle

``--distill-blocks N`` (corpus mode) adds the target's own greedy text before training
(``specla_compile.training.self_distill``): N contexts cut from the training stream (conversation ones
ending at an ``ASSISTANT:`` turn, as a chat prompt does), each continued by ``--distill-new-tokens`` greedy
tokens of the target, and ``--distill-share`` of every batch's rows come from these blocks; they are saved
in ``--out`` (reused by ``--resume``), and the report adds the head's agreement on held-out contexts
continued so (``heldout_top1_distilled``, over whole blocks: context and continuation):

    python examples/train_eagle.py --target runs/target --out runs/eagle --distill-blocks 4096 --distill-minutes 0.5

At the end (corpus mode) the head's ``acceptance_temperature`` is fitted on the held-out blocks (the distilled
ones where there are some) and saved in its config: the temperature at which its probabilities estimate the
chance that the target's greedy token is the drafted one, by which tree drafts rank their nodes (report:
``acceptance_temperature``, with the head's mean top-1 probability before and after against its top-1 agreement).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from specla_compile.runtime.drafters.eagle_head import (
    EagleConfig, EagleHead, eagle_loss, fit_acceptance_temperature, greedy_pairs, rank_tokens,
)
from specla_compile.runtime.drafting import output_vocab_size
from specla_compile.training import corpus as C
from specla_compile.training.budget import TimeBudget
from specla_compile.training.chunked_gdn import DEFAULT_CHUNK, plain_torch_fla
from specla_compile.training.corpus import batch_indices, make_blocks
from specla_compile.training import TRAINER_STATE
from specla_compile.training.self_distill import DISTILL_BLOCKS, TURN_MARKER, distill_contexts, greedy_continuations

LOG_NAME = "train_log.jsonl"
REPORT_NAME = "report.json"
CALIBRATION_POSITIONS = 8192  # held-out positions the acceptance temperature is fitted on (a [N, V] fp32 tensor)
HEAD_PRECISIONS = ("fp32", "bf16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target model directory (from_pretrained)")
    p.add_argument("--data", nargs="+", default=None,
                   help="corpus files: plain text, or .jsonl with a 'text' field (default: the train_target corpus)")
    p.add_argument("--out", required=True, help="output directory for the head and the training state")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the target's), or 'none' for bytes")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=2000, help="total optimizer steps (including resumed ones)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--cls-weight", type=float, default=0.1, help="weight of the token cross-entropy term")
    p.add_argument("--unroll", type=int, default=1,
                   help="train the head also on its own predictions, this many steps deep, as drafting runs it "
                        "(EAGLE-3's training-time test; the steps' losses averaged; 1: on the target's features only)")
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--num-heads", type=int, default=None, help="head's attention heads (default: the target's)")
    p.add_argument("--intermediate-size", type=int, default=None, help="head's MLP width (default: the target's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="target dtype")
    p.add_argument("--head-precision", choices=HEAD_PRECISIONS, default="fp32",
                   help="the head's forward and backward: fp32 (every trained study so far) or bf16 autocast (fp32 "
                        "weights and optimizer, as train_target.py trains the target); the drafter runs the head in "
                        "its own dtype either way (benchmarks/eagle_train_speed.py times both)")
    p.add_argument("--resume", action="store_true", help=f"continue from {TRAINER_STATE} in --out")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="training time: stop (and save) once the steps after this run's first one (which compiles "
                        "or autotunes, and is not counted, nor is loading) have run this long")
    p.add_argument("--max-wall-minutes", type=float, default=None,
                   help="hard cap on the whole run up to the final evaluation, loading and the first step included")
    p.add_argument("--features-backend", choices=("torch", "model"), default="torch",
                   help="the target's forward for features: plain PyTorch (no Triton autotuning, no compilation) "
                        "or the model's own kernels")
    p.add_argument("--gdn-chunk", type=int, default=DEFAULT_CHUNK, help="chunk size of the torch features backend")
    p.add_argument("--eval-every", type=int, default=500, help="held-out agreement every this many steps (corpus mode)")
    p.add_argument("--eval-blocks", type=int, default=32, help="held-out blocks per source (corpus mode)")
    p.add_argument("--distill-blocks", type=int, default=0,
                   help="blocks of the target's own greedy continuations to train on too (corpus mode; 0: none)")
    p.add_argument("--distill-new-tokens", type=int, default=None,
                   help="greedy tokens per distilled block, after a context of the rest of --seq-len (default half)")
    p.add_argument("--distill-share", type=float, default=0.5, help="share of each batch's rows from distilled blocks")
    p.add_argument("--distill-batch", type=int, default=512, help="rows per greedy decoding loop of the distillation")
    p.add_argument("--distill-minutes", type=float, default=None,
                   help="stop generating distilled blocks after this long (fewer than --distill-blocks)")
    p.add_argument("--cache-features", action="store_true",
                   help="keep the target's last hidden states of the distilled blocks on the device (computed once, "
                        "before training; bf16 at the default shape: 1 MiB a block) and take their logits from its LM "
                        "head: each step then runs the target on the corpus rows only")
    C.add_corpus_arguments(p)
    args = p.parse_args(argv)
    for name in ("seq_len", "batch_size", "steps", "save_every", "eval_every", "eval_blocks", "gdn_chunk",
                 "distill_batch"):
        if getattr(args, name) < 1 or (name == "seq_len" and args.seq_len < 2):
            raise ValueError(f"--{name.replace('_', '-')} is too small: {getattr(args, name)}")
    if args.distill_new_tokens is None:
        args.distill_new_tokens = args.seq_len // 2
    if args.distill_blocks < 0 or not 0 < args.distill_share <= 1 or not 1 <= args.distill_new_tokens < args.seq_len:
        raise ValueError(f"--distill-blocks must be >= 0, --distill-share in (0, 1] and --distill-new-tokens in "
                         f"[1, {args.seq_len - 1}], got {args.distill_blocks}, {args.distill_share}, {args.distill_new_tokens}")
    if args.distill_blocks and args.data is not None:
        raise ValueError("--distill-blocks needs the shared corpus (no --data): its contexts come from its training split")
    if args.distill_blocks and args.distill_share < 1 and args.batch_size < 2:
        raise ValueError("--distill-share below 1 mixes corpus and distilled rows in a batch: needs --batch-size >= 2")
    if args.cache_features and not args.distill_blocks:
        raise ValueError("--cache-features caches the distilled blocks' features: it needs --distill-blocks")
    if not 1 <= args.unroll < args.seq_len - 1:
        raise ValueError(f"--unroll must be in [1, {args.seq_len - 2}] for --seq-len {args.seq_len}, got {args.unroll}")
    for name in ("max_minutes", "max_wall_minutes", "distill_minutes"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.data is None:
        if args.tokenizer == "none":
            raise ValueError("--tokenizer none needs --data (the shared corpus is read with the target's tokenizer)")
        C.check_corpus_arguments(args)
    return args


def read_corpus(paths: list[str]) -> list[str]:
    """Documents of every file: a whole plain-text file, or each line's "text" of a .jsonl file."""
    docs = []
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"corpus file not found: {path}")
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8") as f:
                for i, line in enumerate(f, 1):
                    if line.strip():
                        record = json.loads(line)
                        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                            raise ValueError(f"{path}:{i}: every .jsonl line needs a string 'text' field")
                        docs.append(record["text"])
        else:
            docs.append(Path(path).read_text(encoding="utf-8"))
    return docs


def tokenize(docs: list[str], tokenizer: str | None, target_dir: str, vocab_size: int) -> list[int]:
    """All documents as one token stream (documents end with EOS when the tokenizer has one)."""
    if tokenizer == "none":
        if vocab_size < 256:
            raise ValueError(f"--tokenizer none needs a target vocabulary of >= 256 tokens, got {vocab_size}")
        return [b for doc in docs for b in doc.encode("utf-8")]
    tok = AutoTokenizer.from_pretrained(tokenizer or target_dir)
    ids = []
    for doc in docs:
        ids.extend(tok(doc, add_special_tokens=False)["input_ids"])
        if tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)
    if ids and max(ids) >= vocab_size:
        raise ValueError(f"the tokenizer produces id {max(ids)} but the target's vocabulary has {vocab_size} tokens")
    return ids


def corpus_streams(args: argparse.Namespace) -> dict[str, dict[str, np.ndarray]]:
    """The shared corpus as token streams: cached by train_target in the target folder (or by an
    earlier run in --out) when cut from the same corpus with the same tokenizer, else tokenized now."""
    signature = C.corpus_signature(args)
    for folder in ([args.target] if args.tokenizer is None else []) + [args.out]:
        if (streams := C.load_streams(folder, signature)) is not None:
            return streams
    tok = AutoTokenizer.from_pretrained(args.tokenizer or args.target)
    streams = C.encode_corpus(tok, C.read_corpus(args), tok.eos_token_id)
    C.save_streams(args.out, streams, signature)
    return streams


@torch.no_grad()
def heldout_agreement(
    head: EagleHead, target: torch.nn.Module, blocks: dict[str, torch.Tensor], args: argparse.Namespace
) -> dict:
    """Top-1 agreement of the head's next-token prediction with the target's, per held-out source
    and over all (the fraction of positions where a one-token draft would be accepted greedily); with
    ``--unroll``, also of each later step (``top1_s``: the head on its own predictions, s - 1 levels deep)."""
    was_training = head.training
    head.eval()
    out, hits, total = {}, {}, 0
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    for source, source_blocks in blocks.items():
        agree, count = {}, 0
        for i in range(0, len(source_blocks), args.batch_size):
            ids = source_blocks[i : i + args.batch_size].to(args.device)
            feats = target(input_ids=ids, output_hidden_states=True)
            _, stats = eagle_loss(head, embed, lm_head, ids, feats.hidden_states[-1], feats.logits, args.cls_weight,
                                  args.unroll)
            n = ids.shape[0] * (ids.shape[1] - 1)  # (later steps have a few positions less: weighted alike)
            for key in (k for k in stats if k.startswith("top1")):
                agree[key] = agree.get(key, 0.0) + stats[key] * n
            count += n
        out[source] = {**{k: v / count for k, v in agree.items()}, "positions": count}
        hits = {k: hits.get(k, 0.0) + v for k, v in agree.items()}
        total += count
    out["all"] = {**{k: v / total for k, v in hits.items()}, "positions": total}
    head.train(was_training)
    return out


@torch.no_grad()
def calibrate(head: EagleHead, target: torch.nn.Module, blocks: dict[str, torch.Tensor], args: argparse.Namespace) -> dict:
    """Fit the head's ``acceptance_temperature`` (``fit_acceptance_temperature``) on held-out ``blocks``: the head's
    logits at up to ``CALIBRATION_POSITIONS`` random positions of every unrolled step, labelled with the target's
    greedy token. Returns its report: the temperature; the cross-entropy of the greedy tokens before and after; the
    head's mean top-1 probability before and after, against its top-1 agreement (calibrated, the two come closer)."""
    was_training = head.training
    head.eval()
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    batches = [batch for source_blocks in blocks.values() for batch in source_blocks.split(args.batch_size)]
    quota = max(1, CALIBRATION_POSITIONS // len(batches))
    generator = torch.Generator().manual_seed(args.seed)
    logits, labels = [], []
    for ids in batches:
        ids = ids.to(args.device)
        out = target(input_ids=ids, output_hidden_states=True)
        z, y = greedy_pairs(head, embed, lm_head, ids, out.hidden_states[-1], out.logits, args.unroll)
        keep = torch.randperm(len(y), generator=generator)[:quota].to(y.device)
        logits.append(z[keep])
        labels.append(y[keep])
    logits, labels = torch.cat(logits), torch.cat(labels)
    temperature = fit_acceptance_temperature(logits, labels)
    head.config.acceptance_temperature = temperature
    head.train(was_training)

    def mean_top1(t: float) -> float:
        return round(float(torch.softmax(logits / t, -1).amax(-1).mean()), 4)

    def nll(t: float) -> float:  # of the target's greedy tokens
        return round(float(torch.nn.functional.cross_entropy(logits / t, labels)), 4)

    return {"temperature": round(temperature, 4), "positions": len(labels), "sources": sorted(blocks),
            "top1_agreement": round(float((logits.argmax(-1) == labels).float().mean()), 4),
            "mean_top1_probability": {"raw": mean_top1(1.0), "calibrated": mean_top1(temperature)},
            "greedy_token_nll": {"raw": nll(1.0), "calibrated": nll(temperature)}}


def features_backend(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """Where the target's forward runs: plain PyTorch (``--features-backend torch``) or its own kernels."""
    return plain_torch_fla(args.gdn_chunk) if args.features_backend == "torch" else contextlib.nullcontext()


def distilled_blocks(
    args: argparse.Namespace, target: torch.nn.Module, streams: dict[str, dict[str, np.ndarray]], marker: list[int],
    split: str, count: int, max_seconds: float | None = None,
) -> torch.Tensor:
    """``[n, seq_len]``: contexts of ``split`` (conversation ones ending at the token ids ``marker``) continued by
    the target's own greedy tokens."""
    contexts = distill_contexts({s: v[split] for s, v in streams.items()}, count, args.seq_len - args.distill_new_tokens,
                                args.seed, ends_with={"sharegpt": marker})
    with features_backend(args):
        return greedy_continuations(target, contexts, args.distill_new_tokens, args.distill_batch, max_seconds)


def self_distillation(
    args: argparse.Namespace, target: torch.nn.Module, streams: dict[str, dict[str, np.ndarray]], marker: list[int]
) -> tuple[torch.Tensor, dict]:
    """The distilled training blocks (generated now, or an earlier run's from ``--out`` on ``--resume``) and
    their report."""
    path = os.path.join(args.out, DISTILL_BLOCKS)
    report = {"new_tokens": args.distill_new_tokens, "share": args.distill_share}
    if args.resume and os.path.isfile(path):
        saved = torch.load(path)
        if (saved["blocks"].shape[1], saved["new_tokens"]) != (args.seq_len, args.distill_new_tokens):
            raise ValueError(f"--resume: {path} holds blocks of {saved['blocks'].shape[1]} tokens ending in "
                             f"{saved['new_tokens']} greedy ones, not --seq-len {args.seq_len} and "
                             f"--distill-new-tokens {args.distill_new_tokens}")
        blocks, report["reused"] = saved["blocks"], True
        print(f"self-distillation: reusing {len(blocks)} blocks from {path}")
    else:
        started = time.perf_counter()
        cap = None if args.distill_minutes is None else 60 * args.distill_minutes
        blocks = distilled_blocks(args, target, streams, marker, "train", args.distill_blocks, cap)
        torch.save({"blocks": blocks, "new_tokens": args.distill_new_tokens}, path)
        seconds = time.perf_counter() - started
        report.update(seconds=round(seconds, 1), new_tokens_per_second=round(len(blocks) * args.distill_new_tokens / seconds))
        print(f"self-distillation: {len(blocks)} blocks of {args.seq_len - args.distill_new_tokens} context + "
              f"{args.distill_new_tokens} greedy tokens in {seconds:.0f} s; {args.distill_share:.0%} of each batch")
    return blocks, {"blocks": len(blocks), **report}


def head_optimizer(head: EagleHead, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(head.parameters(), lr=lr, betas=(0.9, 0.95))


def head_precision(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """The head's math in a training step: bf16 autocast (``--head-precision bf16``) or its fp32 weights as they are."""
    if args.head_precision == "bf16":
        return torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def block_features(target: torch.nn.Module, blocks: torch.Tensor, args: argparse.Namespace) -> torch.Tensor:
    """The target's last hidden states of ``blocks [n, T]``, ``[n, T, D]`` on the device (``--cache-features``)."""
    out = []
    with features_backend(args):
        for batch in tqdm(blocks.split(args.batch_size), desc="target features of the distilled blocks", unit="batch"):
            result = target(input_ids=batch.to(args.device), output_hidden_states=True)
            out.append(result.hidden_states[-1])
            if len(out) == 1 and not torch.allclose(target.get_output_embeddings()(out[0]), result.logits, rtol=1e-2, atol=1e-2):
                raise ValueError("--cache-features: this target's logits are not its LM head over its last hidden state "
                                 "(a final scaling or soft cap?): train without --cache-features")
    return torch.cat(out)


def train_step(head: EagleHead, target: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor,
               args: argparse.Namespace, known: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """One optimizer step of the head on the blocks ``ids [B, T]`` (on the device): the target's features and
    logits (in the caller's ``features_backend``), EAGLE's loss in ``--head-precision``, its backward and the
    clipped step. ``known [k, T, D]``: the target's last hidden states of the last ``k`` rows, cached
    (:func:`block_features`): the target runs on the other rows, and the LM head gives those rows' logits (the
    target's own logits are its LM head over that state). Returns the loss (a device tensor) and the step's
    statistics."""
    lm_head = target.get_output_embeddings()
    rows = ids.shape[0] - (0 if known is None else known.shape[0])
    parts = []
    with torch.no_grad():
        if rows:
            out = target(input_ids=ids[:rows], output_hidden_states=True)
            parts.append((out.hidden_states[-1], out.logits))
        if known is not None:
            parts.append((known, lm_head(known)))
    features, logits = (torch.cat(p) for p in zip(*parts))
    with head_precision(args):
        loss, stats = eagle_loss(head, target.get_input_embeddings(), lm_head, ids, features, logits, args.cls_weight,
                                 args.unroll)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(head.parameters(), args.grad_clip)
    optimizer.step()
    return loss, stats


def save_checkpoint(out: str, head: EagleHead, optimizer: torch.optim.Optimizer, step: int) -> None:
    head.save_pretrained(out)
    torch.save({"step": step, "optimizer": optimizer.state_dict()}, os.path.join(out, TRAINER_STATE))


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    """Train; returns this run's per-step log records (also appended to ``--out/train_log.jsonl``)."""
    launched = time.perf_counter()
    args = parse_args(argv)
    with contextlib.suppress(ImportError):  # fla registers its models with transformers' Auto classes on import
        import fla  # noqa: F401  (specla_compile no longer imports it: a fresh process would not know the target)
    torch.manual_seed(args.seed)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    target.requires_grad_(False)
    os.makedirs(args.out, exist_ok=True)
    state_file = os.path.join(args.out, TRAINER_STATE)
    if args.resume and not os.path.isfile(state_file):  # (before the slow data preparation and distillation)
        raise ValueError(f"--resume: no checkpoint in {args.out} ({TRAINER_STATE} missing)")
    heldout, distilled, distill_report, heldout_distilled = {}, None, None, None
    if args.data is not None:
        blocks = make_blocks(
            tokenize(read_corpus(args.data), args.tokenizer, args.target, output_vocab_size(target)), args.seq_len
        )
    else:  # the target's own corpus: train split to train on, held-out split to measure agreement
        streams = corpus_streams(args)
        blocks = make_blocks(C.training_stream(streams), args.seq_len)
        heldout = C.heldout_blocks(streams, args.seq_len, args.eval_blocks)
        if (top := int(blocks.max())) >= (vocab := output_vocab_size(target)):
            raise ValueError(f"the corpus has token id {top}; the target's vocabulary has {vocab}")
        if args.distill_blocks:
            tok = AutoTokenizer.from_pretrained(args.tokenizer or args.target)
            marker = tok(TURN_MARKER, add_special_tokens=False)["input_ids"]
            distilled, distill_report = self_distillation(args, target, streams, marker)
            heldout_distilled = {"distilled": distilled_blocks(args, target, streams, marker, "heldout", args.eval_blocks)}

    if args.resume:
        head = EagleHead.from_pretrained(args.out, device=args.device, dtype=torch.float32)
        head.config.check_target(target)
        state = torch.load(state_file, map_location=args.device)
    else:
        overrides = {
            k: v for k, v in (("num_heads", args.num_heads), ("intermediate_size", args.intermediate_size)) if v
        }
        head = EagleHead(EagleConfig.for_target(target, **overrides)).to(args.device)
        state = {"step": 0}
    # the training tokens by frequency (the target's own text included), saved with the head:
    # EagleDrafter(draft_vocab=N) drafts the first N
    head.set_token_ranking(rank_tokens(blocks if distilled is None else torch.cat([blocks, distilled]), head.config.vocab_size))
    optimizer = head_optimizer(head, args.lr)
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])

    history, agreement, done = [], None, state["step"]
    head.train()
    budget = TimeBudget(args.max_minutes, args.max_wall_minutes, launched)
    # (a share below 1 leaves at least one corpus row; parse_args made sure there is room for both)
    distill_rows = 0 if distilled is None else min(args.batch_size - (args.distill_share < 1),
                                                   max(1, round(args.distill_share * args.batch_size)))
    known = block_features(target, distilled, args) if args.cache_features else None  # (a distilled block's features)
    bar = tqdm(range(state["step"], args.steps), initial=state["step"], total=args.steps, desc="train eagle head")
    with features_backend(args), open(os.path.join(args.out, LOG_NAME), "a") as log:
        for step in bar:
            tic = time.perf_counter()
            ids, cached = blocks[batch_indices(len(blocks), step, args.batch_size - distill_rows, args.seed)], None
            if distill_rows:
                rows = batch_indices(len(distilled), step, distill_rows, args.seed)
                ids, cached = torch.cat([ids, distilled[rows]]), None if known is None else known[rows.to(known.device)]
            loss, stats = train_step(head, target, optimizer, ids.to(args.device), args, cached)
            record = {"step": step + 1, "loss": loss.item(), **stats}  # (.item() waits for the GPU)
            done = step + 1
            history.append(record)
            log.write(json.dumps(record) + "\n")
            bar.set_postfix(loss=f"{record['loss']:.4f}", top1=f"{stats['top1']:.3f}", refresh=False)
            if (line := budget.step_done(time.perf_counter() - tic)) is not None:
                bar.write(line)
            if heldout and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
                agreement = heldout_agreement(head, target, heldout, args)
                log.write(json.dumps({"step": step + 1, "heldout": agreement}) + "\n")
                bar.write(f"step {step + 1}: held-out top-1 agreement "
                          + ", ".join(f"{s} {v['top1']:.3f}" for s, v in agreement.items()))
            if (step + 1) % args.save_every == 0:
                save_checkpoint(args.out, head, optimizer, step + 1)
            if budget.out_of_time() and done < args.steps:
                bar.write(f"{budget.reason()}: stopping after step {done} of {args.steps}")
                if done % args.eval_every:  # the last agreement measured is of an earlier step
                    agreement = None
                break
        budget.end()
        calibration = None
        if heldout:  # the target's own continuations where there are some: what the tree drafts for
            calibration = calibrate(head, target, heldout_distilled or heldout, args)
            print(f"acceptance temperature {calibration['temperature']:.3f}: mean top-1 probability "
                  f"{calibration['mean_top1_probability']['raw']:.3f} -> {calibration['mean_top1_probability']['calibrated']:.3f}, "
                  f"top-1 agreement {calibration['top1_agreement']:.3f} ({calibration['positions']} held-out positions)")
        save_checkpoint(args.out, head, optimizer, done)
        if heldout:
            agreement = agreement or heldout_agreement(head, target, heldout, args)
            report = {"steps": done, "steps_planned": args.steps, "complete": done >= args.steps,
                      "wall_seconds": time.perf_counter() - launched, "time_budget": budget.report(),
                      "features_backend": args.features_backend, "head_precision": args.head_precision,
                      "cache_features": args.cache_features,
                      "heldout_top1": agreement,
                      "last_step": history[-1] if history else None, "head": dataclasses.asdict(head.config),
                      "acceptance_temperature": calibration}
            if heldout_distilled is not None:  # whole blocks: held-out contexts and the target's continuations
                report["self_distillation"] = distill_report
                report["heldout_top1_distilled"] = heldout_agreement(head, target, heldout_distilled, args)["distilled"]
                agreement = {**agreement, "distilled": report["heldout_top1_distilled"]}
            Path(args.out, REPORT_NAME).write_text(json.dumps(report, indent=1, default=str))
            summary = ", ".join(f"{s} {v['top1']:.3f}" for s, v in agreement.items())
            print(f"held-out top-1 agreement with the target: {summary}")
    return history


if __name__ == "__main__":
    main()
