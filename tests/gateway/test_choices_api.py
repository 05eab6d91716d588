"""n > 1 and prompt_logprobs through a live stack (one prefill and one decode service, the real
SmolLM2 model), over HTTP with the official `openai` client and over gRPC. The prompt is prefilled
once on the prefill service (choice 0's first token); the decode service forks the other choices
from the delivered KV. Choice i draws with seed + i, so it equals a one-choice request with that
seed; a second gateway prefills locally on the decode service and gets the same answers. Every
block is back in the pools after each test, cancelled streams included."""

from __future__ import annotations

import time

import grpc
import httpx2
import openai
import pytest
import torch

from common.registry.embedded import free_port
from protos.splitserve.v1 import generation_pb2, types_pb2
from tests.stack.conftest import Stack

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPT = "Once upon a time, in a small village by the sea, there lived"
SAMPLED = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "max_tokens": 12}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("choices-stack"), num_prefill=1, num_decode=1)
    try:
        # A second gateway over the same services that prefills every prompt on the decode side.
        s.local_http_port = free_port()
        s.start("gateway-local", s.gateway_argv(free_port(), extra=(
            "--http-port", str(s.local_http_port), "--local-prefill-max-tokens", "100000")))
        s.wait_ready()
        yield s
    finally:
        s.close()


def openai_client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                         max_retries=0, timeout=300.0)


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai_client(stack.http_port)


@pytest.fixture(scope="module")
def local_client(stack: Stack) -> openai.OpenAI:
    for _ in range(600):  # its HTTP server comes up with its gRPC one
        try:
            if httpx2.get(f"http://127.0.0.1:{stack.local_http_port}/health",
                          timeout=2.0).status_code == 200:
                break
        except httpx2.HTTPError:
            pass
        time.sleep(0.5)
    return openai_client(stack.local_http_port)


@pytest.fixture(autouse=True)
def pools_back_to_full(stack: Stack):
    yield
    stack.wait_idle(30.0)


def complete(client: openai.OpenAI, extra_body: dict | None = None, **kwargs):
    return client.completions.create(model=MODEL, prompt=PROMPT,
                                     extra_body={"return_token_ids": True, **(extra_body or {})},
                                     **kwargs)


# ---- HTTP -----------------------------------------------------------------------------------
def test_completions_n_choices_equal_their_seeds_alone(client: openai.OpenAI,
                                                       local_client: openai.OpenAI, stack: Stack):
    out = complete(client, n=3, **SAMPLED)
    assert [c.index for c in out.choices] == [0, 1, 2]
    alone = [complete(client, n=1, **{**SAMPLED, "seed": SAMPLED["seed"] + i}).choices[0]
             for i in range(3)]
    assert [c.text for c in out.choices] == [a.text for a in alone]
    assert len({c.text for c in out.choices}) == 3
    assert [c.finish_reason for c in out.choices] == ["length"] * 3
    prompt_tokens = httpx2.post(f"http://127.0.0.1:{stack.http_port}/tokenize",
                                json={"prompt": PROMPT}, timeout=30.0).json()["count"]
    assert out.usage.prompt_tokens == prompt_tokens  # counted once
    assert out.usage.completion_tokens == sum(len(c.token_ids) for c in out.choices) == 36
    local = complete(local_client, n=3, **SAMPLED)  # the colocated path: the same answers
    assert [c.text for c in local.choices] == [c.text for c in out.choices]


def test_chat_greedy_choices_are_identical(client: openai.OpenAI):
    messages = [{"role": "user", "content": "Name a colour."}]
    out = client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=16,
                                         temperature=0.0)
    one = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                         temperature=0.0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert {c.message.content for c in out.choices} == {one.choices[0].message.content}
    assert out.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert out.usage.prompt_tokens == one.usage.prompt_tokens


def test_chat_stream_chunks_carry_the_choice_index(client: openai.OpenAI):
    messages = [{"role": "user", "content": "Tell me about the moon."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, n=2, **SAMPLED)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, n=2, stream=True,
        stream_options={"include_usage": True}, **SAMPLED))
    texts, reasons = {0: "", 1: ""}, {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            reasons[choice.index] = choice.finish_reason
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        whole.usage.completion_tokens)


def test_cancelled_stream_frees_every_choice(client: openai.OpenAI, stack: Stack):
    stream = complete(client, n=3, max_tokens=400, temperature=0.8, stream=True,
                      extra_body={"ignore_eos": True})
    seen = {c.choices[0].index for _, c in zip(range(20), stream, strict=False)}
    stream.close()
    assert seen <= {0, 1, 2} and 0 in seen
    # pools_back_to_full checks both services once the aborts landed


def test_invalid_n_is_a_400(client: openai.OpenAI):
    for n, words in ((0, "n must be at least 1"), (17, "n must be in [1, 16]")):
        with pytest.raises(openai.BadRequestError) as err:
            complete(client, n=n, max_tokens=4)
        assert words in str(err.value)


def test_completions_prompt_logprobs(client: openai.OpenAI, local_client: openai.OpenAI,
                                     smollm2_dir):
    """vLLM's shape: None, then {token id: {logprob, rank, decoded_token}} per prompt token
    (the token itself and the top-k); computed on the prefill service, or on the decode service
    with a local prefill; the values are HF's float32 log_softmax of the prompt."""
    from transformers import AutoModelForCausalLM
    got = []
    for c in (client, local_client):
        out = client_raw(c, {"model": MODEL, "prompt": PROMPT, "max_tokens": 2,
                             "temperature": 0.0, "prompt_logprobs": 2,
                             "return_token_ids": True})
        got.append((out["prompt_token_ids"], out["choices"][0]["prompt_logprobs"]))
    (ids, lps), (local_ids, local_lps) = got
    assert ids == local_ids and len(lps) == len(ids) and lps[0] is None
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for p in range(1, len(ids)):
        entry, local_entry, want = lps[p], local_lps[p], ref[p - 1]
        assert str(ids[p]) in entry and 1 <= len(entry) <= 3
        me = entry[str(ids[p])]
        assert me["logprob"] == pytest.approx(want[ids[p]].item(), abs=1e-4)
        assert me["rank"] == int((want > want[ids[p]]).sum()) + 1
        top = want.topk(2).indices.tolist()
        assert [entry[str(t)]["rank"] for t in top] == [1, 2]
        assert local_entry.keys() == entry.keys()
        assert local_entry[str(ids[p])]["logprob"] == pytest.approx(me["logprob"], abs=1e-4)


def client_raw(c: openai.OpenAI, body: dict) -> dict:
    """A body the openai client's types would drop fields of (choices[].prompt_logprobs)."""
    r = httpx2.post(f"{c.base_url}completions", json=body, timeout=300.0)
    assert r.status_code == 200, r.text
    return r.json()


# ---- gRPC -----------------------------------------------------------------------------------
def test_grpc_n_streams_indexed_messages_and_generate_lists_choices(stack: Stack):
    params = types_pb2.SamplingParams(max_tokens=10, temperature=0.9, seed=99, n=2)
    request = generation_pb2.GenerateStreamRequest(prompt=PROMPT, params=params)
    tokens: dict[int, list[int]] = {0: [], 1: []}
    msgs = list(stack.stub.GenerateStream(request, timeout=300.0))
    for m in msgs:
        tokens[m.index].extend(m.token_ids)
    assert [m.index for m in msgs if m.finish_reason].count(0) == 1
    assert msgs[-1].HasField("usage") and msgs[-1].usage.completion_tokens == 20
    assert not any(m.HasField("usage") for m in msgs[:-1])
    whole = stack.stub.Generate(generation_pb2.GenerateRequest(prompt=PROMPT, params=params),
                                timeout=300.0)
    assert [list(c.token_ids) for c in whole.choices] == [tokens[0], tokens[1]]
    assert list(whole.token_ids) == tokens[0] and whole.usage.completion_tokens == 20
    one = stack.stub.Generate(generation_pb2.GenerateRequest(
        prompt=PROMPT, params=types_pb2.SamplingParams(max_tokens=10, temperature=0.9,
                                                       seed=100)), timeout=300.0)
    assert list(one.token_ids) == tokens[1] and not one.choices


def test_grpc_bad_n_is_invalid_argument(stack: Stack):
    for n in (0, 17):
        with pytest.raises(grpc.RpcError) as err:
            stack.stub.Generate(generation_pb2.GenerateRequest(
                prompt=PROMPT, params=types_pb2.SamplingParams(max_tokens=4, n=n)), timeout=60.0)
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT, err.value.details()


def test_grpc_resumable_n_reconnects_exactly(stack: Stack):
    """A resumable n = 2 stream dropped after three messages and resumed with the tokens and
    messages received gives, over both connections, the messages of an unbroken stream."""
    params = types_pb2.SamplingParams(max_tokens=12, temperature=0.9, seed=7, n=2)
    whole = list(stack.stub.GenerateStream(generation_pb2.GenerateStreamRequest(
        prompt=PROMPT, params=params), timeout=300.0))
    call = stack.stub.GenerateStream(generation_pb2.GenerateStreamRequest(
        request_id="n2-resumable", resumable=True, prompt=PROMPT, params=params), timeout=300.0)
    first = [next(call) for _ in range(3)]
    call.cancel()  # the connection drops; the request goes on
    rest = list(stack.stub.GenerateStream(generation_pb2.GenerateStreamRequest(
        request_id="n2-resumable", resume=generation_pb2.Resume(
            num_tokens_received=sum(len(m.token_ids) for m in first),
            num_messages_received=len(first))), timeout=300.0))
    got = first + rest

    def choices(msgs):
        out: dict[int, tuple[list[int], str, int]] = {}
        for m in msgs:
            tokens, text, finish = out.get(m.index, ([], "", 0))
            out[m.index] = (tokens + list(m.token_ids), text + m.text, finish or m.finish_reason)
        return out

    assert choices(got) == choices(whole)
    assert got[-1].usage.completion_tokens == whole[-1].usage.completion_tokens == 24


def test_grpc_prompt_logprobs(stack: Stack):
    out = stack.stub.Generate(generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=[1, 504, 3444, 314, 253]),
        params=types_pb2.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)),
        timeout=300.0)
    assert [lp.token_id for lp in out.prompt_logprobs] == [504, 3444, 314, 253]
    assert all(len(lp.top) == 1 and lp.rank >= 1 and lp.logprob <= 0
               for lp in out.prompt_logprobs)
