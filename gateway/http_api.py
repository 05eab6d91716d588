"""OpenAI-compatible HTTP API on the gateway (FastAPI under uvicorn, in the gateway's event loop).

A request takes the path of a gRPC GenerateStream call (`generate` is the servicer's `stream`:
admission, Frontend.prepare, Relay.run); this module only translates. The prompt is tokenized
first with Frontend.tokenize and sent as token ids, so usage and `return_token_ids` know them and
chat requests get vLLM's default max_tokens (what is left of the context). Pieces of the stream
become SSE chunks (`data: {...}`, then `data: [DONE]`) or one response body; exceptions become
OpenAI's error shape: a domain error (common/errors.py) with its `http_status`, any other with the
HTTP status of the gRPC status grpc_util.status_of gives it (an internal call's, a timeout's).

A client that disconnects cancels its request, which the relay then aborts on every service.

Chat requests with `tools` render them into the prompt and parse the output's tool calls
(common/text/tools.py): whole bodies carry `tool_calls`, streams send any content first, then
each call whole in one `delta.tool_calls` chunk, then the finish reason `tool_calls`.
`/tokenize` and `/detokenize` answer from the gateway's own tokenizer (vLLM's shapes).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from common.errors import SplitserveError, http_status_of
from common.serving.grpc_util import status_of
from common.serving.proto_convert import FINISH_FROM_PB, params_to_pb
from common.text.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    chat_body,
    chat_chunk,
    chat_logprobs,
    completion_body,
    completion_chunk,
    completion_logprobs,
    error_body,
    model_list,
    new_id,
    prompt_logprobs_body,
    tokenize_body,
    usage,
    usage_chunk,
)
from common.text.tools import ToolCallParser, template_takes_tools, with_tools_prompt
from gateway.frontend import Frontend
from protos.splitserve.v1 import generation_pb2, types_pb2

T = TypeVar("T")
GenerateFn = Callable[[generation_pb2.GenerateRequest, float | None],
                      AsyncIterator[generation_pb2.GenerateStreamResponse]]
OpenAIRequest = CompletionRequest | ChatCompletionRequest

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 409: "conflict_error",
               429: "rate_limit_error", 499: "cancelled", 503: "service_unavailable_error",
               504: "timeout_error"}


class HttpError(Exception):
    """An HTTP error response: OpenAI's error body (with the offending `param`) and its status.
    Raised for what only HTTP can get wrong (the body, the model name); `of` turns any other
    exception into one."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    @classmethod
    def of(cls, exc: BaseException) -> HttpError:
        if isinstance(exc, HttpError):
            return exc
        code, details = status_of(exc)
        status = exc.http_status if isinstance(exc, SplitserveError) else http_status_of(code.name)
        return cls(status, details)

    def body(self) -> dict[str, Any]:
        return error_body(self.message, ERROR_TYPES.get(self.status, "internal_error"),
                          self.status, self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class ClientDisconnected(Exception):
    pass


@dataclass(frozen=True, slots=True)
class _Logprob:
    """A TokenLogprobs message in the shape the openai_protocol builders read."""
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]
    rank: int | None = None

    @classmethod
    def of(cls, pb: types_pb2.TokenLogprobs) -> _Logprob:
        return cls(pb.token_id, pb.logprob, tuple((t.token_id, t.logprob) for t in pb.top),
                   pb.rank if pb.HasField("rank") else None)


class OpenAIApi:
    def __init__(self, frontend: Frontend, generate: GenerateFn):
        self.frontend = frontend
        self.generate = generate
        self.created = int(time.time())

    def models(self) -> dict[str, Any]:
        return model_list(self.frontend.model_name, self.frontend.max_model_len, self.created)

    def prepare(self, req: OpenAIRequest) -> tuple[generation_pb2.GenerateRequest, list[int]]:
        """The gRPC request for an OpenAI one, and the prompt's token ids."""
        self._check_model(req.model)
        if isinstance(req, ChatCompletionRequest):
            ids = self._chat_prompt(req)
            left = self.frontend.max_model_len - len(ids)
            default_max = left if self.frontend.max_model_len else COMPLETION_DEFAULT_MAX_TOKENS
            logprobs = req.requested_logprobs()
        else:
            if req.echo:
                raise HttpError(400, "echo is not supported", "echo")
            prompt = req.single_prompt()
            ids = prompt if isinstance(prompt, list) else list(self.frontend.tokenize(
                generation_pb2.TokenizeRequest(prompt=prompt)).token_ids)
            default_max, logprobs = COMPLETION_DEFAULT_MAX_TOKENS, req.logprobs
        params = req.sampling_params(logprobs, max(default_max, 1))
        request = generation_pb2.GenerateRequest(
            request_id=new_id("chatcmpl" if isinstance(req, ChatCompletionRequest) else "cmpl"),
            model=self.frontend.model_name, prompt_token_ids=generation_pb2.TokenIds(ids=ids),
            params=params_to_pb(params))
        return request, ids

    def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        """The chat prompt's ids; tools go through the template where it renders them, else
        into the system prompt (common/text/tools.py)."""
        tools = req.prompt_tools()
        tokenizer = self.frontend.tokenizer
        if tools and tokenizer is not None and template_takes_tools(tokenizer.chat_templates):
            text = tokenizer.apply_chat_template(
                req.chat_messages(), tools=[t.model_dump(exclude_none=True) for t in tools])
            return tokenizer.encode(text, add_special_tokens=False)
        chat = with_tools_prompt(req.chat_messages(), tools) if tools else req.chat_messages()
        messages = generation_pb2.ChatMessages(messages=[
            generation_pb2.ChatMessage(**m) for m in chat])
        return list(self.frontend.tokenize(
            generation_pb2.TokenizeRequest(messages=messages)).token_ids)

    async def tokenize(self, http: Request) -> Response:
        """POST /tokenize (vLLM's shapes): a prompt, or chat messages through the template."""
        try:
            body = await _json_object(http)
            model = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
            req = _validate(model, body)
            self._check_model(req.model)
            tokenizer = self.frontend.require_tokenizer()
            if isinstance(req, TokenizeChatRequest):
                text = tokenizer.apply_chat_template(
                    [m.flat() for m in req.messages],
                    add_generation_prompt=req.add_generation_prompt)
            else:
                text = req.prompt
            ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
            strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
            return JSONResponse(tokenize_body(ids, self.frontend.max_model_len, strs))
        except Exception as exc:
            return HttpError.of(exc).response()

    async def detokenize(self, http: Request) -> Response:
        """POST /detokenize (vLLM's shapes): token ids back to text, special tokens kept."""
        try:
            req = _validate(DetokenizeRequest, await _json_object(http))
            self._check_model(req.model)
            tokenizer = self.frontend.require_tokenizer()
            vocab = self.frontend.vocab_size or tokenizer.vocab_size
            bad = [t for t in req.tokens if not 0 <= t < vocab]
            if bad:
                raise HttpError(400, f"tokens must be in [0, {vocab}); got {bad[0]}", "tokens")
            return JSONResponse({"prompt": tokenizer.decode(req.tokens,
                                                            skip_special_tokens=False)})
        except Exception as exc:
            return HttpError.of(exc).response()

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.frontend.model_name:
            raise HttpError(404, f"the model {model!r} does not exist; this server serves "
                                 f"{self.frontend.model_name!r}", "model")

    async def respond(self, http: Request, model: type[OpenAIRequest]) -> Response:
        try:
            req = await _parse(http, model)
            request, ids = self.prepare(req)
            stream = aiter(self.generate(request, None))
            if req.stream:
                # The first piece (or the error) before the headers: errors keep their status.
                first = await _unless_disconnected(http, anext(stream))
                return StreamingResponse(self._sse(req, request.request_id, ids, first, stream),
                                         media_type="text/event-stream")
            pieces = await _unless_disconnected(http, _collect(stream))
            return JSONResponse(self._body(req, request.request_id, ids, pieces))
        except ClientDisconnected:
            return Response(status_code=499)
        except Exception as exc:  # a SplitserveError, an internal call's AioRpcError, ...
            return HttpError.of(exc).response()

    def _token(self, token_id: int) -> str:
        tokenizer = self.frontend.tokenizer
        if tokenizer is None:
            return f"token_id:{token_id}"
        return tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, req: OpenAIRequest, pbs: Sequence[types_pb2.TokenLogprobs],
                  ) -> dict[str, Any] | None:
        """The OpenAI logprobs block of some tokens; None when the request asked for none."""
        wanted = (req.requested_logprobs() if isinstance(req, ChatCompletionRequest)
                  else req.logprobs)
        if wanted is None:
            return None
        lps = [_Logprob.of(pb) for pb in pbs]
        tokens = [self._token(lp.token_id) for lp in lps]
        tops = [[self._token(t) for t, _ in lp.top] for lp in lps]
        build = chat_logprobs if isinstance(req, ChatCompletionRequest) else completion_logprobs
        return build(tokens, lps, tops)

    def _prompt_logprobs(self, ids: list[int],
                         pieces: Sequence[generation_pb2.GenerateStreamResponse]) -> list | None:
        lps = [_Logprob.of(lp) for p in pieces for lp in p.prompt_logprobs]
        if len(lps) != len(ids) - 1:  # not asked for (or not delivered)
            return None
        return prompt_logprobs_body(ids, lps, self._token)

    def _body(self, req: OpenAIRequest, request_id: str, ids: list[int],
              pieces: list[generation_pb2.GenerateStreamResponse]) -> dict[str, Any]:
        """The whole response: one choice per index (n), usage summed over them."""
        final = pieces[-1]
        by_index: dict[int, list[generation_pb2.GenerateStreamResponse]] = {}
        for p in pieces:
            by_index.setdefault(p.index, []).append(p)
        chat = isinstance(req, ChatCompletionRequest)
        build = chat_body if chat else completion_body
        prompt_lps = self._prompt_logprobs(ids, pieces) if req.prompt_logprobs is not None else None
        body: dict[str, Any] = {}
        num_output = 0
        for index in sorted(by_index):
            mine = by_index[index]
            output = [t for p in mine for t in p.token_ids]
            num_output += len(output)
            text = "".join(p.text for p in mine)
            reason = next((p.finish_reason for p in reversed(mine) if p.finish_reason), 0)
            extra = {}
            parser = _tool_parser(req)
            if parser is not None:
                content = parser.feed(text)
                rest, calls = parser.finish()
                text, extra = content + rest, {"tool_calls": calls}
            one = build(request_id=request_id, model=self.frontend.model_name, text=text,
                        **extra, finish_reason=FINISH_FROM_PB[reason], prompt_token_ids=ids,
                        output_token_ids=output, cached_tokens=final.usage.num_cached_tokens,
                        return_token_ids=req.return_token_ids,
                        logprobs=self._logprobs(req, [lp for p in mine for lp in p.logprobs]))
            choice = one["choices"][0]
            choice["index"] = index
            if prompt_lps is not None and not chat:
                choice["prompt_logprobs"] = prompt_lps
            if body:
                body["choices"].append(choice)
            else:
                body = one
        body["usage"] = usage(len(ids), num_output, final.usage.num_cached_tokens)
        if prompt_lps is not None and chat:
            body["prompt_logprobs"] = prompt_lps
        return body

    async def _sse(self, req: OpenAIRequest, request_id: str, ids: list[int],
                   first: generation_pb2.GenerateStreamResponse,
                   stream: AsyncIterator[generation_pb2.GenerateStreamResponse],
                   ) -> AsyncIterator[str]:
        """Chunks of every choice as they come, each naming its index (n > 1); a choice's
        finish reason in its last chunk; usage (if asked) after the last choice's."""
        chat = isinstance(req, ChatCompletionRequest)
        common = {"request_id": request_id, "model": self.frontend.model_name,
                  "created": int(time.time())}
        tokens = req.return_token_ids
        parsers = {i: _tool_parser(req) for i in range(req.n)}
        unfinished = req.n
        try:
            if chat:
                for i in range(req.n):
                    head = chat_chunk(**common, delta={"role": "assistant", "content": ""},
                                      finish_reason=None, token_ids=[] if tokens else None)
                    head["choices"][0]["index"] = i
                    if tokens and i == 0:
                        head["prompt_token_ids"] = ids
                    yield _event(head)
            piece: generation_pb2.GenerateStreamResponse | None = first
            count = 0
            while piece is not None:
                reason = FINISH_FROM_PB[piece.finish_reason]
                token_ids = list(piece.token_ids) if tokens else None
                logprobs = self._logprobs(req, piece.logprobs)
                parser = parsers.get(piece.index)
                if chat:
                    text, calls = piece.text, []
                    if parser is not None:
                        text = parser.feed(text)
                        if reason is not None:
                            rest, calls = parser.finish()
                            text += rest
                    if calls:  # OpenAI's shape: content, then each call whole, then the reason
                        if text:
                            yield _event(_at(piece.index, chat_chunk(
                                **common, delta={"content": text}, finish_reason=None,
                                token_ids=None)))
                            text = ""
                        yield _event(_at(piece.index, chat_chunk(**common, delta={"tool_calls": [
                            c.openai(index=i) for i, c in enumerate(calls)]},
                            finish_reason=None, token_ids=None)))
                        reason = "tool_calls"
                    chunk = chat_chunk(**common, delta={"content": text} if text else {},
                                       finish_reason=reason, token_ids=token_ids,
                                       logprobs=logprobs)
                else:
                    chunk = completion_chunk(**common, text=piece.text, finish_reason=reason,
                                             token_ids=token_ids, logprobs=logprobs)
                    if tokens and count == 0:
                        chunk["prompt_token_ids"] = ids
                if piece.prompt_logprobs and req.prompt_logprobs is not None:
                    lps = prompt_logprobs_body(ids, [_Logprob.of(lp) for lp in
                                                     piece.prompt_logprobs], self._token)
                    if chat:
                        chunk["prompt_logprobs"] = lps
                    else:
                        chunk["choices"][0]["prompt_logprobs"] = lps
                yield _event(_at(piece.index, chunk))
                unfinished -= reason is not None
                if reason is not None and not unfinished:
                    if req.include_usage:
                        u = piece.usage
                        yield _event(usage_chunk(
                            **common, object_="chat.completion.chunk" if chat
                            else "text_completion",
                            usage_=usage(u.prompt_tokens, u.completion_tokens,
                                         u.num_cached_tokens)))
                    break
                piece = await anext(stream, None)
                count += 1
        except Exception as exc:  # the status line is sent: report the error in the stream
            yield _event(HttpError.of(exc).body())
        finally:
            await stream.aclose()
        yield "data: [DONE]\n\n"


def _at(index: int, chunk: dict[str, Any]) -> dict[str, Any]:
    """The chunk of choice `index` (the builders write index 0)."""
    chunk["choices"][0]["index"] = index
    return chunk


def _tool_parser(req: OpenAIRequest) -> ToolCallParser | None:
    """The tool-call parser of a chat request whose tools may be called (not tool_choice none)."""
    if not isinstance(req, ChatCompletionRequest) or req.prompt_tools() is None:
        return None
    return ToolCallParser(req.tools or [], req.tool_mode() or "auto", req.named_tool())


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _parse(http: Request, model: type[BaseModel]) -> Any:
    return _validate(model, await _json_object(http))


async def _json_object(http: Request) -> dict[str, Any]:
    try:
        body = await http.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HttpError(400, f"the body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    return body


def _validate(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise HttpError(400, f"{param}: {first['msg']}" if param else first["msg"],
                        param) from e


async def _collect(stream: AsyncIterator[generation_pb2.GenerateStreamResponse],
                   ) -> list[generation_pb2.GenerateStreamResponse]:
    return [piece async for piece in stream]


async def _disconnected(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(http: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it (and so the request) if the client goes away first."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(http))
    await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    if work.done():
        watch.cancel()
        return work.result()
    work.cancel()
    await asyncio.gather(work, return_exceptions=True)
    raise ClientDisconnected


def create_app(api: OpenAIApi, metrics: Callable[[], bytes] | None = None,
               readiness: Callable[[], dict] | None = None) -> FastAPI:
    """The ASGI app; `metrics` (an exposition function) also serves /metrics. /health answers
    200 when `readiness()` (gateway/readiness.py's report) says ready, else 503 with that
    report; /health/live answers 200 while the process serves HTTP at all."""
    app = FastAPI(title="splitserve", openapi_url=None, docs_url=None, redoc_url=None)

    @app.get("/health")
    async def health() -> Response:
        if readiness is None:
            return Response(status_code=200)
        report = readiness()
        return JSONResponse(report, status_code=200 if report["status"] == "ready" else 503)

    @app.get("/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse(api.models())

    @app.post("/v1/completions")
    async def completions(http: Request) -> Response:
        return await api.respond(http, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request) -> Response:
        return await api.respond(http, ChatCompletionRequest)

    @app.post("/tokenize")
    async def tokenize(http: Request) -> Response:
        return await api.tokenize(http)

    @app.post("/detokenize")
    async def detokenize(http: Request) -> Response:
        return await api.detokenize(http)

    if metrics is not None:
        from prometheus_client import CONTENT_TYPE_LATEST

        @app.get("/metrics")
        async def metrics_endpoint() -> Response:
            return Response(metrics(), media_type=CONTENT_TYPE_LATEST)

    return app
