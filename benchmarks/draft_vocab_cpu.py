"""How much text the N most frequent tokens cover: the draft vocabulary of ``EagleDrafter(draft_vocab=N)``.

The tokens of the study's training corpus (``examples/train_target.py``'s corpus options and split, as
``examples/train_eagle.py`` ranks them for the head) are counted; for each N the table gives the share of
held-out tokens (per source) among the N most frequent, and the share of the LM head's rows a draft level
reads. A drafted token outside the draft vocabulary can never be proposed, so the held-out coverage bounds
the share of target tokens a frequency-ranked drafter could still propose (the target's own greedy tokens
lean further towards frequent ones). On a CPU, in about a minute:

    python benchmarks/draft_vocab_cpu.py --tokenizer benchmarks/results/trained/tokenizer.json \\
        --sharegpt-mb 30 --code-mb 15          # the trained study's corpus sizes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from tokenizers import Tokenizer

from specla_compile.runtime.drafters.eagle_head import rank_tokens
from specla_compile.training import corpus as C

SIZES = (1024, 2048, 4096, 8192, 16384)


def coverage(ranking: torch.Tensor, heldout: np.ndarray, size: int) -> float:
    """Share of the ``heldout`` tokens among the first ``size`` of ``ranking``."""
    inside = torch.zeros(len(ranking), dtype=torch.bool)
    inside[ranking[:size]] = True
    return float(inside[torch.from_numpy(np.asarray(heldout, dtype=np.int64))].float().mean())


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="a tokenizers JSON file (the trained study's tokenizer.json)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    C.add_corpus_arguments(p)
    args = p.parse_args(argv)
    if not os.path.isfile(args.tokenizer):
        sys.exit(f"error: --tokenizer: file not found: {args.tokenizer}")
    try:
        C.check_corpus_arguments(args)
    except ValueError as e:
        sys.exit(f"error: {e}")
    started = time.perf_counter()
    tokenizer = Tokenizer.from_file(args.tokenizer)
    vocab = tokenizer.get_vocab_size()
    if not all(1 <= n <= vocab for n in args.sizes):
        sys.exit(f"error: --sizes must lie in [1, {vocab}]")
    print("reading and tokenizing the corpus ...", flush=True)
    streams = C.encode_corpus(tokenizer, C.read_corpus(args), tokenizer.token_to_id("<|endoftext|>"))
    ranking = rank_tokens(torch.from_numpy(C.training_stream(streams).astype(np.int64)), vocab)
    table = {str(n): {source: coverage(ranking, splits["heldout"], n) for source, splits in streams.items()}
             for n in args.sizes}
    results = {"command": " ".join(["python", *sys.argv]) if argv is None else f"main({argv})", "vocab": vocab,
               "training_tokens": {s: len(splits["train"]) for s, splits in streams.items()},
               "heldout_tokens": {s: len(splits["heldout"]) for s, splits in streams.items()},
               "heldout_coverage": table, "seconds": time.perf_counter() - started}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "draft_vocab_cpu.json"), "w") as f:
        json.dump(results, f, indent=1)
    sources = list(streams)
    lines = ["# Draft vocabulary: held-out tokens among the N most frequent training tokens", "",
             f"command: `{results['command']}`; vocabulary {vocab}; training tokens "
             + ", ".join(f"{s} {n:,}" for s, n in results["training_tokens"].items()), "",
             "| N | LM head rows read | " + " | ".join(f"held-out {s}" for s in sources) + " |",
             "| --- | --- |" + " --- |" * len(sources)]
    for n, row in table.items():
        lines.append(f"| {n} | {int(n) / vocab:.1%} | " + " | ".join(f"{row[s]:.1%}" for s in sources) + " |")
    with open(os.path.join(args.out, "draft_vocab_cpu.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return results


if __name__ == "__main__":
    main()
