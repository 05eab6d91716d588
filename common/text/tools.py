"""Tool calling on chat completions: tools into the prompt, tool calls out of the text (no torch).

    tools + tool_choice --(prompt)--> the chat template's own tools section where it has one;
                                      else a system prompt (TOOLS_PROMPT, Hermes style)
                        --(output)--> none:     free text, never parsed
                                      auto:     free text; each `<tool_call>{json}</tool_call>`
                                                naming a known tool becomes a tool call
                                      required: a JSON array of one or more {"name", "arguments"},
                                                forced through the grammar (a JSON schema)
                                      named:    that function's arguments object, forced the same

`ToolCallParser` turns the output text into (content, tool calls) at the end of a request and,
while it streams, tells which text is safe to send as content: everything before a `<tool_call>`
tag (a suffix that may begin one is held back); after the tag, nothing until the end.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.engine.core.sampling_params import StructuredOutput
from common.errors import InvalidRequestError

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCall(BaseModel):
    """One call as OpenAI returns it (arguments: JSON text)."""
    id: str
    name: str
    arguments: str

    def openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {"id": self.id, "type": "function",
                                "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            call["index"] = index
        return call


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_mode(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> str | None:
    """none / auto / required / named, or None without tools; InvalidRequestError for a choice
    that names an unknown function or needs tools that are not there."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice needs tools")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools must have distinct function names")
    if isinstance(tool_choice, NamedToolChoice):
        if tool_choice.function.name not in names:
            raise InvalidRequestError(f"tool_choice names {tool_choice.function.name!r}, which is "
                                      f"not among the tools ({', '.join(names)})")
        return "named"
    return tool_choice or "auto"


def template_takes_tools(chat_templates: dict[str, str]) -> bool:
    """Whether the model's chat template renders `tools` itself (Qwen2.5's, Llama 3's do;
    SmolLM2's does not)."""
    return "tool_use" in chat_templates or "tools" in chat_templates.get("default", "")


def tools_system_prompt(tools: list[Tool]) -> str:
    """The system-prompt rendering of tools for a template without a tools section."""
    return TOOLS_PROMPT.format(tools="\n".join(
        json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools))


def with_tools_prompt(messages: list[dict[str, Any]], tools: list[Tool]) -> list[dict[str, Any]]:
    """messages with the tools prompt appended to the first system message (or a new one)."""
    prompt = tools_system_prompt(tools)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0])
        first["content"] = f"{first['content']}\n\n{prompt}" if first["content"] else prompt
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def assistant_tool_calls_text(tool_calls: list[dict[str, Any]]) -> str:
    """An assistant message's earlier tool calls as the text the model would have written."""
    parts = []
    for call in tool_calls:
        fn = call.get("function") or {}
        try:
            arguments = json.loads(fn.get("arguments") or "{}")
        except json.JSONDecodeError:
            arguments = fn.get("arguments")
        parts.append(f"{TOOL_CALL_OPEN}\n"
                     + json.dumps({"name": fn.get("name"), "arguments": arguments},
                                  ensure_ascii=False) + f"\n{TOOL_CALL_CLOSE}")
    return "\n".join(parts)


def forced_output(tools: list[Tool], mode: str | None,
                  named: str | None = None) -> StructuredOutput | None:
    """The grammar that forces a well-formed call: required and named; None otherwise."""
    def parameters(tool: Tool) -> dict[str, Any]:
        return tool.function.parameters or {"type": "object"}

    if mode == "named":
        tool = next(t for t in tools if t.function.name == named)
        return StructuredOutput("json", json.dumps(parameters(tool)))
    if mode == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "arguments": parameters(t)},
                  "required": ["name", "arguments"]} for t in tools]
        return StructuredOutput("json", json.dumps(
            {"type": "array", "minItems": 1, "items": {"anyOf": calls}}))
    return None


class ToolCallParser:
    """The tool calls in one request's output (see the module docstring)."""

    def __init__(self, tools: list[Tool], mode: str, named: str | None = None):
        self.names = {t.function.name for t in tools}
        self.mode = mode
        self.named = named
        self._text = ""
        self._sent = 0  # characters of _text already handed out as content
        self._in_call = False  # auto: a <tool_call> tag has begun

    def feed(self, delta: str) -> str:
        """Add streamed text; returns the content that may be sent now."""
        self._text += delta
        if self.mode != "auto" or self._in_call:
            return ""
        tag = self._text.find(TOOL_CALL_OPEN, self._sent)
        self._in_call = tag >= 0
        end = tag if tag >= 0 else len(self._text) - _partial_tag(self._text)
        out = self._text[self._sent:max(end, self._sent)]
        self._sent = max(end, self._sent)
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content not yet handed out, the tool calls). With calls (auto), the content is the
        text before the first tag, trailing space dropped; without (auto found none, or a forced
        call is incomplete: length), all the text is content."""
        calls = self._calls()
        if calls:
            rest = self._text[self._sent:self._text.find(TOOL_CALL_OPEN)] if self._in_call else ""
            self._sent = len(self._text)
            return rest.rstrip(), calls
        rest, self._sent = self._text[self._sent:], len(self._text)
        return rest, []

    @property
    def text(self) -> str:
        return self._text

    def _calls(self) -> list[ToolCall]:
        try:
            if self.mode == "named":
                json.loads(self._text)
                return [ToolCall(id=new_call_id(), name=self.named or "",
                                 arguments=self._text)]
            if self.mode == "required":
                items = json.loads(self._text)
                return [_call(item) for item in items]
        except (json.JSONDecodeError, TypeError, KeyError):
            return []
        calls = []
        for body in _TOOL_CALL.findall(self._text):
            try:
                item = json.loads(body)
                if item.get("name") in self.names:
                    calls.append(_call(item))
            except (json.JSONDecodeError, AttributeError, KeyError, TypeError):
                continue
        return calls


def _call(item: dict[str, Any]) -> ToolCall:
    arguments = item.get("arguments", item.get("parameters", {}))
    return ToolCall(id=new_call_id(), name=item["name"],
                    arguments=json.dumps(arguments, ensure_ascii=False))


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of TOOL_CALL_OPEN."""
    for n in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-n:]):
            return n
    return 0
