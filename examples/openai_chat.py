"""Chat with `jaxlab serve` through the official OpenAI Python client, unchanged.

The served run's tokenizer needs the chat tokens (docs/serving.md, "Chat"):

    jaxlab train -c tiny --steps 200 --run-dir artifacts/runs/chat \
        --set tokenizer.chat_tokens=true
    jaxlab serve --run-dir artifacts/runs/chat --port 8000        # in another terminal
    python examples/openai_chat.py [BASE_URL] [API_KEY]

A run trained on plain text (as above) knows the chat format but not how to answer; to
fine-tune on conversations add ``--set data.source=chat-jsonl --set data.paths=[chats.jsonl]``
(one ``{"messages": [...]}`` per line; only the assistant's replies are trained).

BASE_URL defaults to http://127.0.0.1:8000/v1. Any API key works unless the server was
started with serve.api_key (JAXLAB_SERVE__API_KEY=...), then it must match.
"""

from __future__ import annotations

import sys

from openai import OpenAI


def main() -> None:
    base_url = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000/v1"
    api_key = sys.argv[2] if len(sys.argv) > 2 else "unused"
    client = OpenAI(base_url=base_url, api_key=api_key)
    model = client.models.list().data[0].id

    # One answer: greedy, at most 24 tokens; the reply ends at the model's end-of-turn token.
    done = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "You count."},
            {"role": "user", "content": "count: 3 4 5"},
        ],
        max_tokens=24,
        temperature=0.0,
    )
    choice = done.choices[0]
    print(f"chat ({choice.finish_reason}): {choice.message.role}: {choice.message.content!r}")
    if done.usage is not None:
        print(
            f"usage: {done.usage.prompt_tokens} prompt + {done.usage.completion_tokens} generated"
        )

    # Streaming (SSE): a role delta first, then content deltas; sampled with a seed.
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "the cat"}],
        max_tokens=32,
        temperature=0.8,
        seed=7,
        stream=True,
    )
    print("stream: ", end="")
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
