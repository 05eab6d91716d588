"""Delivery (gateway/migration.py): a stream cut at token k and continued by a second engine run
with the first k tokens as known outputs gives the client exactly the undisturbed run's tokens
and text, stop strings included, even one that straddles the cut, and seeded sampling with
penalties included. Real SmolLM2 engine, in process."""

from __future__ import annotations

import pytest

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build
from common.serving.proto_convert import FINISH_TO_PB, params_to_pb
from gateway.frontend import PreparedRequest
from gateway.migration import Delivery
from protos.splitserve.v1 import generation_pb2, types_pb2

pytestmark = pytest.mark.slow  # ~100 decode steps of SmolLM2 on CPU

PROMPT = "Write three sentences about the sea and its tides."
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def engine(model_cache_dir) -> LLMEngine:
    return LLMEngine(build(EngineConfig, model_cache_dir=str(model_cache_dir), num_kv_blocks=256))


@pytest.fixture(scope="module")
def undisturbed(engine) -> tuple[list[int], list[generation_pb2.GenerateStreamResponse]]:
    prompt = engine.tokenizer.encode(PROMPT)
    free = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return prompt, stream(engine, prompt, free, "ref")


def stream(engine: LLMEngine, prompt: list[int], params: SamplingParams, rid: str,
           output_token_ids: tuple[int, ...] = (),
           ) -> list[generation_pb2.GenerateStreamResponse]:
    """The engine's outputs as the relay forwards them (one message per step)."""
    engine.add_request(rid, prompt, params, output_token_ids=output_token_ids)
    msgs = []
    while engine.has_unfinished():
        for out in engine.step():
            msg = generation_pb2.GenerateStreamResponse(
                request_id="client", token_ids=out.new_token_ids, text=out.new_text,
                finish_reason=FINISH_TO_PB[out.finish_reason if out.finished else None])
            if out.finished:
                msg.usage.prompt_tokens = len(prompt)
                msg.usage.completion_tokens = len(out.output_token_ids)
            msgs.append(msg)
    return msgs


def tokens_and_text(msgs) -> tuple[list[int], str]:
    return [t for m in msgs for t in m.token_ids], "".join(m.text for m in msgs)


def migrate_at(engine: LLMEngine, prompt: list[int], params: SamplingParams,
               undisturbed: list[generation_pb2.GenerateStreamResponse], k: int,
               ) -> list[generation_pb2.GenerateStreamResponse]:
    """What the client gets when the decode service dies after k tokens (the messages before the
    cut are the undisturbed run's: the same engine produced them)."""
    req = PreparedRequest("client", prompt, params, params_to_pb(params))
    delivery = Delivery(req, 0.0, engine.tokenizer)
    sent = []
    for msg in undisturbed:
        if len(delivery.token_ids) == k:
            break
        sent.append(delivery.pass_on(msg))
    delivery.start_migration()
    cont = delivery.continuation()
    assert cont.prompt_token_ids == prompt and cont.output_token_ids == tuple(delivery.token_ids)
    assert cont.params.max_tokens == params.max_tokens and cont.params.stop == []
    assert cont.params_pb.max_tokens == cont.params.max_tokens and not cont.params_pb.stop
    for msg in stream(engine, cont.prompt_token_ids, cont.params, f"second-{k}-{id(params)}",
                      cont.output_token_ids):
        sent.append(delivery.pass_on(msg))
        if delivery.finished:
            break
    return sent


def test_migration_continues_tokens_and_text_exactly(engine, undisturbed):
    prompt, ref = undisturbed
    free = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    ref_tokens, ref_text = tokens_and_text(ref)
    assert len(ref_tokens) == MAX_TOKENS
    for k in (1, 9):
        msgs = migrate_at(engine, prompt, free, ref, k)
        assert tokens_and_text(msgs) == (ref_tokens, ref_text), k
        final = msgs[-1]
        assert final.finish_reason == types_pb2.FINISH_REASON_LENGTH
        assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (
            len(prompt), MAX_TOKENS)


def test_stop_string_straddling_the_migration_point(engine, undisturbed):
    prompt, ref_msgs = undisturbed
    # A stop string made of the end of token 5's text, token 6's and the start of token 7's.
    pieces = [m.text for m in ref_msgs]
    assert all(len(m.token_ids) == 1 for m in ref_msgs)
    stop = pieces[5][-2:] + pieces[6] + pieces[7][:2]
    assert len(stop) >= 4
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=[stop])
    want_msgs = stream(engine, prompt, params, "ref-stop")
    want = tokens_and_text(want_msgs)
    assert want_msgs[-1].finish_reason == types_pb2.FINISH_REASON_STOP
    assert stop not in want[1] and len(want[0]) < MAX_TOKENS
    for k in (1, 6, 7):  # before, inside (text held back as a stop prefix) and at the stop
        msgs = migrate_at(engine, prompt, params, want_msgs, k)
        assert tokens_and_text(msgs) == want, k
        assert msgs[-1].finish_reason == types_pb2.FINISH_REASON_STOP
        assert msgs[-1].usage.completion_tokens == len(want[0])


def test_seeded_sampling_with_penalties_continues_exactly(engine, undisturbed):
    """The continuation's engine counts the delivered tokens as outputs: the seeded generator
    skips their draws and the penalties count them, so the sampled tail is the undisturbed
    one (it was not before: they were folded into the prompt)."""
    prompt, _ = undisturbed
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=5,
                            frequency_penalty=0.6, presence_penalty=0.3, ignore_eos=True)
    want = tokens_and_text(stream(engine, prompt, params, "ref-seeded"))
    ref_msgs = stream(engine, prompt, params, "ref-seeded-again")
    assert tokens_and_text(ref_msgs) == want  # seeded: the run repeats itself
    for k in (1, 8):
        msgs = migrate_at(engine, prompt, params, ref_msgs, k)
        assert tokens_and_text(msgs) == want, k


def test_n_choices_each_continue_as_a_request_of_their_own(engine):
    """n = 3, seeded, cut after both choices 0 and 1 have tokens and choice 2 finished: choices
    0 and 1 continue as single-choice requests (seed + index, their own outputs and text, stop
    strings to their own replay, prompt logprobs with choice 0 only); choice 2 is not resumed.
    (tests/gateway/test_structured_migration.py checks the tokens against an undisturbed run.)"""
    prompt = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=11, n=3,
                            stop=["tide"], prompt_logprobs=1)
    req = PreparedRequest("client", prompt, params, params_to_pb(params))
    delivery = Delivery(req, 0.0, engine.tokenizer)
    for index, tokens, finish in ((0, [5, 6], 0), (1, [7], 0), (2, [8, 9],
                                                                 types_pb2.FINISH_REASON_STOP)):
        delivery.pass_on(generation_pb2.GenerateStreamResponse(
            request_id="client", token_ids=tokens, text=f"<{index}>", index=index,
            finish_reason=finish))
    delivery.start_migration()
    assert delivery.replay is None  # each choice replays its own text
    assert delivery.choice_done == [False, False, True]
    for index, tokens in ((0, [5, 6]), (1, [7])):
        one = delivery.choice_delivery(index)
        cont = one.continuation()
        assert cont.output_token_ids == tuple(tokens) and one.text == f"<{index}>"
        assert cont.params.n == 1 and cont.params_pb.n == 1
        assert cont.params.seed == cont.params_pb.seed == 11 + index
        assert cont.params.stop == [] and not cont.params_pb.stop and one.replay is not None
        assert cont.params_pb.HasField("prompt_logprobs") == (index == 0)
