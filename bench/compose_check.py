"""`make compose-test`'s requests: the stack in containers answers as it does under `make run`.

    python -m bench.compose_check --base-url http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse

import openai


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=args.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    models = [m.id for m in client.models.list().data]
    model = models[0]
    done = client.completions.create(model=model, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert done.usage.completion_tokens >= 1, done
    chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi."}],
                                            max_tokens=8, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text, "the stream carried no text"
    print(f"models {models}; completion {done.choices[0].text!r}; chat stream {text!r}: ok")


if __name__ == "__main__":
    main()
