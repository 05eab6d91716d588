"""Hypothesis fuzzing of the gateway's OpenAI-compatible HTTP API on a running stack (dummy
tiny-llama model: token-id prompts only; vocabulary 512, context 2048).

Any body (random bytes, JSON of the wrong shape, out-of-range or absurd parameters, unknown
models, thousands of stop strings) gets 200 with a well-formed answer, or a 4xx with an
OpenAI-style error body (400 for a bad request, 404 for an unknown model), never a 5xx; the
services stay up and nothing stays referenced.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.registry.embedded import free_port
from tests.cluster import Cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "dummy:tiny-llama"
FUZZ = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    port = free_port()
    c = Cluster(tmp_path_factory.mktemp("http-fuzz-logs"), MODEL, num_prefill=1, num_decode=1,
                engine_flags=["--device", "cpu", "--num-kv-blocks", "256"],
                gateway_flags=["--http-port", str(port)])
    try:
        c.wait_ready(timeout_s=120)
        yield f"http://127.0.0.1:{port}"
        assert all(p.poll() is None for p in c.procs.values()), c.logs()
        assert c.wait_idle(timeout_s=15) == {}
    finally:
        c.close()


def post(url: str, body: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def check(status: int, raw: bytes, stream: bool) -> None:
    assert status in (200, 400, 404), (status, raw[:300])
    if status != 200:
        err = json.loads(raw)["error"]
        assert err["message"] and err["code"] == status
    elif stream:
        events = [line for line in raw.decode().split("\n\n") if line]
        assert events[-1] == "data: [DONE]"
        assert all(e.startswith("data: ") for e in events)
    else:
        body = json.loads(raw)
        assert body["choices"] and body["usage"]["completion_tokens"] >= 1


junk = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                 st.text(max_size=10), st.lists(st.integers(-5, 600), max_size=5))
FIELDS = {
    "model": st.one_of(st.sampled_from([MODEL, "gpt-4o", ""]), junk),
    "max_tokens": st.one_of(st.integers(-3, 6), st.integers(-2**40, 2**40), junk),
    "temperature": st.one_of(st.floats(), junk), "top_p": st.one_of(st.floats(), junk),
    "top_k": st.one_of(st.integers(-2**40, 2**40), junk),
    "min_p": st.floats(), "seed": st.one_of(st.integers(-2**70, 2**70), junk),
    "min_tokens": st.one_of(st.integers(-2, 4), st.integers(0, 2**40)),
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=3), max_size=3000), junk),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2**40, 2**40), max_size=4), junk),
    "presence_penalty": st.floats(), "frequency_penalty": st.floats(),
    "repetition_penalty": st.floats(), "n": st.integers(-1, 3), "echo": st.booleans(),
    "logprobs": st.one_of(st.none(), st.integers(-1, 30)), "ignore_eos": st.booleans(),
    "stream": st.booleans(), "return_token_ids": st.booleans(),
}


@st.composite
def completion_bodies(draw) -> dict:
    body = {k: draw(v) for k, v in FIELDS.items() if draw(st.booleans())}
    body["prompt"] = draw(st.one_of(
        st.lists(st.integers(0, 511), min_size=1, max_size=32),
        st.lists(st.integers(-2**40, 2**40), max_size=4),
        st.lists(st.integers(0, 511), min_size=2040, max_size=2100),
        st.text(max_size=20), junk))
    if draw(st.booleans()) and isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # keep most valid ones short
    return body


@FUZZ
@given(body=completion_bodies())
def test_completions(http, body):
    if not isinstance(body.get("max_tokens"), int) or body["max_tokens"] > 64:
        body["max_tokens"] = body.get("max_tokens") if isinstance(body.get("max_tokens"), int) \
            and body["max_tokens"] > 2048 else 8  # huge: refused; else short
    status, raw = post(f"{http}/v1/completions", json.dumps(body).encode())
    check(status, raw, stream=status == 200 and body.get("stream") is True)


@FUZZ
@given(body=st.fixed_dictionaries({"messages": st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "robot", "system"]),
                                     "content": st.one_of(st.text(max_size=10), junk)}),
             max_size=3), junk)}, optional={k: FIELDS[k] for k in ("model", "max_tokens",
                                                                    "temperature", "stop")}))
def test_chat_completions(http, body):
    status, raw = post(f"{http}/v1/chat/completions", json.dumps(body).encode())
    # The dummy model has no tokenizer or chat template: chat is always refused, never a 5xx.
    assert status in (400, 404), (status, raw[:300])
    assert json.loads(raw)["error"]["code"] == status


@FUZZ
@given(data=st.binary(max_size=200))
def test_random_bodies(http, data):
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, raw = post(f"{http}{path}", data)
        assert status == 400, (status, raw[:300])


def test_named_http_refusals(http):
    url = f"{http}/v1/completions"
    cases = [
        ({"model": "gpt-4o", "prompt": [5, 6]}, 404),
        ({"prompt": [5, 6], "max_tokens": -1}, 400),
        ({"prompt": [5, 6], "max_tokens": 10**12}, 400),
        ({"prompt": [5, 6], "stop": ["x"] * 5000}, 400),
        ({"prompt": [5] * 300_000}, 400),
        ({"prompt": [600]}, 400),
        ({"prompt": []}, 400),
        ({"prompt": "no tokenizer here"}, 400),
        ({"prompt": [5, 6], "top_k": 2**40}, 400),
        ({"prompt": [5, 6], "stop_token_ids": [2**40]}, 400),
        ({"prompt": [5, 6], "min_tokens": 2**40, "max_tokens": 4}, 400),
    ]
    for body, want in cases:
        status, raw = post(url, json.dumps(body).encode())
        assert status == want, (body if len(json.dumps(body)) < 200 else "big", raw[:300])
    status, raw = post(url, b'{"prompt": "\xff\xfe"}')  # not UTF-8
    assert status == 400
