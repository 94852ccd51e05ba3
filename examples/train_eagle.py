"""Train an EAGLE draft head for a target causal LM on a text corpus.

    python examples/train_eagle.py --target path/to/target --data corpus.txt more.jsonl --out eagle-head

The target (any Hugging Face-style causal LM that returns hidden states and has input/output
embeddings) runs eagerly on blocks of the corpus to produce its features (last hidden state) and
logits; the head learns to predict the next feature (Smooth-L1) and the target's next-token
distribution from it (cross-entropy), as in EAGLE. Plain-text files are read whole; ``.jsonl`` files
give one document per line in a "text" field. The tokenizer comes from the target directory (or
``--tokenizer PATH``); ``--tokenizer none`` uses raw UTF-8 bytes as token ids (targets with >= 256
tokens). The head is saved to ``--out`` with ``save_pretrained`` (load it with
``EagleDrafter.from_pretrained(out, target)``); ``--resume`` continues from the checkpoint there.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from specla_compile.runtime.drafters.eagle_head import EagleConfig, EagleHead, eagle_loss
from specla_compile.runtime.drafting import output_vocab_size

STATE_NAME = "trainer_state.pt"
LOG_NAME = "train_log.jsonl"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True, help="target model directory (from_pretrained)")
    p.add_argument("--data", required=True, nargs="+", help="corpus files: plain text, or .jsonl with a 'text' field")
    p.add_argument("--out", required=True, help="output directory for the head and the training state")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the target's), or 'none' for bytes")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=2000, help="total optimizer steps (including resumed ones)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--cls-weight", type=float, default=0.1, help="weight of the token cross-entropy term")
    p.add_argument("--grad-clip", type=float, default=0.5)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--num-heads", type=int, default=None, help="head's attention heads (default: the target's)")
    p.add_argument("--intermediate-size", type=int, default=None, help="head's MLP width (default: the target's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="target dtype")
    p.add_argument("--resume", action="store_true", help=f"continue from {STATE_NAME} in --out")
    args = p.parse_args(argv)
    for name in ("seq_len", "batch_size", "steps", "save_every"):
        if getattr(args, name) < 1 or (name == "seq_len" and args.seq_len < 2):
            raise ValueError(f"--{name.replace('_', '-')} is too small: {getattr(args, name)}")
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


def make_blocks(ids: list[int], seq_len: int) -> torch.Tensor:
    """Consecutive ``[n, seq_len]`` blocks of the token stream (the incomplete tail is dropped)."""
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than one block of --seq-len {seq_len}")
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


def batch_indices(num_blocks: int, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """Blocks of optimizer step ``step``: a fresh permutation per epoch, so resuming needs only the step."""
    sample = torch.arange(step * batch_size, (step + 1) * batch_size)
    out = torch.empty_like(sample)
    for epoch in sample.div(num_blocks, rounding_mode="floor").unique().tolist():
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        here = sample.div(num_blocks, rounding_mode="floor") == epoch
        out[here] = perm[sample[here] % num_blocks]
    return out


def save_checkpoint(out: str, head: EagleHead, optimizer: torch.optim.Optimizer, step: int) -> None:
    head.save_pretrained(out)
    torch.save({"step": step, "optimizer": optimizer.state_dict()}, os.path.join(out, STATE_NAME))


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    """Train; returns this run's per-step log records (also appended to ``--out/train_log.jsonl``)."""
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=getattr(torch, args.dtype)).to(args.device).eval()
    target.requires_grad_(False)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    blocks = make_blocks(
        tokenize(read_corpus(args.data), args.tokenizer, args.target, output_vocab_size(target)), args.seq_len
    )

    state_file = os.path.join(args.out, STATE_NAME)
    if args.resume:
        if not os.path.isfile(state_file):
            raise ValueError(f"--resume: no checkpoint in {args.out} ({STATE_NAME} missing)")
        head = EagleHead.from_pretrained(args.out, device=args.device, dtype=torch.float32)
        head.config.check_target(target)
        state = torch.load(state_file, map_location=args.device)
    else:
        overrides = {
            k: v for k, v in (("num_heads", args.num_heads), ("intermediate_size", args.intermediate_size)) if v
        }
        head = EagleHead(EagleConfig.for_target(target, **overrides)).to(args.device)
        state = {"step": 0}
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95))
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    os.makedirs(args.out, exist_ok=True)

    history = []
    head.train()
    bar = tqdm(range(state["step"], args.steps), initial=state["step"], total=args.steps, desc="train eagle head")
    with open(os.path.join(args.out, LOG_NAME), "a") as log:
        for step in bar:
            ids = blocks[batch_indices(len(blocks), step, args.batch_size, args.seed)].to(args.device)
            with torch.no_grad():
                out = target(input_ids=ids, output_hidden_states=True)
            loss, stats = eagle_loss(head, embed, lm_head, ids, out.hidden_states[-1], out.logits, args.cls_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), args.grad_clip)
            optimizer.step()
            record = {"step": step + 1, "loss": loss.item(), **stats}
            history.append(record)
            log.write(json.dumps(record) + "\n")
            bar.set_postfix(loss=f"{record['loss']:.4f}", top1=f"{stats['top1']:.3f}")
            if (step + 1) % args.save_every == 0:
                save_checkpoint(args.out, head, optimizer, step + 1)
    save_checkpoint(args.out, head, optimizer, max(args.steps, state["step"]))
    return history


if __name__ == "__main__":
    main()
