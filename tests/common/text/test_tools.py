"""Tool calls out of the text and into the prompt (common/text/tools.py); no torch, no model."""

from __future__ import annotations

import json

import pytest

from common.errors import InvalidRequestError
from common.text.openai_protocol import ChatCompletionRequest, ChatMessage
from common.text.tools import (
    FunctionDef,
    NamedToolChoice,
    Tool,
    ToolCallParser,
    forced_output,
    template_takes_tools,
    tool_mode,
    with_tools_prompt,
)

WEATHER = Tool(function=FunctionDef(name="get_weather", parameters={
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def streamed(parser: ToolCallParser, text: str) -> tuple[str, list]:
    sent = "".join(parser.feed(ch) for ch in text)  # one character at a time
    rest, calls = parser.finish()
    return sent + rest, calls


def test_auto_streams_content_until_the_tag_and_parses_the_call():
    parser = ToolCallParser([WEATHER], "auto")
    assert parser.feed("Sure. <tool_") == "Sure. "  # the tag's prefix is held back
    assert parser.feed("call>\n{") == ""
    content, calls = streamed(parser, CALL[len("<tool_call>\n{"):])
    assert content == ""
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]
    assert parser.finish()[0] == ""


def test_auto_without_a_call_is_all_content_even_a_false_tag_start():
    assert streamed(ToolCallParser([WEATHER], "auto"), "a <tool x > b") == ("a <tool x > b", [])


def test_auto_ignores_unknown_names_and_broken_json():
    text = ('<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": </tool_call>')
    assert streamed(ToolCallParser([WEATHER], "auto"), text) == (text, [])


def test_two_calls_and_an_unclosed_last_one():
    text = CALL + "\n" + CALL.replace("Paris", "Rome").removesuffix("\n</tool_call>")
    _, calls = streamed(ToolCallParser([WEATHER], "auto"), text)
    assert [json.loads(c.arguments)["city"] for c in calls] == ["Paris", "Rome"]


def test_required_and_named_parse_the_forced_json():
    required = ToolCallParser([WEATHER], "required")
    required.feed('[{"name": "get_weather", "arguments": {"city": "Oslo"}}]')
    _, [call] = required.finish()
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Oslo"}')
    named = ToolCallParser([WEATHER], "named", "get_weather")
    named.feed('{"city": "Oslo"}')
    assert [(c.name, c.arguments) for c in named.finish()[1]] == [
        ("get_weather", '{"city": "Oslo"}')]
    cut = ToolCallParser([WEATHER], "named", "get_weather")
    cut.feed('{"city": "Os')  # max_tokens hit: no call, the text is content
    assert cut.finish() == ('{"city": "Os', [])


def test_forced_output_schemas():
    named = forced_output([WEATHER], "named", "get_weather")
    assert (named.kind, json.loads(named.value)) == ("json", WEATHER.function.parameters)
    required = json.loads(forced_output([WEATHER], "required").value)
    assert required["minItems"] == 1
    assert required["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    assert forced_output([WEATHER], "auto") is None


def test_tool_modes_and_refusals():
    assert tool_mode(None, None) is None and tool_mode([WEATHER], None) == "auto"
    named = NamedToolChoice.model_validate({"function": {"name": "get_weather"}})
    assert tool_mode([WEATHER], named) == "named"
    with pytest.raises(InvalidRequestError, match="not among the tools"):
        tool_mode([WEATHER], NamedToolChoice.model_validate({"function": {"name": "x"}}))
    with pytest.raises(InvalidRequestError, match="distinct"):
        tool_mode([WEATHER, WEATHER], "auto")


def test_system_prompt_rendering():
    merged = with_tools_prompt([{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "hi"}], [WEATHER])
    assert merged[0]["content"].startswith("Be brief.\n\n# Tools\n")
    assert json.dumps(WEATHER.model_dump(exclude_none=True)) in merged[0]["content"]
    added = with_tools_prompt([{"role": "user", "content": "hi"}], [WEATHER])
    assert [m["role"] for m in added] == ["system", "user"]
    assert template_takes_tools({"default": "{% if tools %}...{% endif %}"})
    assert not template_takes_tools({"default": "{{ messages }}"})


def test_earlier_calls_render_as_the_model_writes_them():
    message = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]})
    assert message.flat() == {"role": "assistant", "content": CALL}


def test_chat_request_structured_from_tools_and_formats():
    base = {"messages": [{"role": "user", "content": "hi"}]}
    req = ChatCompletionRequest.model_validate(
        {**base, "tools": [WEATHER.model_dump()], "tool_choice": "required"})
    assert req.structured().kind == "json"
    fmt = ChatCompletionRequest.model_validate(
        {**base, "response_format": {"type": "json_schema",
                                     "json_schema": {"name": "x", "schema": {"type": "object"}}}})
    assert (fmt.structured().kind, fmt.structured().value) == ("json", '{"type": "object"}')
    vllm = ChatCompletionRequest.model_validate(
        {**base, "structured_outputs": {"choice": ["a", "b"]}})
    assert vllm.structured().choices == ("a", "b")
    assert ChatCompletionRequest.model_validate(
        {**base, "response_format": {"type": "text"}}).structured() is None
