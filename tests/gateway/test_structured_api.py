"""Structured outputs, tool calls, /tokenize and /detokenize through a live stack (one prefill and
one decode service, the real SmolLM2 model): over HTTP with the official `openai` client and over
gRPC. Every constrained prompt is prefilled on the prefill service, which samples the first token
under the mask; the decode service rebuilds the matcher from it. Outputs are validated against
their constraint; refused specs answer 400 / INVALID_ARGUMENT with the parser's message."""

from __future__ import annotations

import json
import re

import grpc
import httpx2
import jsonschema
import openai
import pytest

from common.text.tokenizer import Tokenizer
from common.text.tools import Tool, ToolCallParser, with_tools_prompt
from protos.splitserve.v1 import generation_pb2, types_pb2
from tests.stack.conftest import Stack

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"]}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string",
                                                             "maxLength": 30}},
                   "required": ["zone"]}}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack(tmp_path_factory.mktemp("structured-stack"), num_prefill=1, num_decode=1)
    try:
        s.wait_ready()
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="unused",
                         max_retries=0, timeout=300.0)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir) -> Tokenizer:
    return Tokenizer.from_dir(smollm2_dir)


def ask(client: openai.OpenAI, text: str, **kwargs):
    kwargs = {"max_tokens": 64, "temperature": 0.0, **kwargs}
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}],
                                          **kwargs)


def post(stack: Stack, path: str, body: dict) -> httpx2.Response:
    return httpx2.post(f"http://127.0.0.1:{stack.http_port}{path}", json=body, timeout=300.0)


# ---- structured outputs -----------------------------------------------------------------------
def test_chat_json_schema_validates_whole_and_streamed(client: openai.OpenAI):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    whole = ask(client, "Describe a person as JSON.", response_format=fmt)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), PERSON)
    chunks = list(ask(client, "Describe a person as JSON.", response_format=fmt, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        whole.choices[0].message.content)


def test_chat_json_object_is_a_json_object(client: openai.OpenAI):
    out = ask(client, 'Reply with the JSON object {"ok": true}.',
              response_format={"type": "json_object"})
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)


def test_completions_structured_outputs_regex_choice_grammar(client: openai.OpenAI):
    prompt = "Q: Is the sky blue? A:"
    regex = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0.0,
                                      extra_body={"structured_outputs": {"regex": r"[0-9]{3}"}})
    assert re.fullmatch(r"[0-9]{3}", regex.choices[0].text)  # token 1 came from the prefill
    assert regex.choices[0].finish_reason == "stop"
    choice = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=32, temperature=0.0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")
    grammar = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=32, temperature=0.0,
        extra_body={"structured_outputs": {
            "grammar": 'root ::= ("Yes" | "No") ", it is " [a-z]+ "."'}})
    assert re.fullmatch(r"(Yes|No), it is [a-z]+\.", grammar.choices[0].text)
    schema = client.completions.create(
        model=MODEL, prompt="A person as JSON:", max_tokens=64, temperature=0.0,
        extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(schema.choices[0].text), PERSON)


def test_grpc_oneof_json_schema_and_choice(stack: Stack):
    request = generation_pb2.GenerateStreamRequest(
        prompt="A person as JSON:", params=types_pb2.SamplingParams(
            max_tokens=64, temperature=0.0, json_schema=json.dumps(PERSON)))
    text = "".join(m.text for m in stack.stub.GenerateStream(request, timeout=300.0))
    jsonschema.validate(json.loads(text), PERSON)
    params = types_pb2.SamplingParams(max_tokens=8, temperature=0.7, seed=3)
    params.choice.values.extend(["red", "green", "blue"])
    out = stack.stub.Generate(generation_pb2.GenerateRequest(prompt="My favourite colour is",
                                                             params=params), timeout=300.0)
    assert out.text in ("red", "green", "blue")
    assert out.finish_reason == types_pb2.FINISH_REASON_STOP


@pytest.mark.parametrize(("extra", "message"), [
    ({"structured_outputs": {"regex": "(ab"}},
     "invalid regex: Regex parsing error at position 4: The parenthesis is not closed."),
    ({"structured_outputs": {"json": {"type": "nope"}}},
     'invalid JSON schema: Unsupported type "nope"'),
    ({"structured_outputs": {"grammar": "root ::= x"}},
     'invalid grammar: EBNF parser error at line 1, column 10: Rule "x" is not defined'),
    ({"structured_outputs": {"json": "{nope"}}, "the JSON schema is not valid JSON"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}},
     "structured_outputs takes exactly one of"),
    ({"structured_outputs": {"choice": []}}, "structured output choice needs at least one"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format json_schema needs json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "set response_format or structured_outputs, not both"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_refused_specs_answer_400_with_the_parsers_message(client, extra, message, stream):
    with pytest.raises(openai.BadRequestError) as bad:
        ask(client, "hi", max_tokens=8, extra_body=extra, stream=stream)
    assert bad.value.status_code == 400
    assert message in bad.value.body["message"], bad.value.body


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}},
    {"type": ["string", 3]}, {"$ref": "#/definitions/missing"}, {"enum": []},
    {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 1},
    {"type": "string", "pattern": "(unclosed"}, {"allOf": [{"type": "string"}, {"type": "integer"}]},
])
def test_odd_schemas_answer_400_or_a_valid_output_never_a_hang(client, schema):
    try:
        out = ask(client, "Some JSON:", max_tokens=24,
                  extra_body={"structured_outputs": {"json": schema}})
    except openai.BadRequestError as bad:
        assert bad.body["message"].startswith("invalid JSON schema: "), bad.body
        return
    reason = out.choices[0].finish_reason
    assert reason in ("stop", "length", "grammar")
    if reason == "stop":
        jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_grpc_refused_spec_is_invalid_argument(stack: Stack):
    for params in (types_pb2.SamplingParams(max_tokens=4, regex="[a-"),
                   types_pb2.SamplingParams(max_tokens=4, json_schema="[1, 2]")):
        with pytest.raises(grpc.RpcError) as bad:
            stack.stub.Generate(generation_pb2.GenerateRequest(prompt="hi", params=params),
                                timeout=120.0)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bad.value.details().startswith(("invalid regex: ", "a JSON schema must be"))


# ---- /tokenize and /detokenize ---------------------------------------------------------------
def test_tokenize_and_detokenize(stack: Stack, tokenizer: Tokenizer):
    text = "Hello, world! <|im_end|>"
    got = post(stack, "/tokenize", {"model": MODEL, "prompt": text, "return_token_strs": True})
    ids = tokenizer.encode(text)
    max_len = stack.stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=10.0).max_model_len
    assert got.status_code == 200
    assert got.json() == {"count": len(ids), "max_model_len": max_len, "tokens": ids,
                          "token_strs": tokenizer.convert_ids_to_tokens(ids)}
    chat = post(stack, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    assert chat["token_strs"] is None
    back = post(stack, "/detokenize", {"model": MODEL, "tokens": ids})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    bad = post(stack, "/detokenize", {"tokens": [1, 10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    assert post(stack, "/tokenize", {"model": "other", "prompt": "x"}).status_code == 404
    assert post(stack, "/tokenize", {"prompt": 3}).status_code == 400


# ---- tool calls --------------------------------------------------------------------------------
def test_required_tool_choice_forces_valid_calls(client: openai.OpenAI):
    out = ask(client, "What is the weather in Paris?", tools=[WEATHER, TIME],
              tool_choice="required", max_tokens=96)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    tools = {"get_weather": WEATHER, "get_time": TIME}
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments),
                            tools[call.function.name]["function"]["parameters"])


def test_named_tool_choice_whole_and_streamed(client: openai.OpenAI):
    named = {"type": "function", "function": {"name": "get_time"}}
    out = ask(client, "What time is it in Tokyo?", tools=[WEATHER, TIME], tool_choice=named)
    [call] = out.choices[0].message.tool_calls
    assert call.function.name == "get_time" and out.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    chunks = list(ask(client, "What time is it in Tokyo?", tools=[WEATHER, TIME],
                      tool_choice=named, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [tc for d in deltas for tc in d.tool_calls or []]
    assert [(tc.index, tc.function.name) for tc in streamed] == [(0, "get_time")]
    assert "".join(tc.function.arguments for tc in streamed) == call.function.arguments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_and_none_match_the_raw_text(stack: Stack, client: openai.OpenAI,
                                          tokenizer: Tokenizer):
    """auto: the response is exactly the Hermes parse of what the model wrote for the prompt
    with the tools system prompt (the same tokens through gRPC); none: plain text, no tools."""
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools = [Tool.model_validate(WEATHER)]
    ids = tokenizer.encode(tokenizer.apply_chat_template(with_tools_prompt(messages, tools)),
                           add_special_tokens=False)
    raw = stack.stub.Generate(generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=ids),
        params=types_pb2.SamplingParams(max_tokens=64, temperature=0.0)), timeout=300.0).text
    parser = ToolCallParser(tools, "auto")
    content = parser.feed(raw)
    rest, calls = parser.finish()
    out = ask(client, messages[0]["content"], tools=[WEATHER], tool_choice="auto")
    msg = out.choices[0].message
    assert (msg.content or "") == content + rest
    assert [(c.function.name, c.function.arguments) for c in msg.tool_calls or []] == [
        (c.name, c.arguments) for c in calls]
    assert out.choices[0].finish_reason == ("tool_calls" if calls else "length")
    plain = ask(client, messages[0]["content"], tools=[WEATHER], tool_choice="none")
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content == ask(client, messages[0]["content"]).choices[
        0].message.content


def test_bad_tool_choices_answer_400(client: openai.OpenAI):
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        ask(client, "hi", tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice needs tools"):
        ask(client, "hi", tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="cannot be combined"):
        ask(client, "hi", tools=[WEATHER], tool_choice="required",
            response_format={"type": "json_object"})
