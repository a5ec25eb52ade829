"""Packing a token stream into fixed windows, the stateless train loader, and eval batches.

Windows
    A split's stream of ``N`` tokens is cut into ``W = (N - 1) // seq_len`` windows of
    ``seq_len + 1`` tokens at stride ``seq_len``: window ``k`` is
    ``tokens[k*T : k*T + T + 1]``. Consecutive windows share one token (the last target of
    ``k`` is the first input of ``k+1``), so every adjacent token pair of the stream is a
    training example exactly once per epoch. The tail that does not fill a window is
    dropped (at most ``seq_len`` tokens per split).

Segments, positions and the loss mask (per row, ``inputs = window[:-1]``,
``targets = window[1:]``)
    Every document in the stream ends with ``eot_id`` and the EOS token belongs to the
    document it ends. A new segment therefore starts at the first input of the row and
    right after every input EOS:

    - ``segment_ids[j] = 1 + #(EOS among inputs[:j])`` -- 1, 1, ..., 2, 2, ...
    - ``positions[j] = j - (start of j's segment)`` -- restarting at 0 at every segment
      start, including the row start when a document began in an earlier window (so
      positions never exceed ``seq_len - 1``, which learned position tables need; RoPE only
      sees differences, which are unchanged within a segment).
    - ``loss_mask[j] = 0`` exactly where ``inputs[j]`` is EOS: its target is then the first
      token of the *next* document, which the previous document's context must not be
      trained to predict. Predicting the EOS itself (from the last real token) is kept, so
      the model learns where documents end. The first token of each document is never a
      target: with segment-isolated attention it has no context of its own document.

    - With a target mask (a ``chat-jsonl`` store: 1 on the assistant's tokens), also
      ``loss_mask[j] = 0`` wherever ``targets[j]`` is not a target, so only the assistant's
      replies (and their end-of-turn tokens) are trained; rows without one are unchanged.

    Attention that lets query ``j`` see key ``i`` only when ``i <= j`` and
    ``segment_ids[i] == segment_ids[j]`` then never mixes documents, and every unmasked
    target is predicted from its own document's tokens only. (Padding rows of
    :func:`eval_batches` use segment id 0, position 0, ``pad_id`` tokens and mask 0.)

Order
    :class:`TrainLoader` is stateless: ``batch(step)`` is a pure function of
    ``(seed, step, process_index, process_count)``, so resuming from a checkpoint needs
    only the step number.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

from jaxlab.data.protocol import Batch
from jaxlab.data.store import SplitName, TokenStore


def num_windows(n_tokens: int, seq_len: int) -> int:
    """How many ``seq_len + 1`` windows (stride ``seq_len``) a stream of ``n_tokens`` holds."""
    _check_seq_len(seq_len)
    return max(0, (n_tokens - 1) // seq_len)


def gather_windows(tokens: np.ndarray, seq_len: int, window_ids: np.ndarray) -> np.ndarray:
    """Rows ``tokens[k*T : k*T + T + 1]`` for each ``k`` in ``window_ids``, as int32 (also
    for a target mask stream, which has the same layout)."""
    starts = np.asarray(window_ids, dtype=np.int64) * seq_len
    index = starts[:, None] + np.arange(seq_len + 1, dtype=np.int64)[None, :]
    # One vectorized gather; on a memmap only the touched pages are read.
    return np.asarray(tokens[index]).astype(np.int32)


def pack(windows: np.ndarray, eot_id: int, target_mask: np.ndarray | None = None) -> Batch:
    """Turn ``[B, T+1]`` windows into a :data:`Batch` (semantics in the module docstring);
    ``target_mask``: the same windows of the store's target mask, if it has one."""
    windows = np.asarray(windows, dtype=np.int32)
    if windows.ndim != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be [B, T+1] with T >= 1, got shape {windows.shape}")
    inputs = windows[:, :-1]
    targets = windows[:, 1:]
    b, t = inputs.shape
    is_eos = inputs == eot_id
    # Exclusive cumulative count: an EOS still belongs to the segment it ends.
    eos_before = np.cumsum(is_eos, axis=1, dtype=np.int32) - is_eos
    segment_ids = (1 + eos_before).astype(np.int32)
    starts = np.zeros((b, t), dtype=bool)
    starts[:, 0] = True
    starts[:, 1:] = is_eos[:, :-1]
    col = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))
    last_start = np.maximum.accumulate(np.where(starts, col, 0), axis=1)
    loss_mask = ~is_eos
    if target_mask is not None:
        loss_mask &= np.asarray(target_mask)[:, 1:] != 0
    return dict(
        tokens=np.ascontiguousarray(inputs),
        targets=np.ascontiguousarray(targets),
        positions=(col - last_start).astype(np.int32),
        segment_ids=segment_ids,
        loss_mask=loss_mask.astype(np.float32),
    )


def padding_batch(rows: int, seq_len: int, pad_id: int) -> Batch:
    """``rows`` rows that contribute nothing: pad tokens, segment 0, loss_mask 0."""
    shape = (rows, seq_len)
    return dict(
        tokens=np.full(shape, pad_id, dtype=np.int32),
        targets=np.full(shape, pad_id, dtype=np.int32),
        positions=np.zeros(shape, dtype=np.int32),
        segment_ids=np.zeros(shape, dtype=np.int32),
        loss_mask=np.zeros(shape, dtype=np.float32),
    )


def concat_batches(parts: list[Batch]) -> Batch:
    """Stack batches along the row axis."""
    return dict(
        tokens=np.concatenate([p["tokens"] for p in parts]),
        targets=np.concatenate([p["targets"] for p in parts]),
        positions=np.concatenate([p["positions"] for p in parts]),
        segment_ids=np.concatenate([p["segment_ids"] for p in parts]),
        loss_mask=np.concatenate([p["loss_mask"] for p in parts]),
    )


def _mask_windows(
    mask: np.ndarray | None, seq_len: int, window_ids: np.ndarray
) -> np.ndarray | None:
    return None if mask is None else gather_windows(mask, seq_len, window_ids)


def _check_seq_len(seq_len: int) -> None:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1 (got {seq_len})")


def _process_share(batch: int, process_index: int, process_count: int, what: str) -> int:
    if process_count < 1:
        raise ValueError(f"process_count must be >= 1 (got {process_count})")
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index must be in [0, {process_count}) (got {process_index})")
    if batch < 1 or batch % process_count:
        raise ValueError(
            f"{what} ({batch}) must be a positive multiple of process_count "
            f"({process_count}): every process takes an equal contiguous share"
        )
    return batch // process_count


class TrainLoader:
    """Stateless, multi-process-aware sampler of packed training windows.

    The infinite window sequence is epoch after epoch; epoch ``e`` is the permutation of all
    ``W`` windows drawn by ``Generator(PCG64(SeedSequence([seed, e])))``. Step ``s`` covers
    global positions ``[s*B, (s+1)*B)`` of that sequence (a step may straddle epochs) and
    process ``p`` of ``P`` takes positions ``s*B + p*B/P + [0, B/P)``. Every process draws the
    same permutation, so shares are disjoint and together form the global batch.
    """

    def __init__(
        self,
        store: TokenStore,
        seq_len: int,
        global_batch: int,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        *,
        split: SplitName = "train",
        cache_epochs: int = 2,
    ) -> None:
        _check_seq_len(seq_len)
        if seed < 0:
            raise ValueError(f"seed must be >= 0 (got {seed})")
        self.local_batch = _process_share(
            global_batch, process_index, process_count, "global_batch"
        )
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.process_index = process_index
        self.process_count = process_count
        self.eot_id = store.eot_id
        self._tokens = store.split(split).tokens
        self._target_mask = store.split(split).target_mask
        self.windows_per_epoch = num_windows(int(self._tokens.shape[0]), seq_len)
        if self.windows_per_epoch < 1:
            raise ValueError(
                f"the {split} split has {self._tokens.shape[0]} tokens, fewer than one window "
                f"of seq_len + 1 = {seq_len + 1}; use more data or a smaller data.seq_len"
            )
        self._cache_epochs = max(1, cache_epochs)
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()  # batch() may be called from a prefetch thread

    @property
    def tokens_per_step(self) -> int:
        """Input tokens in one global step (``global_batch * seq_len``)."""
        return self.global_batch * self.seq_len

    @property
    def steps_per_epoch(self) -> float:
        return self.windows_per_epoch / self.global_batch

    def epoch_permutation(self, epoch: int) -> np.ndarray:
        """Window order of ``epoch`` (int64 ``[W]``); the last few epochs are cached."""
        with self._lock:
            perm = self._perms.get(epoch)
            if perm is not None:
                self._perms.move_to_end(epoch)
                return perm
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, epoch])))
        perm = rng.permutation(self.windows_per_epoch).astype(np.int64)
        perm.setflags(write=False)  # shared between calls: nobody may mutate it
        with self._lock:
            self._perms[epoch] = perm
            while len(self._perms) > self._cache_epochs:
                self._perms.popitem(last=False)
        return perm

    def window_ids(self, step: int) -> np.ndarray:
        """Window indices of this process's rows at ``step`` (int64 ``[local_batch]``)."""
        if step < 0:
            raise ValueError(f"step must be >= 0 (got {step})")
        first = step * self.global_batch + self.process_index * self.local_batch
        positions = first + np.arange(self.local_batch, dtype=np.int64)
        epochs, offsets = np.divmod(positions, self.windows_per_epoch)
        out = np.empty(self.local_batch, dtype=np.int64)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self.epoch_permutation(int(epoch))[offsets[sel]]
        return out

    def batch(self, step: int) -> Batch:
        """This process's batch at ``step``: ``[global_batch / process_count, seq_len]``."""
        ids = self.window_ids(step)
        windows = gather_windows(self._tokens, self.seq_len, ids)
        mask = self._target_mask
        return pack(windows, self.eot_id, _mask_windows(mask, self.seq_len, ids))


def eval_batches(
    store: TokenStore,
    seq_len: int,
    batch_size: int,
    max_batches: int | None = None,
    *,
    process_index: int = 0,
    process_count: int = 1,
    split: SplitName = "eval",
) -> Iterator[Batch]:
    """The eval split's windows in order, ``batch_size`` (global) rows per batch.

    The last partial batch is filled with padding rows (``pad_id``, loss_mask 0), so every
    batch has the same shape (one compiled eval step) and a weighted mean over
    ``loss_mask`` counts real tokens only. With several processes each gets its contiguous
    share of every batch, and all processes yield the same number of batches. Yields
    nothing when the split holds less than one window.
    """
    _check_seq_len(seq_len)
    local = _process_share(batch_size, process_index, process_count, "batch_size")
    tokens = store.split(split).tokens
    mask = store.split(split).target_mask
    total = num_windows(int(tokens.shape[0]), seq_len)
    n_batches = -(-total // batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max(0, max_batches))
    for b in range(n_batches):
        lo = b * batch_size + process_index * local
        ids = np.arange(lo, min(lo + local, total), dtype=np.int64)
        parts: list[Batch] = []
        if ids.size:
            windows = gather_windows(tokens, seq_len, ids)
            parts.append(pack(windows, store.eot_id, _mask_windows(mask, seq_len, ids)))
        if ids.size < local:
            parts.append(padding_batch(local - ids.size, seq_len, store.pad_id))
        yield parts[0] if len(parts) == 1 else concat_batches(parts)
