"""`splitserve run-batch`: an OpenAI batch file (JSONL) through the in-process engine.

Every input line is submitted before the first step, so the whole file batches. A bad line gets
an error result in its place; it never stops the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from tqdm import tqdm

from common.engine.config import EngineConfig
from common.errors import InvalidRequestError
from common.text.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_body,
    completion_body,
    error_body,
)

ENDPOINTS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True, help="input JSONL ('-' for stdin)")
    parser.add_argument("-o", "--output-file", required=True, help="output JSONL ('-' for stdout)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    EngineConfig.add_cli_args(parser)


@dataclass(slots=True)
class _Line:
    custom_id: str
    endpoint: str = ""
    request: CompletionRequest | ChatCompletionRequest | None = None
    prompt_token_ids: list[int] | None = None
    error: tuple[int, str] | None = None


def _error_result(custom_id: str, status: int, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": None,
                         "body": error_body(message, code=status)},
            "error": {"code": str(status), "message": message}}


class BatchRunner:
    """Parses lines, submits them all to one engine, and assembles results in input order."""

    def __init__(self, engine, progress: bool = True):
        self.engine = engine
        self.progress = progress

    def parse(self, index: int, raw: str) -> _Line:
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            return _Line(f"line-{index + 1}", error=(400, f"line {index + 1} is not JSON: {e}"))
        if not isinstance(obj, dict):
            return _Line(f"line-{index + 1}", error=(400, "each line must be a JSON object"))
        line = _Line(str(obj.get("custom_id", f"line-{index + 1}")))
        url = obj.get("url")
        if obj.get("method", "POST").upper() != "POST":
            line.error = (400, f"method must be POST, got {obj.get('method')!r}")
        elif url not in ENDPOINTS:
            line.error = (400, f"url must be one of {sorted(ENDPOINTS)}, got {url!r}")
        else:
            try:
                line.endpoint = url
                line.request = ENDPOINTS[url].model_validate(obj.get("body") or {})
                model = line.request.model
                if model not in (None, self.engine.model_name):
                    line.error = (404, f"model {model!r} is not served; "
                                       f"this run serves {self.engine.model_name!r}")
            except ValidationError as e:
                line.error = (400, f"invalid body: {e.errors(include_url=False)}")
        return line

    def tokenize(self, line: _Line) -> list[int]:
        tok = self.engine.tokenizer
        req = line.request
        if isinstance(req, ChatCompletionRequest):
            text = tok.apply_chat_template(req.chat_messages(), req.add_generation_prompt)
            return tok.encode(text, add_special_tokens=False)
        prompt = req.single_prompt()
        return list(prompt) if isinstance(prompt, list) else tok.encode(prompt)

    def run(self, raw_lines: list[str]) -> list[dict[str, Any]]:
        engine = self.engine
        lines = [self.parse(i, raw) for i, raw in enumerate(raw_lines)]
        ids: dict[str, int] = {}
        for i, line in enumerate(lines):
            if line.error:
                continue
            try:
                req = line.request
                line.prompt_token_ids = self.tokenize(line)
                if isinstance(req, ChatCompletionRequest):
                    lp = req.requested_logprobs()
                    default_max = engine.max_model_len - len(line.prompt_token_ids)
                else:
                    lp, default_max = req.logprobs, 16
                params = req.sampling_params(lp, max(default_max, 1))
                rid = f"batch-{i}-{uuid.uuid4().hex[:8]}"
                engine.add_request(rid, line.prompt_token_ids, params)
                ids[rid] = i
            except InvalidRequestError as e:
                line.error = (400, str(e))
        finals = self._drive(ids)
        return [self._result(line, finals.get(i)) for i, line in enumerate(lines)]

    def _drive(self, ids: dict[str, int]) -> dict[int, dict[int, tuple[Any, list]]]:
        """Steps the engine to the end; per line, per choice index, its final output and
        logprobs (a line is done when its request's `last` output came)."""
        finals: dict[int, dict[int, tuple[Any, list]]] = {}
        logprobs: dict[tuple[str, int], list] = {}
        bar = tqdm(total=len(ids), desc="run-batch", unit="req", disable=not self.progress,
                   file=sys.stderr)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                key = (out.request_id, out.index)
                if out.logprobs:
                    logprobs.setdefault(key, []).extend(out.logprobs)
                if out.finished:
                    finals.setdefault(ids[out.request_id], {})[out.index] = (
                        out, logprobs.pop(key, []))
                    bar.update(out.last)
        bar.close()
        return finals

    def _result(self, line: _Line,
                final: dict[int, tuple[Any, list]] | None) -> dict[str, Any]:
        """The line's result: one choice per index (n), usage summed over them."""
        if line.error or not final:
            status, message = line.error or (500, "request did not finish")
            return _error_result(line.custom_id, status, message)
        failed = next((out.error for out, _ in final.values() if out.error is not None), None)
        if failed is not None:  # e.g. a structured output's schema its parser refused
            return _error_result(line.custom_id, failed.http_status, failed.message)
        req = line.request
        request_id = f"{'chatcmpl' if isinstance(req, ChatCompletionRequest) else 'cmpl'}-{uuid.uuid4().hex}"
        build = chat_body if isinstance(req, ChatCompletionRequest) else completion_body
        body: dict[str, Any] = {}
        for index in sorted(final):
            out, lps = final[index]
            one = build(request_id=request_id, model=self.engine.model_name, text=out.text,
                        finish_reason=out.finish_reason, prompt_token_ids=out.prompt_token_ids,
                        output_token_ids=out.output_token_ids,
                        cached_tokens=out.num_cached_tokens,
                        return_token_ids=req.return_token_ids,
                        logprobs=self._logprobs(req, lps) if lps else None)
            one["choices"][0]["index"] = index
            if body:
                body["choices"] += one["choices"]
                body["usage"]["completion_tokens"] += one["usage"]["completion_tokens"]
                body["usage"]["total_tokens"] += one["usage"]["completion_tokens"]
            else:
                body = one
        return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
                "response": {"status_code": 200, "request_id": request_id, "body": body},
                "error": None}

    def _logprobs(self, req, lps: list) -> dict[str, Any]:
        from common.text.openai_protocol import chat_logprobs, completion_logprobs
        tok = self.engine.tokenizer
        tokens = [tok.decode([lp.token_id], skip_special_tokens=False) for lp in lps]
        tops = [[tok.decode([t], skip_special_tokens=False) for t, _ in lp.top] for lp in lps]
        if isinstance(req, ChatCompletionRequest):
            return chat_logprobs(tokens, lps, tops)
        return completion_logprobs(tokens, lps, tops)


def run(args: argparse.Namespace) -> int:
    from common.engine.engine import LLMEngine  # torch is imported only when the command runs

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.input_file == "-":
        text = sys.stdin.read()
    else:
        with open(args.input_file, encoding="utf-8") as f:
            text = f.read()
    raw_lines = [ln for ln in text.splitlines() if ln.strip()]
    start = time.monotonic()
    engine = LLMEngine(EngineConfig.from_cli_args(args))
    try:
        results = BatchRunner(engine, progress=not args.no_progress).run(raw_lines)
    finally:
        engine.close()  # the other tensor-parallel ranks, if any
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    if args.output_file == "-":
        sys.stdout.write(payload)
    else:
        with open(args.output_file, "w", encoding="utf-8") as f:
            f.write(payload)
    failed = sum(1 for r in results if r["error"])
    print(f"run-batch: {len(results)} requests, {failed} failed, "
          f"{time.monotonic() - start:.1f} s", file=sys.stderr)
    return 0
