"""`splitserve run-batch` with structured outputs: a schema line's output validates, a line whose
regex the parser refuses gets a 400 result with the parser's message (not an empty 200)."""

from __future__ import annotations

import json

import jsonschema

from common.engine.config import EngineConfig
from common.engine.engine import LLMEngine
from common.flags import build
from splitserve.commands.run_batch import BatchRunner

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}},
          "required": ["name"]}


def line(custom_id: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": body})


def test_run_batch_structured_lines(model_cache_dir):
    engine = LLMEngine(build(EngineConfig, model_cache_dir=str(model_cache_dir), num_kv_blocks=128))
    messages = [{"role": "user", "content": "Name a person, as JSON."}]
    results = BatchRunner(engine, progress=False).run([
        line("schema", {"messages": messages, "max_tokens": 48, "temperature": 0,
                        "response_format": {"type": "json_schema",
                                            "json_schema": {"name": "p", "schema": SCHEMA}}}),
        line("bad-regex", {"messages": messages, "max_tokens": 8,
                           "structured_outputs": {"regex": "(ab"}}),
    ])
    by_id = {r["custom_id"]: r for r in results}
    ok = by_id["schema"]["response"]["body"]["choices"][0]
    assert ok["finish_reason"] == "stop"
    jsonschema.validate(json.loads(ok["message"]["content"]), SCHEMA)
    bad = by_id["bad-regex"]
    assert bad["response"]["status_code"] == 400
    assert bad["error"]["message"] == ("invalid regex: Regex parsing error at position 4: "
                                       "The parenthesis is not closed.")
