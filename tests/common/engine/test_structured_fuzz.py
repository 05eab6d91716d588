"""Fuzzed specs (issue 24): whatever JSON schema, regex or grammar a client sends, compiling it
either succeeds, and a matcher over it fills a mask, or fails with an InvalidRequestError whose
message is the parser's; never another exception, a crash or a hang."""

from __future__ import annotations

import json
from concurrent.futures import Future

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.engine.core.sampling_params import StructuredOutput
from common.engine.structured import GrammarCache, GrammarState, TokenMasker
from common.errors import InvalidRequestError
from common.text.tokenizer import Tokenizer

KEYS = ["type", "properties", "items", "enum", "const", "minimum", "maximum", "pattern",
        "minItems", "maxItems", "required", "anyOf", "oneOf", "allOf", "$ref", "format",
        "minLength", "maxLength", "additionalProperties", "prefixItems", "not", "$defs"]
TYPES = ["object", "array", "string", "integer", "number", "boolean", "null", "nope"]
scalars = st.one_of(st.sampled_from(TYPES), st.integers(-5, 50), st.booleans(), st.none(),
                    st.text(max_size=6), st.sampled_from(["#/$defs/a", "#/nope", "[a-z]+", "("]))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(KEYS + ["a", "b"]), inner,
                                                 max_size=4)), max_leaves=12)
schemas = st.dictionaries(st.sampled_from(KEYS), values, max_size=5)


@pytest.fixture(scope="module")
def cache(smollm2_dir) -> GrammarCache:
    tok = Tokenizer.from_dir(smollm2_dir)
    c = GrammarCache(tok, 49152, tok.eos_token_ids)
    yield c
    c.close()


def check(cache: GrammarCache, spec: StructuredOutput) -> None:
    try:
        compiled = cache._compile(spec)  # on the test's thread: a crash shows here
    except InvalidRequestError as e:
        assert e.message.startswith("invalid ") and "/project/" not in e.message
        return
    future: Future = Future()
    future.set_result(compiled)
    state = GrammarState(future, cache.stop_token_ids)
    state.activate([])
    TokenMasker().apply(torch.zeros(1, cache.vocab_size), [0], [state])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=schemas)
def test_fuzzed_json_schemas(cache, schema):
    check(cache, StructuredOutput("json", json.dumps(schema)))


@settings(max_examples=150, deadline=None)
@given(pattern=st.text(alphabet="ab()[]{}|*+?.^$\\-,0-9", min_size=1, max_size=12))
def test_fuzzed_regexes(cache, pattern):
    check(cache, StructuredOutput("regex", pattern))


@settings(max_examples=100, deadline=None)
@given(body=st.text(alphabet='root:=| "ab()*+?[]x\n', min_size=1, max_size=24))
def test_fuzzed_grammars(cache, body):
    check(cache, StructuredOutput("grammar", body))
