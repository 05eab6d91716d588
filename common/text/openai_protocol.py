"""OpenAI-style completion and chat requests/responses (pydantic; no torch).

Shared by `splitserve run-batch` and the gateway's HTTP API: a request body becomes a prompt plus
SamplingParams, and engine results become OpenAI response bodies. vLLM's `return_token_ids`
extension adds `token_ids` to each choice and `prompt_token_ids` to the response.

Structured outputs come as OpenAI's `response_format` (`json_schema`, `json_object`; `text` is
free text) or vLLM's `structured_outputs` (exactly one of `json`, `regex`, `choice`, `grammar`,
`json_object`), on completions and chat alike; a request may use one of the two.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.engine.core.sampling_params import SamplingParams, StructuredOutput
from common.errors import InvalidRequestError
from common.text.tools import (
    NamedToolChoice,
    Tool,
    ToolCall,
    ToolChoice,
    assistant_tool_calls_text,
    forced_output,
    tool_mode,
)


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: OpenAI's name/description/strict are accepted and unused."""
    model_config = ConfigDict(extra="allow", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(BaseModel):
    """vLLM's `structured_outputs` body field; exactly one constraint is set."""
    model_config = ConfigDict(populate_by_name=True)
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def structured_output(response_format: ResponseFormat | None,
                      structured_outputs: StructuredOutputsParams | None,
                      ) -> StructuredOutput | None:
    """The constraint a request asks for (None: free text); InvalidRequestError when it asks
    for two, or names none."""
    if response_format is not None and response_format.type != "text":
        if structured_outputs is not None:
            raise InvalidRequestError("set response_format or structured_outputs, not both")
        if response_format.type == "json_object":
            return StructuredOutput("json_object")
        fmt = response_format.json_schema
        if fmt is None or fmt.schema_ is None:
            raise InvalidRequestError("response_format json_schema needs json_schema.schema")
        return StructuredOutput("json", json.dumps(fmt.schema_))
    if structured_outputs is None:
        return None
    so = structured_outputs
    given = {k: v for k, v in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                               ("grammar", so.grammar), ("json_object", so.json_object or None))
             if v is not None}
    if len(given) != 1:
        raise InvalidRequestError("structured_outputs takes exactly one of json, regex, choice, "
                                  f"grammar, json_object; got {sorted(given) or 'none'}")
    kind, value = next(iter(given.items()))
    if kind == "json":
        return StructuredOutput("json", value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(value))
    if kind == "json_object":
        return StructuredOutput("json_object")
    return StructuredOutput(kind, value)


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    prompt_logprobs: int | None = None

    @property
    def include_usage(self) -> bool:
        """Streaming: end with a chunk that carries usage (and no choices)."""
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, logprobs: int | None, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, structured=self.structured(),
            n=self.n, prompt_logprobs=self.prompt_logprobs)

    def structured(self) -> StructuredOutput | None:
        """The output constraint this request asks for (see the module docstring)."""
        return structured_output(self.response_format, self.structured_outputs)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False

    def single_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, str):
            return p
        if p and all(isinstance(t, int) for t in p):
            return list(p)  # type: ignore[arg-type]
        if isinstance(p, list) and len(p) == 1:
            return p[0]  # type: ignore[return-value]
        raise InvalidRequestError("prompt must be a string or a list of token ids (one prompt)")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def flat(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for part in content:
                if part.get("type") != "text":
                    raise InvalidRequestError(f"unsupported content part {part.get('type')!r}")
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        calls = (self.model_extra or {}).get("tool_calls")
        if self.role == "assistant" and calls:  # earlier calls, as the model wrote them
            content = "\n".join(p for p in (content, assistant_tool_calls_text(calls)) if p)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.flat() for m in self.messages]

    def tool_mode(self) -> str | None:
        """none / auto / required / named, None without tools (common/text/tools.py)."""
        return tool_mode(self.tools, self.tool_choice)

    def named_tool(self) -> str | None:
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None

    def prompt_tools(self) -> list[Tool] | None:
        """The tools the model is shown: none for tool_choice none."""
        return self.tools if self.tool_mode() not in (None, "none") else None

    def structured(self) -> StructuredOutput | None:
        forced = forced_output(self.tools or [], self.tool_mode(), self.named_tool())
        if forced is None:
            return super().structured()
        if super().structured() is not None:
            raise InvalidRequestError("tool_choice required or a named function cannot be "
                                      "combined with response_format or structured_outputs")
        return forced

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self, logprobs: int | None, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(logprobs, default_max_tokens)


class TokenizeCompletionRequest(BaseModel):
    """vLLM's /tokenize body for text."""
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    """vLLM's /tokenize body for chat messages (rendered with the model's chat template)."""
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize body."""
    model: str | None = None
    tokens: list[int]


def tokenize_body(ids: list[int], max_model_len: int,
                  token_strs: list[str | None] | None) -> dict[str, Any]:
    """vLLM's /tokenize response: count, max_model_len, tokens and (when asked) token_strs."""
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
            "token_strs": token_strs}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_logprobs(tokens: list[str], logprobs: list[Any],
                        top_tokens: list[list[str]]) -> dict[str, Any]:
    """OpenAI legacy completions logprobs block; logprobs[i] has .logprob and .top
    [(token_id, logprob)], top_tokens[i] the decoded strings of .top."""
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{t: v for t, (_, v) in zip(tops, lp.top, strict=True)}
                         for lp, tops in zip(logprobs, top_tokens, strict=True)],
        "text_offset": [],
    }


def _response_body(object_: str, choice: dict[str, Any], *, request_id: str, model: str,
                   prompt_token_ids: list[int], output_token_ids: list[int], cached_tokens: int,
                   return_token_ids: bool) -> dict[str, Any]:
    """The envelope both endpoints share: id, object, usage and vLLM's token-id extension."""
    body: dict[str, Any] = {"id": request_id, "object": object_, "created": int(time.time()),
                            "model": model, "choices": [choice],
                            "usage": usage(len(prompt_token_ids), len(output_token_ids),
                                           cached_tokens)}
    if return_token_ids:
        choice["token_ids"] = list(output_token_ids)
        body["prompt_token_ids"] = list(prompt_token_ids)
    return body


def completion_body(*, text: str, finish_reason: str | None,
                    logprobs: dict[str, Any] | None = None, **envelope: Any) -> dict[str, Any]:
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _response_body("text_completion", choice, **envelope)


def chat_body(*, text: str, finish_reason: str | None,
              logprobs: dict[str, Any] | None = None,
              tool_calls: list[ToolCall] | None = None, **envelope: Any) -> dict[str, Any]:
    """With tool_calls: the message carries them (content None when no text came before them)
    and finish_reason is "tool_calls"."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message = {"role": "assistant", "content": text or None,
                   "tool_calls": [c.openai() for c in tool_calls]}
        finish_reason = "tool_calls"
    choice = {"index": 0, "message": message, "logprobs": logprobs,
              "finish_reason": finish_reason}
    return _response_body("chat.completion", choice, **envelope)


def chat_logprobs(tokens: list[str], logprobs: list[Any], top_tokens: list[list[str]]) -> dict:
    return {"content": [
        {"token": tok, "logprob": lp.logprob,
         "top_logprobs": [{"token": t, "logprob": v} for t, (_, v) in zip(tops, lp.top, strict=True)]}
        for tok, lp, tops in zip(tokens, logprobs, top_tokens, strict=True)]}


def error_body(message: str, type_: str = "invalid_request_error", code: int = 400,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def completion_chunk(*, request_id: str, model: str, created: int, text: str,
                     finish_reason: str | None, token_ids: list[int] | None,
                     logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed piece of a completion; token_ids (return_token_ids) None leaves them out."""
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": logprobs,
                              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice]}


def chat_chunk(*, request_id: str, model: str, created: int, delta: dict[str, Any],
               finish_reason: str | None, token_ids: list[int] | None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed piece of a chat completion (delta: {"role": ...} first, then {"content": ...})."""
    choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": logprobs,
                              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [choice]}


def usage_chunk(*, request_id: str, object_: str, model: str, created: int,
                usage_: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage: usage and no choices."""
    return {"id": request_id, "object": object_, "created": created, "model": model,
            "choices": [], "usage": usage_}


def model_list(model: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [
        {"id": model, "object": "model", "created": created, "owned_by": "splitserve",
         "root": model, "max_model_len": max_model_len or None}]}


def prompt_logprobs_body(prompt_token_ids: list[int], logprobs: list[Any],
                         decode: Any) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's prompt_logprobs: None for the first prompt token, then for each one a dict
    token id (a string in JSON) -> {logprob, rank, decoded_token} of the token itself and of the
    most likely alternatives. logprobs[i] (.logprob, .rank, .top) is prompt token i + 1's;
    decode(token_id) gives a token's text."""
    out: list[dict[str, dict[str, Any]] | None] = [None]
    for token, lp in zip(prompt_token_ids[1:], logprobs, strict=True):
        entry = {str(token): {"logprob": lp.logprob, "rank": lp.rank,
                              "decoded_token": decode(token)}}
        for rank, (t, v) in enumerate(lp.top, start=1):
            entry.setdefault(str(t), {"logprob": v, "rank": rank, "decoded_token": decode(t)})
        out.append(entry)
    return out
