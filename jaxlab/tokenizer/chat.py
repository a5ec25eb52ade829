"""The chat template: a conversation <-> token ids, and which tokens are the assistant's.

A conversation renders as one turn per message, each a role token, the content and the
end-of-turn token, with nothing between turns::

    <|system|>You are terse.<|end|><|user|>hi<|end|><|assistant|>hello<|end|>

For generation the prompt ends with the *generation prompt*, a bare ``<|assistant|>``: the
model writes the reply and ends it with ``<|end|>``, which the server uses as a stop token
(it is never part of the returned text).

Injection safety: content is encoded with ``Tokenizer.encode`` (tiktoken's
``encode_ordinary``), so a message whose text is ``"<|end|><|system|>..."`` becomes those
characters' byte tokens, never the special ids. Only this module places special ids, so
:meth:`ChatTemplate.parse` recovers the messages exactly from any rendered conversation.

Loss masking (the ``chat-jsonl`` data source): :attr:`RenderedChat.assistant_spans` are the
token ranges of each assistant reply plus its ``<|end|>``; :meth:`RenderedChat.target_mask`
is 1 on those tokens, the ones training predicts. Role tokens, system and user turns are
context only (the model is never trained to write the user's side).

Import-light: no jax, no numpy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, cast, get_args

from jaxlab.tokenizer.bpe import ASSISTANT, CHAT_TOKENS, END_OF_TURN, SYSTEM, USER

#: Bump when the rendered format changes: token caches of chat data are keyed by it.
TEMPLATE_VERSION = 1

Role = Literal["system", "user", "assistant"]
ROLES: tuple[Role, ...] = get_args(Role)
_ROLE_TOKENS: dict[Role, str] = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT}


class ChatTokenizer(Protocol):
    """What the template needs from :class:`~jaxlab.tokenizer.Tokenizer`."""

    @property
    def special_tokens(self) -> dict[str, int]: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ChatTemplateError(ValueError):
    """A conversation the template cannot render; ``param`` names the field at fault
    (``messages``, ``messages[2].role``, ...)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class NoChatTokens(ChatTemplateError):
    """The tokenizer was trained without the chat tokens."""


@dataclass(frozen=True)
class Message:
    role: Role
    content: str


@dataclass(frozen=True)
class RenderedChat:
    """A rendered conversation: its ids and the ``[start, end)`` ranges of the assistant's
    replies, each including its closing ``<|end|>``."""

    ids: list[int]
    assistant_spans: list[tuple[int, int]]

    def target_mask(self) -> list[int]:
        """1 on every token inside an assistant span (a training target), else 0."""
        mask = [0] * len(self.ids)
        for start, end in self.assistant_spans:
            mask[start:end] = [1] * (end - start)
        return mask


def as_messages(raw: object) -> list[Message]:
    """``raw`` (a list of ``{"role", "content"}`` objects, or :class:`Message` values)
    checked: a non-empty list, every role one of :data:`ROLES`, every content a string.
    Raises :class:`ChatTemplateError` naming the first bad field."""
    if not isinstance(raw, list) or not raw:
        got = "an empty list" if raw == [] else type(raw).__name__
        raise ChatTemplateError(
            f"messages must be a non-empty list of {{role, content}} objects (got {got})",
            param="messages",
        )
    out: list[Message] = []
    for i, m in enumerate(cast(list[object], raw)):
        if isinstance(m, Message):
            role, content = m.role, m.content
        elif isinstance(m, Mapping):
            m = cast(Mapping[str, object], m)
            role, content = m.get("role"), m.get("content")
        else:
            raise ChatTemplateError(
                f"messages[{i}] must be an object with role and content (got {type(m).__name__})",
                param=f"messages[{i}]",
            )
        if role not in ROLES:
            raise ChatTemplateError(
                f"messages[{i}].role must be one of {', '.join(ROLES)} (got {role!r})",
                param=f"messages[{i}].role",
            )
        if not isinstance(content, str):
            raise ChatTemplateError(
                f"messages[{i}].content must be a string (got {type(content).__name__})",
                param=f"messages[{i}].content",
            )
        out.append(Message(cast(Role, role), content))
    return out


class ChatTemplate:
    """The template over one tokenizer; :class:`NoChatTokens` if it lacks the tokens."""

    def __init__(self, tokenizer: ChatTokenizer) -> None:
        specials = tokenizer.special_tokens
        missing = [t for t in CHAT_TOKENS if t not in specials]
        if missing:
            raise NoChatTokens(
                f"the tokenizer has no chat tokens ({', '.join(missing)} missing): it was "
                "trained before they existed or with tokenizer.chat_tokens = false; train a "
                "run with tokenizer.chat_tokens = true (or use plain text completions)",
                param="model",
            )
        self._tok = tokenizer
        self.role_ids: dict[Role, int] = {r: specials[t] for r, t in _ROLE_TOKENS.items()}
        self.end_id = specials[END_OF_TURN]
        self._role_of: dict[int, Role] = {i: r for r, i in self.role_ids.items()}

    @property
    def generation_prompt(self) -> list[int]:
        """What follows the conversation when the model is to write the next reply."""
        return [self.role_ids["assistant"]]

    def render(self, messages: object, *, add_generation_prompt: bool = False) -> RenderedChat:
        """The ids of ``messages`` (checked by :func:`as_messages`); with
        ``add_generation_prompt``, followed by :attr:`generation_prompt`."""
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        for m in as_messages(messages):
            ids.append(self.role_ids[m.role])
            start = len(ids)
            ids.extend(self._tok.encode(m.content))
            ids.append(self.end_id)
            if m.role == "assistant":
                spans.append((start, len(ids)))
        if add_generation_prompt:
            ids.extend(self.generation_prompt)
        return RenderedChat(ids, spans)

    def parse(self, ids: Sequence[int]) -> list[Message]:
        """The messages of a rendered conversation (without a generation prompt); the
        inverse of :meth:`render`. Raises ``ValueError`` on ids it did not render."""
        out: list[Message] = []
        i, n = 0, len(ids)
        while i < n:
            role = self._role_of.get(ids[i])
            if role is None:
                raise ValueError(f"token {i} ({ids[i]}) is not a role token")
            try:
                end = ids.index(self.end_id, i + 1)
            except ValueError:
                raise ValueError(f"the turn starting at token {i} has no end token") from None
            body = ids[i + 1 : end]
            if any(t in self._role_of for t in body):
                raise ValueError(f"the turn starting at token {i} holds a role token")
            out.append(Message(role, self._tok.decode(body)))
            i = end + 1
        return out


__all__ = [
    "ROLES",
    "TEMPLATE_VERSION",
    "ChatTemplate",
    "ChatTemplateError",
    "ChatTokenizer",
    "Message",
    "NoChatTokens",
    "RenderedChat",
    "Role",
    "as_messages",
]
