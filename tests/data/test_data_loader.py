"""Packing semantics, the stateless TrainLoader and eval_batches (in-memory stores)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlab.data import (
    BATCH_KEYS,
    TokenStore,
    TrainLoader,
    eval_batches,
    gather_windows,
    num_windows,
    pack,
)

EOT, PAD, N_VOCAB = 256, 257, 258

# Documents of ordinary ids (never EOT/PAD); empty documents are allowed (just an EOT).
docs_strategy = st.lists(st.lists(st.integers(0, 255), max_size=12), min_size=1, max_size=25)


def make_store(docs: list[list[int]], eval_docs: list[list[int]] | None = None) -> TokenStore:
    return TokenStore.from_documents(docs, eval_docs or [], n_vocab=N_VOCAB, eot_id=EOT, pad_id=PAD)


def synthetic_store(n_docs: int = 60, seed: int = 0) -> TokenStore:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 256, size=rng.integers(1, 30)).tolist() for _ in range(n_docs)]
    eval_docs = [rng.integers(0, 256, size=rng.integers(1, 30)).tolist() for _ in range(15)]
    return make_store(docs, eval_docs)


def doc_index_of_tokens(store: TokenStore, split: str = "train") -> np.ndarray:
    """Reference: the document each stream position belongs to, from the offsets."""
    s = store.split("train" if split == "train" else "eval")
    n = s.n_tokens
    return np.searchsorted(s.doc_offsets, np.arange(n), side="right") - 1


# ---------------------------------------------------------------------------------------
# Packing
# ---------------------------------------------------------------------------------------


def test_pack_hand_example() -> None:
    # Stream: doc A = [10, 11, EOT], doc B = [20, EOT], doc C = [30, 31, ...]
    window = np.array([[10, 11, EOT, 20, EOT, 30, 31]])
    b = pack(window, EOT)
    np.testing.assert_array_equal(b["tokens"], [[10, 11, EOT, 20, EOT, 30]])
    np.testing.assert_array_equal(b["targets"], [[11, EOT, 20, EOT, 30, 31]])
    # The EOS belongs to the document it ends; the next segment starts after it.
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 2, 2, 3]])
    np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 0, 1, 0]])
    # EOT -> next doc's first token is masked; predicting the EOT itself is trained.
    np.testing.assert_array_equal(b["loss_mask"], [[1, 1, 0, 1, 0, 1]])
    assert {k: v.dtype for k, v in b.items()} == {
        "tokens": np.int32,
        "targets": np.int32,
        "positions": np.int32,
        "segment_ids": np.int32,
        "loss_mask": np.float32,
    }


def test_pack_window_starting_mid_document_restarts_positions() -> None:
    b = pack(np.array([[5, 6, 7, EOT, 8]]), EOT)
    np.testing.assert_array_equal(b["positions"], [[0, 1, 2, 3]])
    np.testing.assert_array_equal(b["segment_ids"], [[1, 1, 1, 1]])
    np.testing.assert_array_equal(b["loss_mask"], [[1, 1, 1, 0]])


@settings(max_examples=60, deadline=None)
@given(docs=docs_strategy, seq_len=st.integers(1, 9))
def test_packing_matches_offset_reference(docs: list[list[int]], seq_len: int) -> None:
    store = make_store(docs)
    split = store.split("train")
    tokens = np.asarray(split.tokens, dtype=np.int64)
    n_win = num_windows(split.n_tokens, seq_len)
    assert n_win == max(0, (split.n_tokens - 1) // seq_len)
    if n_win == 0:
        return
    ids = np.arange(n_win)
    b = pack(gather_windows(split.tokens, seq_len, ids), EOT)

    # Windows reconstruct the stream (tail shorter than a window dropped).
    flat_inputs = b["tokens"].reshape(-1)
    np.testing.assert_array_equal(flat_inputs, tokens[: n_win * seq_len])
    np.testing.assert_array_equal(
        b["targets"][:, -1], tokens[seq_len : n_win * seq_len + 1 : seq_len]
    )
    np.testing.assert_array_equal(b["targets"].reshape(-1), tokens[1 : n_win * seq_len + 1])

    doc = doc_index_of_tokens(store)
    for k in range(n_win):
        pos = k * seq_len + np.arange(seq_len)  # stream positions of this row's inputs
        in_doc, tgt_doc = doc[pos], doc[pos + 1]
        np.testing.assert_array_equal(b["loss_mask"][k], (in_doc == tgt_doc).astype(np.float32))
        np.testing.assert_array_equal(b["segment_ids"][k], in_doc - in_doc[0] + 1)
        seg_start = np.maximum(split.doc_offsets[in_doc], k * seq_len)
        np.testing.assert_array_equal(b["positions"][k], pos - seg_start)
        # Every unmasked target is predicted within one segment.
        assert np.all((b["loss_mask"][k] == 0) == (b["tokens"][k] == EOT))


# ---------------------------------------------------------------------------------------
# TrainLoader
# ---------------------------------------------------------------------------------------


def assert_batches_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert set(a) == set(b) == set(BATCH_KEYS)
    for k in BATCH_KEYS:
        np.testing.assert_array_equal(a[k], b[k])


def test_loader_is_a_pure_function_of_step() -> None:
    store = synthetic_store()
    a = TrainLoader(store, seq_len=8, global_batch=4, seed=3)
    b = TrainLoader(store, seq_len=8, global_batch=4, seed=3)
    steps = [0, 7, 3, 50, 1, 7]
    first = {s: a.batch(s) for s in steps}
    for s in reversed(steps):  # another loader, another order, another cache state
        assert_batches_equal(first[s], b.batch(s))
    assert_batches_equal(first[7], a.batch(7))
    assert a.batch(0)["tokens"].shape == (4, 8)
    assert a.tokens_per_step == 32
    other_seed = TrainLoader(store, seq_len=8, global_batch=4, seed=4)
    assert not all(np.array_equal(a.window_ids(s), other_seed.window_ids(s)) for s in range(5))


def test_batch_rows_are_the_named_windows() -> None:
    store = synthetic_store()
    loader = TrainLoader(store, seq_len=6, global_batch=4, seed=0)
    ids = loader.window_ids(5)
    expected = pack(gather_windows(store.split("train").tokens, 6, ids), EOT)
    assert_batches_equal(loader.batch(5), expected)


@settings(max_examples=40, deadline=None)
@given(
    n_docs=st.integers(3, 40),
    seq_len=st.integers(1, 12),
    local_batch=st.integers(1, 5),
    process_count=st.integers(1, 4),
    seed=st.integers(0, 2**32),
)
def test_process_shares_and_epoch_coverage(
    n_docs: int, seq_len: int, local_batch: int, process_count: int, seed: int
) -> None:
    store = synthetic_store(n_docs=n_docs, seed=n_docs)
    global_batch = local_batch * process_count
    whole = TrainLoader(store, seq_len, global_batch, seed)
    parts = [
        TrainLoader(
            store, seq_len, global_batch, seed, process_index=p, process_count=process_count
        )
        for p in range(process_count)
    ]
    w = whole.windows_per_epoch
    n_steps = -(-2 * w // global_batch)  # two full epochs, crossing the boundary
    seen: list[np.ndarray] = []
    for step in range(n_steps):
        shares = [p.window_ids(step) for p in parts]
        # Disjoint contiguous shares whose union (in order) is the global batch.
        np.testing.assert_array_equal(np.concatenate(shares), whole.window_ids(step))
        tokens = np.concatenate([p.batch(step)["tokens"] for p in parts])
        np.testing.assert_array_equal(tokens, whole.batch(step)["tokens"])
        seen.append(whole.window_ids(step))
    order = np.concatenate(seen)
    # Each epoch visits every window exactly once.
    np.testing.assert_array_equal(np.sort(order[:w]), np.arange(w))
    np.testing.assert_array_equal(np.sort(order[w : 2 * w]), np.arange(w))
    np.testing.assert_array_equal(order[:w], whole.epoch_permutation(0))


def test_loader_validates_arguments() -> None:
    store = synthetic_store()
    with pytest.raises(ValueError, match="process_count"):
        TrainLoader(store, 8, global_batch=6, seed=0, process_index=0, process_count=4)
    with pytest.raises(ValueError, match="process_index"):
        TrainLoader(store, 8, global_batch=8, seed=0, process_index=4, process_count=4)
    with pytest.raises(ValueError, match="seq_len"):
        TrainLoader(make_store([[1, 2]]), 8, global_batch=1, seed=0)
    with pytest.raises(ValueError, match="step"):
        TrainLoader(store, 8, global_batch=2, seed=0).batch(-1)


def test_permutation_cache_is_bounded() -> None:
    loader = TrainLoader(synthetic_store(), 4, global_batch=64, seed=0, cache_epochs=2)
    for step in range(20):
        loader.batch(step)
    assert len(loader._perms) <= 2
    ref = TrainLoader(synthetic_store(), 4, global_batch=64, seed=0)
    np.testing.assert_array_equal(loader.window_ids(0), ref.window_ids(0))


# ---------------------------------------------------------------------------------------
# eval_batches
# ---------------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    seq_len=st.integers(1, 10),
    batch_size=st.integers(1, 7),
    process_count=st.sampled_from([1, 2, 3]),
)
def test_eval_batches_pad_and_count_real_tokens(
    seq_len: int, batch_size: int, process_count: int
) -> None:
    store = synthetic_store()
    batch_size *= process_count
    split = store.split("eval")
    w = num_windows(split.n_tokens, seq_len)
    batches = list(eval_batches(store, seq_len, batch_size))
    assert len(batches) == -(-w // batch_size)
    rows = {k: np.concatenate([b[k] for b in batches]) for k in BATCH_KEYS}
    assert all(b["tokens"].shape == (batch_size, seq_len) for b in batches)
    real = pack(gather_windows(split.tokens, seq_len, np.arange(w)), EOT)
    for k in BATCH_KEYS:
        np.testing.assert_array_equal(rows[k][:w], real[k])  # in order
    pad = {k: v[w:] for k, v in rows.items()}
    assert np.all(pad["loss_mask"] == 0)
    assert np.all(pad["tokens"] == PAD) and np.all(pad["targets"] == PAD)
    assert np.all(pad["segment_ids"] == 0)
    # Weighting by loss_mask counts exactly the real, same-document targets.
    n_eos_inputs = int((real["tokens"] == EOT).sum())
    assert rows["loss_mask"].sum() == w * seq_len - n_eos_inputs

    # Per-process shares of each padded batch reassemble the global batches.
    per_proc = [
        list(eval_batches(store, seq_len, batch_size, process_index=p, process_count=process_count))
        for p in range(process_count)
    ]
    assert all(len(pp) == len(batches) for pp in per_proc)
    for i, gb in enumerate(batches):
        for k in BATCH_KEYS:
            np.testing.assert_array_equal(np.concatenate([pp[i][k] for pp in per_proc]), gb[k])


def test_eval_batches_max_batches_and_empty_split() -> None:
    store = synthetic_store()
    assert len(list(eval_batches(store, 4, 2, max_batches=3))) == 3
    assert list(eval_batches(make_store([[1, 2, 3]]), 4, 2)) == []
