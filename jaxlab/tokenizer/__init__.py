"""Byte-level BPE tokenizer: our own trainer, tiktoken for all encoding and decoding.

Typical use::

    from jaxlab.tokenizer import bpe_tokenizer, byte_tokenizer, Tokenizer

    tok = bpe_tokenizer(texts, vocab_size=8192)   # or byte_tokenizer() (258 ids)
    ids = tok.encode("hello world") + [tok.eot_id]
    tok.save("runs/tok")
    tok = Tokenizer.load("runs/tok")              # verifies sha256

This package deliberately does not import jax, so it imports in milliseconds.
"""

from jaxlab.tokenizer.bpe import (
    ENDOFTEXT,
    GPT2_PAT_STR,
    MIN_VOCAB_SIZE,
    PAD,
    SPECIAL_TOKENS,
    count_pretokens,
    train_bpe,
    validate_vocab_size,
)
from jaxlab.tokenizer.detok import Detokenizer
from jaxlab.tokenizer.encoding import (
    META_FILENAME,
    RANKS_FILENAME,
    Tokenizer,
    TokenizerKind,
    bpe_tokenizer,
    byte_tokenizer,
)

__all__ = [
    "ENDOFTEXT",
    "GPT2_PAT_STR",
    "META_FILENAME",
    "MIN_VOCAB_SIZE",
    "PAD",
    "RANKS_FILENAME",
    "SPECIAL_TOKENS",
    "Detokenizer",
    "Tokenizer",
    "TokenizerKind",
    "bpe_tokenizer",
    "byte_tokenizer",
    "count_pretokens",
    "train_bpe",
    "validate_vocab_size",
]
