"""The `openai` package against mlx-serve: whole answers, streams, logprobs,
errors. Usage: openai_client.py BASE_URL MODEL; prints "ok" and exits 0."""

import sys

import openai

base_url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url + "/v1", api_key="local", max_retries=0)
question = [{"role": "user", "content": "What is the capital of France?"}]

assert model in [m.id for m in client.models.list().data]

whole = client.chat.completions.create(
    model=model, messages=question, max_tokens=8, temperature=0
)
text = whole.choices[0].message.content
assert "Paris" in text, text
assert whole.choices[0].finish_reason in ("stop", "length")
usage = whole.usage
assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens, usage

chunks = list(
    client.chat.completions.create(
        model=model,
        messages=question,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
)
streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
assert streamed == text, (streamed, text)
assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == usage.completion_tokens

with_logprobs = client.chat.completions.create(
    model=model, messages=question, max_tokens=8, logprobs=True, top_logprobs=2
)
tokens = with_logprobs.choices[0].logprobs.content
assert "".join(t.token for t in tokens) == with_logprobs.choices[0].message.content
assert all(t.top_logprobs[0].token == t.token for t in tokens)

try:
    client.chat.completions.create(model="not-served", messages=question)
    raise AssertionError("an unknown model was answered")
except openai.BadRequestError as e:
    assert e.status_code == 400 and "not-served" in str(e), e

print("ok")
