"""The gateway's OpenAI-compatible HTTP API, called with the official `openai` client, against a
small live stack (one prefill and one decode service, the real SmolLM2 model). Answers must equal
the gRPC API's token for token: both go the same way through the gateway."""

from __future__ import annotations

import threading

import httpx2
import openai
import pytest

from common.registry.embedded import free_port
from protos.splitserve.v1 import generation_pb2, types_pb2
from tests.stack.conftest import Stack

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "Name three colors of the rainbow."


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("http-stack"), num_prefill=1, num_decode=1)
    try:
        s.wait_ready()
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="unused",
                         max_retries=0, timeout=120.0)


def grpc_answer(stack: Stack, request: generation_pb2.GenerateRequest):
    return stack.stub.Generate(request, timeout=120.0)


def test_models(client: openai.OpenAI):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_chat_stream_equals_grpc(stack: Stack, client: openai.OpenAI):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
        temperature=0.0, stream=True, stream_options={"include_usage": True},
        extra_body={"return_token_ids": True}))
    want = grpc_answer(stack, generation_pb2.GenerateRequest(
        messages=generation_pb2.ChatMessages(messages=[
            generation_pb2.ChatMessage(role="user", content=QUESTION)]),
        params=types_pb2.SamplingParams(max_tokens=12, temperature=0.0)))
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in body) == want.text
    assert [t for c in body for t in c.choices[0].model_extra["token_ids"]] == list(want.token_ids)
    assert body[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (want.usage.prompt_tokens, 12)
    assert len({c.id for c in chunks}) == 1


def test_completion_stream_non_stream_and_grpc_agree(stack: Stack, client: openai.OpenAI):
    prompt = "The capital of France is"
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                              temperature=0.0, stream=True))
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                      temperature=0.0, extra_body={"return_token_ids": True})
    want = grpc_answer(stack, generation_pb2.GenerateRequest(
        prompt=prompt, params=types_pb2.SamplingParams(max_tokens=10, temperature=0.0)))
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text == want.text
    assert whole.choices[0].model_extra["token_ids"] == list(want.token_ids)
    assert whole.model_extra["prompt_token_ids"] == list(
        stack.stub.Tokenize(generation_pb2.TokenizeRequest(prompt=prompt)).token_ids)
    assert (whole.usage.completion_tokens, whole.choices[0].finish_reason) == (10, "length")
    assert streamed[-1].choices[0].finish_reason == "length"


def test_stop_and_seed(client: openai.OpenAI):
    prompt = [{"role": "user", "content": "Count from one to ten in words."}]
    full = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=40,
                                          temperature=0.0).choices[0].message.content
    stop = full.split()[2]
    stopped = client.chat.completions.create(model=MODEL, messages=prompt, max_tokens=40,
                                             temperature=0.0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].message.content == full[:full.index(stop)]
    sampled = [client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16,
                                         temperature=1.0, seed=1234).choices[0].text
               for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_openai_shaped_errors(stack: Stack, client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert bad.value.status_code == 400
    assert bad.value.body["type"] == "invalid_request_error"
    assert "max_tokens" in bad.value.body["message"]
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert missing.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)
    raw = httpx2.post(f"http://127.0.0.1:{stack.http_port}/v1/completions", content=b"{nope",
                      headers={"content-type": "application/json"}, timeout=30)
    assert raw.status_code == 400
    assert set(raw.json()["error"]) == {"message", "type", "param", "code"}


def gateway_client(stack: Stack, name: str, namespace: str | None = None,
                   extra: tuple[str, ...] = ()) -> openai.OpenAI:
    """Another gateway on the stack's registry, with its own flags; an OpenAI client for it."""
    http_port = free_port()
    stack.start(name, stack.gateway_argv(free_port(), namespace=namespace,
                                         extra=("--http-port", str(http_port), *extra)))
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="unused",
                           max_retries=0, timeout=60.0)
    for _ in range(300):  # up in about a second
        try:
            client.models.list()
            return client
        except openai.APIConnectionError:
            threading.Event().wait(0.1)
    raise TimeoutError(f"gateway {name} did not serve HTTP")


def test_status_codes_of_overload_no_instance_and_deadline(stack: Stack):
    empty = gateway_client(stack, "gw-empty", namespace="no-such-stack")
    with pytest.raises(openai.InternalServerError) as unavailable:
        empty.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert unavailable.value.status_code == 503
    hurried = gateway_client(stack, "gw-hurried", extra=("--request-timeout-s", "0.001"))
    with pytest.raises(openai.APIStatusError) as late:
        hurried.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert late.value.status_code == 504
    single = gateway_client(stack, "gw-single", extra=("--max-inflight", "1"))
    first = single.completions.create(model=MODEL, prompt="Tell a long story.", max_tokens=200,
                                      temperature=0.0, stream=True)
    next(iter(first))  # in flight now
    with pytest.raises(openai.RateLimitError) as busy:
        single.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert busy.value.status_code == 429 and busy.value.body["type"] == "rate_limit_error"
    first.close()


def test_logprobs_from_prefill_and_decode(client: openai.OpenAI):
    """The first token's log-probabilities come from the prefill service, the rest from decode."""
    done = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                                     temperature=0.0, logprobs=3)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == done.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 3 and value <= 0.0
        assert top[token] == max(top.values()) == pytest.approx(value)  # greedy: the top token
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], max_tokens=6,
        temperature=0.0, logprobs=True, top_logprobs=2, stream=True))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert len(entries) == 6
    assert "".join(e.token for e in entries) == "".join(
        c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in entries)
