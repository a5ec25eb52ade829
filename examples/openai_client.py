"""Talk to `jaxlab serve` with the official OpenAI Python client, unchanged.

    jaxlab train -c tiny --steps 200 --run-dir artifacts/runs/demo
    jaxlab serve --run-dir artifacts/runs/demo --port 8000        # in another terminal
    python examples/openai_client.py [BASE_URL] [API_KEY]

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
    print(f"model: {model}")

    # One completion: greedy (temperature 0), a stop string, usage accounting.
    done = client.completions.create(
        model=model, prompt="count: 3 4 5", max_tokens=32, temperature=0.0, stop=["\n"]
    )
    choice = done.choices[0]
    print(f"completion ({choice.finish_reason}): {choice.text!r}")
    if done.usage is not None:
        print(
            f"usage: {done.usage.prompt_tokens} prompt + {done.usage.completion_tokens} generated"
        )

    # Streaming (SSE): sampled with a seed, top_k as a jaxlab extension (extra_body).
    stream = client.completions.create(
        model=model,
        prompt="the cat",
        max_tokens=48,
        temperature=0.8,
        seed=7,
        stream=True,
        extra_body={"top_k": 40},
    )
    print("stream: ", end="")
    for chunk in stream:
        if chunk.choices:
            print(chunk.choices[0].text, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
