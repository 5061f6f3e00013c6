"""The official `openai` Python client against a running `kiln serve`.

Usage: python openai_client.py BASE_URL MODEL_ID
Checks completions and chat, streaming and not, stop strings, seed reproducibility, log
probabilities, and that the client raises the right errors. Exits non-zero on the first failure.
"""

import sys

import openai


def main() -> None:
    base_url, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)

    ids = [m.id for m in client.models.list().data]
    assert ids == [model], ids

    prompt = "The three primary colours are"
    whole = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
    text = whole.choices[0].text
    assert whole.object == "text_completion", whole.object
    assert text, whole
    assert whole.choices[0].finish_reason in ("length", "stop"), whole.choices[0].finish_reason
    assert whole.usage.completion_tokens == 12 or whole.choices[0].finish_reason == "stop", whole.usage
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True)
        if c.choices
    )
    assert streamed == text, (streamed, text)

    # Stop strings: the answer ends right before the first stop string, which never shows.
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    cut = text[: text.index(stop)]
    for stream in (False, True):
        if stream:
            got = "".join(
                c.choices[0].text
                for c in client.completions.create(
                    model=model, prompt=prompt, max_tokens=12, temperature=0, stop=[stop], stream=True
                )
                if c.choices
            )
        else:
            r = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0, stop=stop)
            got = r.choices[0].text
            assert r.choices[0].finish_reason == "stop", r
        assert got == cut, (stream, stop, got, cut)
        assert stop not in got

    # Seeds: the same seed gives the same sample, another seed (almost surely) another.
    def sample(seed: int) -> str:
        r = client.completions.create(model=model, prompt="My favourite animal is", max_tokens=16, temperature=1.0, seed=seed)
        return r.choices[0].text

    a, b, c = sample(1234), sample(1234), sample(98765)
    assert a == b, (a, b)
    assert a != c, (a, c)

    # Log-probabilities.
    r = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4, lp
    assert all(len(t) <= 3 for t in lp.top_logprobs), lp
    assert all(x <= 0 for x in lp.token_logprobs), lp

    # Chat, whole and streamed.
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 2?"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    assert chat.object == "chat.completion", chat.object
    answer = chat.choices[0].message.content
    assert chat.choices[0].message.role == "assistant"
    assert answer, chat
    assert chat.usage.completion_tokens <= 10
    chunks = list(client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content), r

    # Chat with a stop string and a seed.
    s1 = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0.9, seed=7)
    s2 = client.chat.completions.create(model=model, messages=messages, max_tokens=12, temperature=0.9, seed=7)
    assert s1.choices[0].message.content == s2.choices[0].message.content

    # Errors surface as the client's exception types.
    for kwargs, exc in [
        (dict(model=model, prompt="hi", n=2), openai.BadRequestError),
        (dict(model=model, prompt="hi", temperature=9), openai.BadRequestError),
        (dict(model="no-such-model", prompt="hi"), openai.NotFoundError),
    ]:
        try:
            client.completions.create(**kwargs)
        except exc as e:
            assert e.body and e.body.get("message"), e.body
        else:
            raise AssertionError(f"{kwargs} did not raise {exc.__name__}")

    print("openai client: all checks passed")


if __name__ == "__main__":
    main()
