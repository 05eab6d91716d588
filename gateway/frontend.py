"""Requests in: the prompt as token ids (tokenizer, chat template) and validated sampling settings.

Every refusal raises InvalidRequestError with a message that says what to change (the gateway
answers INVALID_ARGUMENT with it).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from common.engine.core.sampling_params import SamplingParams
from common.errors import InvalidRequestError
from common.serving.proto_convert import params_from_pb
from common.text.tokenizer import Tokenizer
from protos.splitserve.v1 import generation_pb2, types_pb2

# Generate and GenerateStream take one request type each (buf's rule) with the same fields.
GenerateRequest = generation_pb2.GenerateRequest | generation_pb2.GenerateStreamRequest

CHAT_ROLES = ("system", "user", "assistant", "tool")
MAX_REQUEST_ID_LEN = 256


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams               # validated
    params_pb: types_pb2.SamplingParams  # forwarded to the services as the client sent it
    # Tokens the client already has (a migrated request's continuation): the services count
    # them as outputs and compute their KV after the prompt's.
    output_token_ids: tuple[int, ...] = ()

    @property
    def known_token_ids(self) -> list[int]:
        """The tokens whose KV a prefill computes: the prompt, then the delivered outputs."""
        return [*self.prompt_token_ids, *self.output_token_ids]


class Frontend:
    def __init__(self, model_name: str, tokenizer: Tokenizer | None, max_model_len: int,
                 vocab_size: int, *, max_n: int):
        """tokenizer None (dummy models): only prompt_token_ids are accepted; max_model_len and
        vocab_size 0: left to the services to check. max_n: the most choices a request may ask
        for (--max-n)."""
        self.max_n = max_n
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def prepare(self, request: GenerateRequest) -> PreparedRequest:
        self._check_model(request.model)
        if len(request.request_id) > MAX_REQUEST_ID_LEN:
            raise InvalidRequestError(f"request_id is longer than {MAX_REQUEST_ID_LEN} characters")
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidRequestError("set one of prompt, prompt_token_ids or messages")
        if kind == "prompt_token_ids":
            prompt = list(request.prompt_token_ids.ids)
        else:
            prompt = self._encode(request.prompt if kind == "prompt" else request.messages)
        params = params_from_pb(request.params)
        self._check_prompt(prompt, params)
        return PreparedRequest(request.request_id or f"req-{uuid.uuid4().hex}", prompt, params,
                               request.params)

    def tokenize(self, request: generation_pb2.TokenizeRequest) -> generation_pb2.TokenizeResponse:
        self._check_model(request.model)
        kind = request.WhichOneof("input")
        if kind is None:
            raise InvalidRequestError("set one of prompt or messages")
        source = request.prompt if kind == "prompt" else request.messages
        ids = self._encode(source)
        text = source if isinstance(source, str) else self._render(source)
        return generation_pb2.TokenizeResponse(token_ids=ids, text=text,
                                               max_model_len=self.max_model_len)

    def _check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise InvalidRequestError(
                f"model {model!r} is not served here; this gateway serves {self.model_name!r}")

    def require_tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise InvalidRequestError(
                f"{self.model_name} has no tokenizer: send prompt_token_ids")
        return self.tokenizer

    def _render(self, chat: generation_pb2.ChatMessages) -> str:
        if not chat.messages:
            raise InvalidRequestError("messages is empty")
        for i, m in enumerate(chat.messages):
            if m.role not in CHAT_ROLES:
                raise InvalidRequestError(
                    f"messages[{i}].role is {m.role!r}; use one of {', '.join(CHAT_ROLES)}")
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        return self.require_tokenizer().apply_chat_template(messages, add_generation_prompt=True)

    def _encode(self, source: str | generation_pb2.ChatMessages) -> list[int]:
        if isinstance(source, str):
            return self.require_tokenizer().encode(source)
        # The template writes the special tokens itself.
        return self.require_tokenizer().encode(self._render(source), add_special_tokens=False)

    def _check_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        if params.n > self.max_n:
            raise InvalidRequestError(f"n must be in [1, {self.max_n}] (the gateway's --max-n), "
                                      f"got {params.n}")
        if not prompt:
            raise InvalidRequestError("the prompt is empty")
        if self.vocab_size:
            for i, t in enumerate(prompt):
                if t >= self.vocab_size:
                    raise InvalidRequestError(
                        f"prompt_token_ids[{i}] = {t} is not below the vocabulary size "
                        f"{self.vocab_size}")
        if self.max_model_len and len(prompt) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"the prompt ({len(prompt)} tokens) plus max_tokens ({params.max_tokens}) "
                f"exceeds the model's context length ({self.max_model_len}); shorten the "
                "prompt or lower max_tokens")
