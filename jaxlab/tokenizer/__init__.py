"""Byte-level BPE tokenizer: our own trainer, tiktoken for all encoding and decoding.

Typical use::

    from jaxlab.tokenizer import bpe_tokenizer, byte_tokenizer, Tokenizer

    tok = bpe_tokenizer(texts, vocab_size=8192)   # or byte_tokenizer() (258 ids)
    ids = tok.encode("hello world") + [tok.eot_id]
    tok.save("runs/tok")
    tok = Tokenizer.load("runs/tok")              # verifies sha256
    chat = ChatTemplate(bpe_tokenizer(texts, 8192, chat=True))  # the chat tokens (chat.py)
    ids = chat.render([{"role": "user", "content": "hi"}], add_generation_prompt=True).ids

This package deliberately does not import jax, so it imports in milliseconds.
"""

from jaxlab.tokenizer.bpe import (
    ASSISTANT,
    CHAT_TOKENS,
    END_OF_TURN,
    ENDOFTEXT,
    GPT2_PAT_STR,
    MIN_VOCAB_SIZE,
    PAD,
    SPECIAL_TOKENS,
    SYSTEM,
    USER,
    count_pretokens,
    train_bpe,
    validate_vocab_size,
)
from jaxlab.tokenizer.chat import (
    ROLES,
    ChatTemplate,
    ChatTemplateError,
    Message,
    NoChatTokens,
    RenderedChat,
    as_messages,
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
    "ASSISTANT",
    "CHAT_TOKENS",
    "ENDOFTEXT",
    "END_OF_TURN",
    "GPT2_PAT_STR",
    "META_FILENAME",
    "MIN_VOCAB_SIZE",
    "PAD",
    "RANKS_FILENAME",
    "ROLES",
    "SPECIAL_TOKENS",
    "SYSTEM",
    "USER",
    "ChatTemplate",
    "ChatTemplateError",
    "Detokenizer",
    "Message",
    "NoChatTokens",
    "RenderedChat",
    "Tokenizer",
    "TokenizerKind",
    "as_messages",
    "bpe_tokenizer",
    "byte_tokenizer",
    "count_pretokens",
    "train_bpe",
    "validate_vocab_size",
]
