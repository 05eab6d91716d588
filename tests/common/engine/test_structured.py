"""Structured outputs in the engine (common/engine/structured.py) with the real SmolLM2 on CPU:
every kind's output is checked against its constraint, refused specs carry the parser's
message, a grammar's dead end and a delivered output that breaks it end with reason "grammar",
and the mask itself is checked row by row against plain torch."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future

import jsonschema
import pytest
import torch
import xgrammar as xgr

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams, StructuredOutput
from common.engine.core.sequence import Sequence
from common.engine.engine import LLMEngine
from common.engine.sampler import Sampler
from common.engine.structured import GrammarCache, GrammarState, choice_grammar
from common.errors import InvalidRequestError
from common.flags import build

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def engine(model_cache_dir) -> LLMEngine:
    return LLMEngine(build(EngineConfig, model_cache_dir=str(model_cache_dir), num_kv_blocks=256))


def chat(engine: LLMEngine, text: str) -> list[int]:
    tok = engine.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                      add_special_tokens=False)


def run(engine: LLMEngine, prompt: list[int], spec: StructuredOutput, **params: object):
    params = {"max_tokens": 64, "temperature": 0.0, **params}
    return engine.generate([prompt], SamplingParams(structured=spec, **params))[0]


def test_json_schema_output_validates(engine):
    out = run(engine, chat(engine, "Describe a person as JSON."),
              StructuredOutput("json", json.dumps(SCHEMA)))
    assert out.finish_reason == "stop" and out.error is None
    jsonschema.validate(json.loads(out.text), SCHEMA)
    assert out.output_token_ids[-1] in engine.eos_token_ids  # the grammar ended on its stop token


def test_json_schema_holds_under_sampling(engine):
    prompt = chat(engine, "Describe a person as JSON.")
    for seed in range(3):
        out = run(engine, prompt, StructuredOutput("json", json.dumps(SCHEMA)),
                  temperature=1.0, seed=seed, max_tokens=96)
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), SCHEMA)


def test_json_object_regex_choice_grammar(engine):
    prompt = chat(engine, "Answer briefly: is the sky blue?")
    obj = run(engine, chat(engine, 'Reply with the JSON object {"ok": true}.'),
              StructuredOutput("json_object"))
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict)
    regex = run(engine, prompt, StructuredOutput("regex", r"(yes|no), [a-z]{2,8}\."))
    assert regex.finish_reason == "stop"
    assert re.fullmatch(r"(yes|no), [a-z]{2,8}\.", regex.text), regex.text
    choice = run(engine, prompt, StructuredOutput("choice", choices=("yes", "no", "it is blue")))
    assert choice.finish_reason == "stop" and choice.text in ("yes", "no", "it is blue")
    grammar = run(engine, prompt, StructuredOutput(
        "grammar", 'root ::= "The sky is " color "."\ncolor ::= "blue" | "green"'))
    assert grammar.finish_reason == "stop"
    assert grammar.text in ("The sky is blue.", "The sky is green.")


@pytest.mark.parametrize(("spec", "message"), [
    (StructuredOutput("regex", "(ab"), "invalid regex: Regex parsing error at position 4: "
                                       "The parenthesis is not closed."),
    (StructuredOutput("json", '{"type": "nope"}'), 'invalid JSON schema: Unsupported type "nope"'),
    (StructuredOutput("grammar", "root ::= x"),
     'invalid grammar: EBNF parser error at line 1, column 10: Rule "x" is not defined'),
])
def test_refused_spec_ends_with_the_parsers_message_then_fails_at_once(engine, spec, message):
    out = run(engine, [1, 2, 3], spec)
    assert out.finished and out.output_token_ids == []
    assert isinstance(out.error, InvalidRequestError) and out.error.message == message
    with pytest.raises(InvalidRequestError, match=re.escape(message)):  # cached: refused at once
        engine.add_request("again", [1, 2, 3], SamplingParams(structured=spec))
    assert not engine.has_unfinished()


def test_pure_python_checks_refuse_before_the_engine():
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutput("json", "{nope")
    with pytest.raises(InvalidRequestError, match="at least one string"):
        StructuredOutput("choice")
    with pytest.raises(InvalidRequestError, match="kind must be one of"):
        StructuredOutput("yaml", "a: 1")
    assert SamplingParams(structured=StructuredOutput("json_object")).speculative is False


def test_delivered_outputs_resume_the_matcher(engine):
    """A migrated (or handed-off) request: outputs delivered before are fed to the matcher, and
    the continuation completes a valid document; outputs that break the grammar end it."""
    prompt = chat(engine, "Describe a person as JSON.")
    spec = StructuredOutput("json", json.dumps(SCHEMA))
    head = engine.tokenizer.encode('{"name": "', add_special_tokens=False)
    engine.add_request("resumed", prompt, SamplingParams(max_tokens=64, temperature=0.0,
                                                         structured=spec), output_token_ids=head)
    final = None
    while engine.has_unfinished():
        for o in engine.step():
            final = o if o.finished else final
    assert final.finish_reason == "stop"
    text = engine.tokenizer.decode(final.output_token_ids)
    assert text.startswith('{"name": "')
    jsonschema.validate(json.loads(text), SCHEMA)

    broken = engine.tokenizer.encode("hello", add_special_tokens=False)
    engine.add_request("broken", prompt, SamplingParams(max_tokens=8, structured=spec),
                       output_token_ids=broken)
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("broken", "grammar")]


def test_grammar_cache_is_by_content(engine):
    cache = engine.grammars
    a = cache.get(StructuredOutput("regex", "[ab]+"))
    assert cache.get(StructuredOutput("regex", "[ab]+")) is a
    assert cache.get(StructuredOutput("regex", "[ab]*")) is not a


# ---- the mask, on a tiny vocabulary ------------------------------------------------------------
VOCAB = ["a", "b", "c", "ab", "</s>", "x"]
STOP = 4


def tiny_state(spec: StructuredOutput) -> GrammarState:
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=len(VOCAB),
                             stop_token_ids=[STOP])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    compiled = (compiler.compile_regex(spec.value) if spec.kind == "regex"
                else compiler.compile_grammar(choice_grammar(spec.choices)))
    future: Future = Future()
    future.set_result(compiled)
    state = GrammarState(future, (STOP,))
    assert state.activate([])
    return state


def test_mask_applies_only_to_constrained_rows():
    torch.manual_seed(0)
    logits = torch.randn(4, len(VOCAB))
    logits[:, 5] = 10.0  # "x" is every row's favourite
    seqs = [Sequence(f"r{i}", [0], SamplingParams(temperature=0.0), eos_token_ids=(STOP,))
            for i in range(4)]
    seqs[1].grammar = tiny_state(StructuredOutput("regex", "c+"))
    seqs[3].grammar = tiny_state(StructuredOutput("choice", choices=("ab", "b")))
    tokens = Sampler()(logits.clone(), seqs).token_ids
    assert tokens[0] == 5 and tokens[2] == 5
    assert tokens[1] == 2  # only "c" is allowed
    allowed = [0, 1, 3]  # "a" (then "b"), "b", "ab"
    assert tokens[3] == max(allowed, key=lambda t: logits[3, t].item())


def test_dead_end_samples_the_stop_token_and_the_grammar_rejects_it():
    """A regex no token can continue (nothing in the vocabulary spells "z"): the row is not
    sampled from all -inf; it gets the stop token, which the matcher refuses."""
    state = tiny_state(StructuredOutput("regex", "z"))
    seq = Sequence("r", [0], SamplingParams(temperature=0.7, seed=1), eos_token_ids=(STOP,))
    seq.grammar = state
    assert Sampler()(torch.randn(1, len(VOCAB)), [seq]).token_ids == [STOP]
    assert state.accept(STOP) is False


def test_grammar_warmup_builds_the_compiler_before_any_request(engine):
    """--grammar-warmup (default on): the engine's cache built its compiler on the worker at
    start-up; without it a cache builds it on its first compile."""
    assert engine.config.model.grammar_warmup
    compiler = engine.grammars.warm_up().result(timeout=120)
    assert compiler is engine.grammars._compiler is not None
    cold = GrammarCache(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    assert cold._compiler is None
    cold.get(StructuredOutput("regex", "[0-9]+")).result(timeout=120)
    assert cold._compiler is not None
    cold.close()
    assert not build(EngineConfig, grammar_warmup=False).model.grammar_warmup


def test_compile_runs_off_the_callers_thread(engine):
    seen: list[str] = []
    done = threading.Event()

    def on_done() -> None:
        seen.append(threading.current_thread().name)
        done.set()

    cache = GrammarCache(engine.tokenizer, engine.model_config.vocab_size, engine.eos_token_ids)
    try:
        cache.get(StructuredOutput("regex", "[0-9]{4}"), on_done=on_done)
        assert done.wait(60)
        assert seen[0].startswith("grammar-compile")
    finally:
        cache.close()


def test_overlap_scheduling_gives_the_same_constrained_tokens(engine, model_cache_dir):
    """Overlap scheduling (CUDA's default, forced on here): a constrained sequence takes a
    placeholder like any other, and its step's sampling waits until its matcher has seen the
    token (PendingStep's deferred sampling). Greedy and seeded tokens equal the synchronous
    engine's, beside unconstrained requests, a constrained request ends (its grammar
    terminated) while its next row is in flight, and every constrained request samples at every
    step: it does not decode only every other step."""
    overlapped = LLMEngine(build(EngineConfig, model_cache_dir=str(model_cache_dir),
                                 num_kv_blocks=128, overlap_scheduling="on"))
    assert overlapped.overlap
    prompt = chat(engine, "Describe a person as JSON.")
    schema = StructuredOutput("json", json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=48, temperature=0.0, structured=schema),
              SamplingParams(max_tokens=24, temperature=0.0),
              SamplingParams(max_tokens=40, temperature=0.9, seed=7, structured=schema,
                             frequency_penalty=0.3),
              SamplingParams(max_tokens=8, temperature=0.0,
                             structured=StructuredOutput("choice", choices=("yes", "no")))]
    prompts = [prompt, prompt, prompt, chat(engine, "Is the sky blue?")]
    want = engine.generate(prompts, params)
    for p in params:  # compile outside the measured run
        if p.structured is not None:
            overlapped.grammars.get(p.structured).result()
    launches = sum(overlapped.runner.steps.values())
    got = overlapped.generate(prompts, params)
    launches = sum(overlapped.runner.steps.values()) - launches
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    jsonschema.validate(json.loads(got[0].text), SCHEMA)
    assert got[3].text in ("yes", "no") and got[3].finish_reason == "stop"
    # One prefill step, then a decode step per further token of the longest request, plus the
    # wasted row of a request that ended in the step before (each step samples every row).
    longest = max(len(o.output_token_ids) for o in got)
    assert launches <= longest + 1, (launches, longest)
    assert overlapped.block_manager.num_used_blocks == 0
