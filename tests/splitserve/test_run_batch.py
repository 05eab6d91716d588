"""`splitserve run-batch`: OpenAI batch lines in, OpenAI batch results out, bad lines isolated."""

from __future__ import annotations

import json
import subprocess
import sys

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build
from splitserve.commands.run_batch import BatchRunner


def line(custom_id, url, body, method="POST"):
    return json.dumps({"custom_id": custom_id, "method": method, "url": url, "body": body})


def test_run_batch_lines(model_cache_dir):
    engine = LLMEngine(build(EngineConfig, model_cache_dir=str(model_cache_dir), num_kv_blocks=256))
    tok = engine.tokenizer
    lines = [
        line("c1", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8,
                                       "temperature": 0, "return_token_ids": True}),
        line("chat", "/v1/chat/completions", {
            "model": "SmolLM2-135M-Instruct", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello."}], "return_token_ids": True}),
        "{not json",
        line("bad-url", "/v1/embeddings", {"input": "x"}),
        line("bad-param", "/v1/completions", {"prompt": "x", "temperature": -1}),
        line("bad-model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}),
        line("lp", "/v1/completions", {"prompt": "1, 2, 3,", "max_tokens": 3, "temperature": 0,
                                       "logprobs": 2}),
        line("n3", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 6,
                                       "temperature": 0.9, "seed": 4, "n": 3,
                                       "return_token_ids": True}),
    ]
    results = BatchRunner(engine, progress=False).run(lines)
    by_id = {r["custom_id"]: r for r in results}
    assert [r["custom_id"] for r in results] == ["c1", "chat", "line-3", "bad-url", "bad-param",
                                                   "bad-model", "lp", "n3"]

    c1 = by_id["c1"]["response"]
    assert c1["status_code"] == 200 and by_id["c1"]["error"] is None
    body = c1["body"]
    prompt_ids = tok.encode("The capital of France is")
    assert body["prompt_token_ids"] == prompt_ids
    want = engine.generate([prompt_ids], SamplingParams(max_tokens=8, temperature=0))[0]
    assert body["choices"][0]["token_ids"] == want.output_token_ids
    assert body["choices"][0]["text"] == want.text
    assert body["usage"]["completion_tokens"] == len(want.output_token_ids)
    assert body["object"] == "text_completion"

    chat = by_id["chat"]["response"]["body"]
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    chat_prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say hello."}],
                                                     add_generation_prompt=True),
                             add_special_tokens=False)
    assert chat["prompt_token_ids"] == chat_prompt

    for cid, status in [("line-3", 400), ("bad-url", 400), ("bad-param", 400),
                        ("bad-model", 404)]:
        r = by_id[cid]
        assert r["response"]["status_code"] == status and r["error"]["message"]
        assert r["response"]["body"]["error"]["message"] == r["error"]["message"]

    lp = by_id["lp"]["response"]["body"]["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 3 and all(len(t) <= 2 for t in lp["top_logprobs"])

    # n = 3: one choice per index, choice i equal to a one-choice request with seed + i.
    n3 = by_id["n3"]["response"]["body"]
    assert [c["index"] for c in n3["choices"]] == [0, 1, 2]
    story = tok.encode("Once upon a time")
    for i, choice in enumerate(n3["choices"]):
        one = engine.generate([story], SamplingParams(max_tokens=6, temperature=0.9,
                                                      seed=4 + i))[0]
        assert choice["token_ids"] == one.output_token_ids and choice["text"] == one.text
    assert n3["usage"]["completion_tokens"] == 18
    assert n3["usage"]["total_tokens"] == len(story) + 18
    assert engine.block_manager.num_used_blocks == 0


def test_run_batch_cli(tmp_path, model_cache_dir):
    src = tmp_path / "in.jsonl"
    dst = tmp_path / "out.jsonl"
    src.write_text(line("a", "/v1/completions", {"prompt": "Hello", "max_tokens": 4,
                                                 "temperature": 0}) + "\n")
    subprocess.run([sys.executable, "-m", "splitserve.cli", "run-batch", "-i", str(src),
                    "-o", str(dst), "--no-progress", "--num-kv-blocks", "64",
                    "--model-cache-dir", str(model_cache_dir)], check=True, timeout=300)
    out = [json.loads(x) for x in dst.read_text().splitlines()]
    assert len(out) == 1 and out[0]["response"]["status_code"] == 200
    assert out[0]["response"]["body"]["usage"]["completion_tokens"] == 4
