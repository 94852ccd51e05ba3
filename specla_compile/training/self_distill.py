"""The target's own greedy continuations as training blocks for its draft head (self-distillation).

Speculative decoding drafts for what the target itself writes after a prompt. A head trained on corpus text
only sees the target's predictions at contexts someone else wrote; a small target's own greedy text (often
repetitive, unlike the corpus) is where drafts are accepted or not. Here each block is a context cut from
the training stream followed by the target's greedy continuation of it: conversation contexts end where an
assistant's turn begins (the ``"ASSISTANT:"`` of :func:`corpus.format_prompt`, as the study's prompts do),
code contexts anywhere. Contexts come from the training split only.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from ..runtime.baseline import autoregressive_generate

DISTILL_BLOCKS = "distill_blocks.pt"  # the target's greedy continuations in the head's --out, kept for --resume
TURN_MARKER = "\nASSISTANT:"  # what a conversation context ends with (corpus.format_prompt's hand-over)


def marker_ends(stream: np.ndarray, marker: Sequence[int]) -> np.ndarray:
    """Positions just past every occurrence of the token sequence ``marker`` in ``stream``."""
    stream, n = np.asarray(stream), len(marker)
    if n == 0 or len(stream) < n:
        return np.zeros(0, dtype=np.int64)
    hits = np.ones(len(stream) - n + 1, dtype=bool)
    for i, token in enumerate(marker):
        hits &= stream[i : len(stream) - n + 1 + i] == token
    return np.flatnonzero(hits) + n


def distill_contexts(
    streams: dict[str, np.ndarray], count: int, context_len: int, seed: int,
    ends_with: dict[str, Sequence[int]] | None = None,
) -> torch.Tensor:
    """``[count, context_len]`` token contexts, drawn from each source in proportion to its stream's length:
    those of a source in ``ends_with`` end just past that token sequence (a conversation's assistant turn),
    the others anywhere (code)."""
    ends_with = ends_with or {}
    usable = {s: np.asarray(ids) for s, ids in streams.items() if len(ids) > context_len}
    if not usable:
        raise ValueError(f"no stream is longer than a {context_len}-token context")
    rng = np.random.default_rng(seed)
    total = sum(len(ids) for ids in usable.values())
    rows = []
    for source, ids in usable.items():
        share = math.ceil(count * len(ids) / total)
        if source in ends_with:
            ends = marker_ends(ids, ends_with[source])
            ends = ends[ends >= context_len]
            if len(ends) == 0:
                raise ValueError(f"the {source} stream has no {list(ends_with[source])} (a turn's start) after "
                                 f"{context_len} tokens")
        else:
            ends = np.arange(context_len, len(ids) + 1)
        picked = rng.choice(ends, size=share, replace=len(ends) < share)
        rows.extend(ids[end - context_len : end] for end in picked)
    order = rng.permutation(len(rows))[:count]  # sources interleaved, so a time cap keeps their mix
    return torch.from_numpy(np.stack([rows[i] for i in order]).astype(np.int64))


@torch.no_grad()
def greedy_continuations(
    model: torch.nn.Module, contexts: torch.Tensor, new_tokens: int, batch_rows: int, max_seconds: float | None = None
) -> torch.Tensor:
    """Each context followed by the model's ``new_tokens`` greedy tokens (no stop at EOS, as the study
    decodes), ``batch_rows`` rows per decoding loop; ``[n, context + new_tokens]`` on the CPU. With
    ``max_seconds``, no batch starts after that long: ``n`` may be below ``len(contexts)``, but at least one
    batch runs."""
    if new_tokens < 1 or batch_rows < 1:
        raise ValueError(f"new_tokens and batch_rows must be >= 1, got {new_tokens} and {batch_rows}")
    device = next(model.parameters()).device
    started, out = time.perf_counter(), []
    bar = tqdm(total=len(contexts), desc="self-distillation: greedy continuations", unit="block")
    for batch in contexts.split(batch_rows):
        if out and max_seconds is not None and time.perf_counter() - started > max_seconds:
            bar.write(f"self-distillation: time cap of {max_seconds:.0f} s reached after {sum(map(len, out))} blocks")
            break
        sequences, _ = autoregressive_generate(model, batch.to(device), new_tokens, eos_token_id=[])
        out.append(sequences.cpu())
        bar.update(len(batch))
    bar.close()
    return torch.cat(out)
