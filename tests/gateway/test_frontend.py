"""Tokenization and validation at the gateway (real SmolLM2 tokenizer; no torch needed)."""

from __future__ import annotations

import pytest

from common.errors import InvalidRequestError
from common.text.tokenizer import Tokenizer
from gateway.frontend import Frontend
from protos.splitserve.v1 import generation_pb2, types_pb2


@pytest.fixture(scope="module")
def frontend(smollm2_dir) -> Frontend:
    return Frontend("SmolLM2-135M-Instruct", Tokenizer.from_dir(smollm2_dir), 8192, 49152, max_n=4)


def request(**kw) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(**kw)


def test_text_and_chat_prompts(frontend):
    tok = frontend.tokenizer
    text = frontend.prepare(request(prompt="Hello there", request_id="x"))
    assert text.prompt_token_ids == tok.encode("Hello there")
    assert text.request_id == "x"
    chat = frontend.prepare(request(messages=generation_pb2.ChatMessages(
        messages=[generation_pb2.ChatMessage(role="user", content="Hi")])))
    rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert chat.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert chat.request_id.startswith("req-")
    ids = frontend.prepare(request(prompt_token_ids=generation_pb2.TokenIds(ids=[1, 2, 3])))
    assert ids.prompt_token_ids == [1, 2, 3]
    assert ids.params.max_tokens == 16 and ids.params.temperature == 1.0


@pytest.mark.parametrize(("kw", "message"), [
    ({}, "set one of prompt, prompt_token_ids or messages"),
    ({"prompt": ""}, "the prompt is empty"),
    ({"prompt": "hi", "model": "gpt-4"},
     "model 'gpt-4' is not served here; this gateway serves 'SmolLM2-135M-Instruct'"),
    ({"prompt_token_ids": generation_pb2.TokenIds(ids=[5, 49152])},
     "prompt_token_ids[1] = 49152 is not below the vocabulary size 49152"),
    ({"prompt_token_ids": generation_pb2.TokenIds(ids=[5] * 8000),
      "params": types_pb2.SamplingParams(max_tokens=500)},
     "the prompt (8000 tokens) plus max_tokens (500) exceeds the model's context length (8192); "
     "shorten the prompt or lower max_tokens"),
    ({"prompt": "hi", "params": types_pb2.SamplingParams(temperature=-1)},
     "temperature must be >= 0, got -1.0"),
    ({"prompt": "hi", "params": types_pb2.SamplingParams(max_tokens=0)},
     "max_tokens must be at least 1, got 0"),
    ({"messages": generation_pb2.ChatMessages(
        messages=[generation_pb2.ChatMessage(role="robot", content="x")])},
     "messages[0].role is 'robot'; use one of system, user, assistant, tool"),
    ({"messages": generation_pb2.ChatMessages()}, "messages is empty"),
])
def test_refusals_say_what_to_change(frontend, kw, message):
    with pytest.raises(InvalidRequestError) as err:
        frontend.prepare(request(**kw))
    assert str(err.value) == message


def test_tokenize(frontend):
    out = frontend.tokenize(generation_pb2.TokenizeRequest(prompt="Hello"))
    assert list(out.token_ids) == frontend.tokenizer.encode("Hello")
    assert out.text == "Hello" and out.max_model_len == 8192


def test_dummy_models_take_token_ids_only():
    frontend = Frontend("dummy:tiny-llama", None, 0, 0, max_n=4)
    with pytest.raises(InvalidRequestError, match="has no tokenizer: send prompt_token_ids"):
        frontend.prepare(request(prompt="hi"))
    assert frontend.prepare(request(
        prompt_token_ids=generation_pb2.TokenIds(ids=[9]))).prompt_token_ids == [9]
