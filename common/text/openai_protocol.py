"""OpenAI-style completion and chat requests/responses (pydantic; no torch).

Shared by `splitserve run-batch` and the gateway's HTTP API: a request body becomes a prompt plus
SamplingParams, and engine results become OpenAI response bodies. vLLM's `return_token_ids`
extension adds `token_ids` to each choice and `prompt_token_ids` to the response.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.engine.core.sampling_params import SamplingParams
from common.errors import InvalidRequestError


class StreamOptions(BaseModel):
    include_usage: bool = False


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

    @property
    def include_usage(self) -> bool:
        """Streaming: end with a chunk that carries usage (and no choices)."""
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, logprobs: int | None, default_max_tokens: int) -> SamplingParams:
        if self.n != 1:
            raise InvalidRequestError("only n=1 is supported")
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, repetition_penalty=self.repetition_penalty,
            frequency_penalty=self.frequency_penalty, presence_penalty=self.presence_penalty,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens)


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
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True

    def chat_messages(self) -> list[dict[str, Any]]:
        return [m.flat() for m in self.messages]

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self, logprobs: int | None, default_max_tokens: int) -> SamplingParams:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return super().sampling_params(logprobs, default_max_tokens)


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
              logprobs: dict[str, Any] | None = None, **envelope: Any) -> dict[str, Any]:
    choice = {"index": 0, "message": {"role": "assistant", "content": text},
              "logprobs": logprobs, "finish_reason": finish_reason}
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
