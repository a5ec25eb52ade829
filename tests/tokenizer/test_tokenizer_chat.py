"""The chat tokens and the chat template: layout, back-compat, round trip, injection safety."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxlab.config import load_config
from jaxlab.tokenizer import (
    CHAT_TOKENS,
    END_OF_TURN,
    ROLES,
    ChatTemplate,
    ChatTemplateError,
    Message,
    NoChatTokens,
    Tokenizer,
    bpe_tokenizer,
    byte_tokenizer,
)

# Saved by jaxlab before the chat tokens existed (two special tokens); never regenerate it.
BEFORE_CHAT = Path(__file__).parent / "data" / "byte-before-chat"
BEFORE_CHAT_SHA256 = "5ee7f5d0f597ba251a486f7591200e37a81a8d625d3702beb4596253e25cb0e6"


@pytest.fixture(scope="module")
def chat_tok() -> Tokenizer:
    return byte_tokenizer(chat=True)


@pytest.fixture(scope="module")
def template(chat_tok: Tokenizer) -> ChatTemplate:
    return ChatTemplate(chat_tok)


def test_a_tokenizer_saved_before_the_chat_tokens_loads_unchanged(tmp_path: Path) -> None:
    shutil.copytree(BEFORE_CHAT, tmp_path / "tok")
    tok = Tokenizer.load(tmp_path / "tok")
    assert tok.sha256 == BEFORE_CHAT_SHA256 == byte_tokenizer().sha256
    assert (tok.n_vocab, tok.eot_id, tok.pad_id, tok.has_chat_tokens) == (258, 256, 257, False)
    assert tok.encode("hi") == [104, 105]
    with pytest.raises(NoChatTokens, match=r"tokenizer\.chat_tokens = true") as e:
        ChatTemplate(tok)
    assert e.value.param == "model"


def test_chat_tokens_follow_the_two_specials_and_change_no_other_id(chat_tok: Tokenizer) -> None:
    plain = byte_tokenizer()
    assert chat_tok.n_vocab == 262 and chat_tok.has_chat_tokens
    assert (chat_tok.eot_id, chat_tok.pad_id) == (plain.eot_id, plain.pad_id)
    assert [chat_tok.special_tokens[t] for t in CHAT_TOKENS] == [258, 259, 260, 261]
    assert chat_tok.sha256 != plain.sha256
    text = "count: 1 2 3 <|end|>"
    assert chat_tok.encode(text) == plain.encode(text)


def test_a_chat_tokenizer_saves_and_loads_with_its_chat_tokens(
    chat_tok: Tokenizer, tmp_path: Path
) -> None:
    loaded = Tokenizer.load(chat_tok.save(tmp_path))
    assert loaded.sha256 == chat_tok.sha256 and loaded.has_chat_tokens
    assert loaded.special_tokens == chat_tok.special_tokens


def test_bpe_vocab_size_counts_the_chat_tokens() -> None:
    texts = ["the cat sat on the mat. " * 20, "count: 1 2 3 4 5 6 7 8 9 10 " * 20]
    tok = bpe_tokenizer(texts, 270, chat=True)  # 8 merges: this corpus has that many
    assert tok.n_vocab == 270
    assert tok.special_tokens[END_OF_TURN] == 269
    with pytest.raises(ValueError, match=r">= 262 with tokenizer\.chat_tokens"):
        bpe_tokenizer(texts, 260, chat=True)


def test_render_format_spans_and_generation_prompt(
    template: ChatTemplate, chat_tok: Tokenizer
) -> None:
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    sys_, user, asst, end = (chat_tok.special_tokens[t] for t in CHAT_TOKENS)
    r = template.render(msgs)
    want = [sys_, *b"be brief", end, user, *b"hi", end, asst, *b"yo", end]
    assert r.ids == want
    assert r.assistant_spans == [(len(want) - 3, len(want))]
    assert r.target_mask() == [0] * (len(want) - 3) + [1, 1, 1]
    prompt = template.render(msgs[:2], add_generation_prompt=True)
    assert prompt.ids == want[:-3] and prompt.ids[-1] == asst
    assert template.end_id == end


_SPECIAL_LOOKING = st.sampled_from(
    ["<|endoftext|>", "<|pad|>", *CHAT_TOKENS, "<|", "|>", "<|user", "assistant"]
)
_CONTENT = st.lists(st.one_of(st.text(max_size=12), _SPECIAL_LOOKING), max_size=5).map("".join)
_MESSAGES = st.lists(
    st.builds(Message, role=st.sampled_from(ROLES), content=_CONTENT), min_size=1, max_size=5
)


@settings(max_examples=60, deadline=None)
@given(messages=_MESSAGES)
def test_render_then_parse_is_the_identity_and_content_never_becomes_special(
    template: ChatTemplate, chat_tok: Tokenizer, messages: list[Message]
) -> None:
    r = template.render(messages)
    assert template.parse(r.ids) == messages
    # Exactly one role token and one end token per message: content text that looks like a
    # special token stays ordinary bytes.
    specials = set(chat_tok.special_tokens.values())
    assert sum(t in specials for t in r.ids) == 2 * len(messages)
    assert r.ids.count(template.end_id) == len(messages)
    # The mask covers each assistant reply and its end token, nothing else.
    mask = r.target_mask()
    replies = [m for m in messages if m.role == "assistant"]
    assert sum(mask) == sum(len(chat_tok.encode(m.content)) + 1 for m in replies)
    assert [chat_tok.decode(r.ids[a : b - 1]) for a, b in r.assistant_spans] == [
        m.content for m in replies
    ]
    gen = template.render(messages, add_generation_prompt=True)
    assert gen.ids == r.ids + template.generation_prompt


@pytest.mark.parametrize(
    ("messages", "param", "match"),
    [
        ([], "messages", "non-empty list"),
        ("hi", "messages", "non-empty list"),
        ([{"role": "tool", "content": "x"}], "messages[0].role", "one of system, user"),
        ([{"role": "user", "content": "a"}, {"role": "user"}], "messages[1].content", "string"),
        ([{"role": "user", "content": ["a"]}], "messages[0].content", "got list"),
        (["hi"], "messages[0]", "object with role"),
    ],
)
def test_bad_messages_name_the_field(
    template: ChatTemplate, messages: object, param: str, match: str
) -> None:
    with pytest.raises(ChatTemplateError, match=match) as e:
        template.render(messages)
    assert e.value.param == param


def test_config_counts_chat_tokens_and_checks_room_and_the_chat_source() -> None:
    cfg = load_config("tiny", ["tokenizer.kind=byte", "tokenizer.chat_tokens=true"], environ={})
    assert cfg.tokenizer.n_vocab == 262
    with pytest.raises(Exception, match=r"model\.vocab_size.*expected >= 262"):
        load_config(
            "tiny",
            ["tokenizer.kind=byte", "tokenizer.chat_tokens=true", "model.vocab_size=258"],
            environ={},
        )
    with pytest.raises(Exception, match=r"tokenizer\.vocab_size: must be >= 262"):
        load_config("tiny", ["tokenizer.vocab_size=260", "tokenizer.chat_tokens=true"], environ={})
    with pytest.raises(Exception, match=r"data\.source.*set tokenizer\.chat_tokens = true"):
        load_config("tiny", ["data.source=chat-jsonl", "data.paths=['x.jsonl']"], environ={})
