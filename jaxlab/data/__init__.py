"""Data pipeline: documents -> cached token streams -> packed, deterministic host batches.

Typical use::

    from jaxlab.data import TrainLoader, eval_batches, prepare, rich_progress

    with rich_progress("tokenizing") as cb:
        store = prepare(cfg.data, tokenizer, cache_dir, progress=cb)
    loader = TrainLoader(store, cfg.data.seq_len, cfg.train.batch_size, cfg.runtime.seed,
                         process_index, process_count)
    batch = loader.batch(step)        # dict of numpy arrays, a pure function of step
    for eb in eval_batches(store, cfg.data.seq_len, cfg.train.batch_size, 4): ...

numpy only: this package never imports jax. It yields host arrays; the trainer places them.
"""

from jaxlab.data.cache import (
    SPLIT_SALT,
    ProgressFn,
    cache_key,
    default_cache_dir,
    is_eval_document,
    prepare,
)
from jaxlab.data.loader import (
    TrainLoader,
    concat_batches,
    eval_batches,
    gather_windows,
    num_windows,
    pack,
    padding_batch,
)
from jaxlab.data.progress import rich_progress
from jaxlab.data.protocol import BATCH_KEYS, Batch, TokenizerLike
from jaxlab.data.sources import (
    describe_source,
    estimate_total_bytes,
    iter_documents,
    resolve_files,
    source_fingerprint,
    stdlib_files,
    synthetic_document,
)
from jaxlab.data.store import (
    SPLITS,
    CacheError,
    SplitName,
    TokenSplit,
    TokenStore,
    token_dtype,
)

__all__ = [
    "BATCH_KEYS",
    "SPLITS",
    "SPLIT_SALT",
    "Batch",
    "CacheError",
    "ProgressFn",
    "SplitName",
    "TokenSplit",
    "TokenStore",
    "TokenizerLike",
    "TrainLoader",
    "cache_key",
    "concat_batches",
    "default_cache_dir",
    "describe_source",
    "estimate_total_bytes",
    "eval_batches",
    "gather_windows",
    "is_eval_document",
    "iter_documents",
    "num_windows",
    "pack",
    "padding_batch",
    "prepare",
    "resolve_files",
    "rich_progress",
    "source_fingerprint",
    "stdlib_files",
    "synthetic_document",
    "token_dtype",
]
