"""The project's byte-level BPE tokenizer: trained with ``tokenizers``, saved as a transformers
``PreTrainedTokenizerFast``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"


def train_bpe_tokenizer(
    texts: Iterable[str], vocab_size: int = 32000, min_frequency: int = 2
) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style: every byte has a token, so any text round-trips) with
    ``<|endoftext|>`` as EOS and ``<|pad|>`` as padding, as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 2:
        raise ValueError(f"vocab_size must be at least {len(alphabet) + 2} (bytes + EOS + PAD), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, clean_up_tokenization_spaces=False
    )


def token_byte_lengths(tokenizer: PreTrainedTokenizerBase) -> np.ndarray:
    """UTF-8 bytes each token id stands for (0 for special tokens): a byte-level BPE token's string
    spells one byte per character, so a stream's byte count is a table lookup (for bits/byte)."""
    special = set(tokenizer.all_special_tokens)
    lengths = np.zeros(len(tokenizer), dtype=np.int64)
    for token, i in tokenizer.get_vocab().items():
        lengths[i] = 0 if token in special else len(token)
    return lengths
