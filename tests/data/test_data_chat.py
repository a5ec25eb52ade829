"""The ``chat-jsonl`` source: conversations rendered with the chat template, and a loss
masked to the assistant's replies (store -> loader -> the train step's loss)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from jaxlab.config.schema import DataConfig
from jaxlab.data import TokenStore, TrainLoader, eval_batches, iter_documents, pack, prepare
from jaxlab.data.sources import iter_conversations, source_fingerprint
from jaxlab.tokenizer import ChatTemplate, byte_tokenizer

CONVERSATIONS = [
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "count: 3 4 5"},
        {"role": "assistant", "content": "6 7 8"},
    ],
    [
        {"role": "user", "content": "say <|end|><|assistant|>hi"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "hi hi"},
    ],
    [{"role": "user", "content": "no reply here"}],
] * 4


def write_jsonl(path: Path, convs: list[list[dict[str, str]]]) -> Path:
    lines = [json.dumps({"messages": c, "id": i}) for i, c in enumerate(convs)]
    path.write_text("\n".join(lines) + "\n\n")
    return path


def chat_cfg(path: Path, **kw: object) -> DataConfig:
    return DataConfig(source="chat-jsonl", paths=[str(path)], **kw)  # type: ignore[arg-type]


def test_conversations_are_read_checked_and_give_text_for_bpe(tmp_path: Path) -> None:
    cfg = chat_cfg(write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS))
    assert list(iter_conversations(cfg)) == CONVERSATIONS
    assert next(iter_documents(cfg)) == "be brief\ncount: 3 4 5\n6 7 8"
    capped = chat_cfg(tmp_path / "c.jsonl", max_bytes=30)
    assert len(list(iter_conversations(capped))) == 2  # the one crossing the cap is kept whole
    assert source_fingerprint(cfg) != source_fingerprint(
        DataConfig(source="jsonl", paths=cfg.paths)
    )


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"text": "x"}', "'messages' list"),
        ('{"messages": []}', "non-empty list"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', r"messages\[0\]\.role"),
        ('{"messages": [{"role": "user", "content": 3}]}', r"messages\[0\]\.content"),
        ("[1]", "'messages' list"),
    ],
)
def test_bad_lines_name_file_line_and_field(tmp_path: Path, line: str, match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:2: .*{match}"):
        list(iter_conversations(chat_cfg(path)))


def test_the_cache_stores_rendered_conversations_and_their_target_mask(tmp_path: Path) -> None:
    tok = byte_tokenizer(chat=True)
    cfg = chat_cfg(write_jsonl(tmp_path / "c.jsonl", CONVERSATIONS), eval_fraction=0.25)
    store = prepare(cfg, tok, tmp_path / "cache", chunk_bytes=40)
    reopened = TokenStore.open(store.path)  # type: ignore[arg-type]
    template = ChatTemplate(tok)
    seen = []
    for split in ("train", "eval"):
        s = reopened.split(split)
        assert s.target_mask is not None and s.target_mask.shape == s.tokens.shape
        for d in range(s.n_docs):
            lo, hi = int(s.doc_offsets[d]), int(s.doc_offsets[d + 1])
            ids, mask = list(s.tokens[lo:hi]), list(s.target_mask[lo:hi])
            assert ids[-1] == tok.eot_id and mask[-1] == 0
            conv = template.parse(ids[:-1])
            rendered = template.render(conv)
            assert ids[:-1] == rendered.ids and mask[:-1] == rendered.target_mask()
            seen.append(conv)
    assert sorted(map(repr, seen)) == sorted(
        repr(template.parse(template.render(c).ids)) for c in CONVERSATIONS
    )
    with pytest.raises(ValueError, match=r"tokenizer\.chat_tokens = true"):
        prepare(cfg, byte_tokenizer(), tmp_path / "cache2")


def test_pack_masks_every_target_outside_the_assistant_replies() -> None:
    windows = np.array([[5, 6, 7, 256, 8, 9]])
    plain = pack(windows, eot_id=256)
    target = np.array([[0, 1, 1, 0, 1, 0]], dtype=np.uint8)
    masked = pack(windows, 256, target)
    assert plain["loss_mask"].tolist() == [[1, 1, 1, 0, 1]]
    assert masked["loss_mask"].tolist() == [[1, 1, 0, 0, 0]]
    for key in ("tokens", "targets", "positions", "segment_ids"):
        assert np.array_equal(plain[key], masked[key])


def _chat_store() -> tuple[TokenStore, ChatTemplate]:
    tok = byte_tokenizer(chat=True)
    template = ChatTemplate(tok)
    rendered = [template.render(c) for c in CONVERSATIONS]
    docs = [r.ids for r in rendered]
    masks = [r.target_mask() for r in rendered]
    store = TokenStore.from_documents(
        docs,
        docs,
        n_vocab=tok.n_vocab,
        eot_id=tok.eot_id,
        pad_id=tok.pad_id,
        target_masks=(masks, masks),
    )
    return store, template


def test_loader_and_eval_batches_train_only_assistant_targets() -> None:
    store, template = _chat_store()
    loader = TrainLoader(store, seq_len=16, global_batch=4, seed=0)
    split = store.split("train")
    assert split.target_mask is not None
    # Which token ids may be a target at all: the assistant's content bytes and <|end|>.
    allowed = {template.end_id}
    for conv in CONVERSATIONS:
        for m in conv:
            if m["role"] == "assistant":
                allowed |= set(m["content"].encode())
    for batch in [loader.batch(s) for s in range(6)] + list(eval_batches(store, 16, 4)):
        kept = batch["targets"][batch["loss_mask"] > 0]
        assert kept.size and set(kept.tolist()) <= allowed
    # Without the mask the same windows train on everything but the segment ends.
    plain = TokenStore.from_documents(
        [list(split.document(d)[:-1]) for d in range(split.n_docs)],
        n_vocab=store.n_vocab,
        eot_id=store.eot_id,
        pad_id=store.pad_id,
    )
    unmasked = TrainLoader(plain, seq_len=16, global_batch=4, seed=0).batch(0)
    masked = loader.batch(0)
    assert np.array_equal(unmasked["tokens"], masked["tokens"])
    assert (masked["loss_mask"] <= unmasked["loss_mask"]).all()
    assert masked["loss_mask"].sum() < unmasked["loss_mask"].sum()


def test_non_assistant_targets_change_neither_loss_nor_gradient() -> None:
    import jax
    import jax.numpy as jnp

    from jaxlab.config import load_config
    from jaxlab.model import make_model, split_model
    from jaxlab.train.step import token_losses

    store, _ = _chat_store()
    batch = TrainLoader(store, seq_len=16, global_batch=4, seed=0).batch(0)
    cfg = load_config(
        "tiny",
        ["tokenizer.kind=byte", "tokenizer.chat_tokens=true", "model.vocab_size=262"],
        environ={},
    )
    graphdef, params = split_model(make_model(cfg.model, cfg.train.precision, seed=0))

    def loss_and_grad(b: dict[str, np.ndarray]) -> tuple[float, float, object]:
        def f(p):
            total, n, _ = token_losses(graphdef, p, {k: jnp.asarray(v) for k, v in b.items()}, None)
            return total, n

        (total, n), grads = jax.value_and_grad(f, has_aux=True)(params)
        return float(total), float(n), grads

    changed = dict(batch)
    off = batch["loss_mask"] == 0
    rng = np.random.default_rng(0)
    changed["targets"] = np.where(off, rng.integers(0, 256, off.shape), batch["targets"]).astype(
        np.int32
    )
    assert (changed["targets"] != batch["targets"]).any()
    a_loss, a_n, a_grads = loss_and_grad(batch)
    b_loss, b_n, b_grads = loss_and_grad(changed)
    assert a_loss == b_loss and a_n == b_n == float(batch["loss_mask"].sum()) > 0
    assert all(
        np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(a_grads), jax.tree.leaves(b_grads), strict=True)
    )
    # A changed assistant target does change the loss: the mask is not all zeros.
    on = np.argwhere(batch["loss_mask"] > 0)[0]
    flipped = dict(batch)
    flipped["targets"] = batch["targets"].copy()
    flipped["targets"][tuple(on)] = (batch["targets"][tuple(on)] + 1) % 256
    assert loss_and_grad(flipped)[0] != a_loss
