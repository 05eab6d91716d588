"""The disaggregated stack as separate processes on loopback (issue 3, "Show" 1-3): one gateway,
two prefill and two decode services, a real redis-server, the real SmolLM2 model, and a plain
grpcio client generated from protos/. The last test stops the stack and checks Redis is empty."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.engine.config import EngineConfig
from common.engine.core.sampling_params import SamplingParams
from common.engine.engine import LLMEngine
from common.flags import build
from common.registry.embedded import free_port
from protos.splitserve.v1 import generation_pb2, generation_pb2_grpc, types_pb2

pytestmark = pytest.mark.slow

MAX_TOKENS = 16
TOPICS = ["the moon", "bread", "chess", "rain", "volcanoes", "bees", "trains", "music"]


def chat(text: str) -> generation_pb2.ChatMessages:
    return generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="user",
                                                                            content=text)])


@pytest.fixture(scope="module")
def reference(model_cache_dir) -> LLMEngine:
    """The in-process engine the stack must match token for token."""
    return LLMEngine(build(EngineConfig, model_cache_dir=str(model_cache_dir), num_kv_blocks=1024))


def generate(engine: LLMEngine, prompts: list[list[int]],
             params: SamplingParams | list[SamplingParams]) -> list:
    """engine.generate on a worker thread, as the services step their engines: on this 2-core
    box torch steps run several times slower on the main thread."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(engine.generate, prompts, params).result()


def build_requests(tok) -> list[tuple[generation_pb2.GenerateStreamRequest, list[int]]]:
    """32 requests (chat, raw text, token ids; two with a stop string) and their prompt ids."""
    out = []
    for i in range(32):
        topic = TOPICS[i % len(TOPICS)]
        params = types_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        if i % 8 == 7:
            params.stop.append(".")
        if i % 3 == 0:
            text = f"Tell me one fact about {topic}." + " Be brief." * (i % 5)
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                             add_special_tokens=False)
            req = generation_pb2.GenerateStreamRequest(messages=chat(text), params=params)
        elif i % 3 == 1:
            text = f"A short story about {topic} (part {i}):" + " Once upon a time" * (i % 4)
            ids = tok.encode(text)
            req = generation_pb2.GenerateStreamRequest(prompt=text, params=params)
        else:
            ids = tok.encode(f"List {i} words related to {topic}:" * (1 + i % 6))
            req = generation_pb2.GenerateStreamRequest(
                prompt_token_ids=generation_pb2.TokenIds(ids=ids), params=params)
        req.request_id = f"show1-{i}"
        out.append((req, ids))
    return out


def stream(stack, request, timeout: float = 120.0) -> list[generation_pb2.GenerateStreamResponse]:
    return list(stack.stub.GenerateStream(request, timeout=timeout))


def test_32_concurrent_streams_match_the_in_process_engine(stack, reference):
    requests = build_requests(reference.tokenizer)
    with ThreadPoolExecutor(len(requests)) as pool:
        answers = list(pool.map(lambda r: stream(stack, r[0]), requests))
    expected = generate(
        reference, [ids for _, ids in requests],
        [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=list(req.params.stop))
         for req, _ in requests])
    for (req, ids), msgs, want in zip(requests, answers, expected, strict=True):
        final = msgs[-1]
        assert [t for m in msgs for t in m.token_ids] == want.output_token_ids, req.request_id
        assert "".join(m.text for m in msgs) == want.text, req.request_id
        assert final.finish_reason == types_pb2.FinishReason.Value(
            f"FINISH_REASON_{want.finish_reason.upper()}")
        assert all(not m.finish_reason for m in msgs[:-1])
        assert final.usage.prompt_tokens == len(ids)
        assert final.usage.completion_tokens == len(want.output_token_ids)
        assert {m.request_id for m in msgs} == {req.request_id}
        assert final.timings.prefill_instance.startswith("prefill-")
        if len(want.output_token_ids) > 1:
            assert final.timings.decode_instance.startswith("decode-")
            # first token -> queued in the decode engine with the KV verified, one host's clock
            assert 0 < final.timings.handoff_critical_ms < final.timings.total_ms
    used = {m[-1].timings.prefill_instance for m in answers}
    assert used == {"prefill-0", "prefill-1"}  # the load was spread
    assert {m[-1].timings.decode_instance for m in answers} >= {"decode-0", "decode-1"}
    # Afterwards: no pending delivery, no referenced blocks on any service.
    stack.wait_idle(timeout_s=2.0)


def test_same_long_prompt_goes_to_the_prefill_holding_its_prefix(stack, reference):
    tok = reference.tokenizer
    ids = tok.encode("The history of the printing press, told slowly. " * 80)[:801]
    assert len(ids) == 801
    request = generation_pb2.GenerateStreamRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=ids),
        params=types_pb2.SamplingParams(max_tokens=4, temperature=0.0))
    first, second = stream(stack, request), stream(stack, request)
    assert first[-1].usage.num_cached_tokens == 0
    assert second[-1].timings.prefill_instance == first[-1].timings.prefill_instance
    assert second[-1].usage.num_cached_tokens == 800  # all 50 full blocks
    tokens = [[t for m in msgs for t in m.token_ids] for msgs in (first, second)]
    assert tokens[0] == tokens[1] == generate(reference,
        [ids], SamplingParams(max_tokens=4, temperature=0.0))[0].output_token_ids


def long_request(request_id: str, max_tokens: int = 400) -> generation_pb2.GenerateStreamRequest:
    return generation_pb2.GenerateStreamRequest(
        request_id=request_id, prompt="Count from one to a thousand: one, two, three,",
        params=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


def test_cancelling_a_stream_frees_blocks_on_both_services_within_1s(stack):
    call = stack.stub.GenerateStream(long_request("cancel-me"), timeout=60)
    seen = [next(call) for _ in range(3)]  # first token from prefill, then decode
    busy = stack.stats()
    assert sum(s.num_used_blocks for s in busy.values() if s.role == "decode") > 0
    call.cancel()
    assert stack.wait_idle(timeout_s=1.0) < 1.0
    assert len(seen) == 3


def test_cancelling_during_prefill_frees_its_blocks_within_1s(stack, reference):
    ids = reference.tokenizer.encode("A very long preamble about nothing at all. " * 120)
    request = generation_pb2.GenerateStreamRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=ids),
        params=types_pb2.SamplingParams(max_tokens=8, temperature=0.0))
    call = stack.stub.GenerateStream(request, timeout=60)
    time.sleep(0.3)  # a ~1000-token prompt is still prefilling
    call.cancel()
    assert stack.wait_idle(timeout_s=1.0) < 1.0


def test_abort_by_request_id_ends_the_stream(stack):
    call = stack.stub.GenerateStream(long_request("abort-me"), timeout=60)
    next(call), next(call)
    assert stack.stub.Abort(types_pb2.AbortRequest(request_id="abort-me"), timeout=5).found
    rest = list(call)
    assert rest[-1].finish_reason == types_pb2.FINISH_REASON_ABORT
    assert stack.wait_idle(timeout_s=1.0) < 1.0
    assert not stack.stub.Abort(types_pb2.AbortRequest(request_id="abort-me"), timeout=5).found


def test_deadline_exceeded_frees_blocks(stack):
    with pytest.raises(grpc.RpcError) as err:
        stream(stack, long_request("too-slow"), timeout=1.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert stack.wait_idle(timeout_s=1.0) < 1.0


def test_invalid_requests_get_invalid_argument(stack):
    bad = generation_pb2.GenerateStreamRequest(prompt="hi", params=types_pb2.SamplingParams(top_p=0))
    with pytest.raises(grpc.RpcError) as err:
        stream(stack, bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == "top_p must be in (0, 1], got 0.0"


def test_unary_generate_and_tokenize(stack, reference):
    tok = reference.tokenizer
    out = stack.stub.Generate(generation_pb2.GenerateRequest(
        prompt="The capital of France is",
        params=types_pb2.SamplingParams(max_tokens=6, temperature=0.0)), timeout=60)
    want = generate(reference, [tok.encode("The capital of France is")],
                              SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert list(out.token_ids) == want.output_token_ids and out.text == want.text
    ids = stack.stub.Tokenize(generation_pb2.TokenizeRequest(prompt="Hello world"), timeout=5)
    assert list(ids.token_ids) == tok.encode("Hello world")
    info = stack.stub.ModelInfo(generation_pb2.ModelInfoRequest(), timeout=5)
    assert (info.model, info.block_size, list(info.eos_token_ids)) == (
        "SmolLM2-135M-Instruct", 16, list(tok.eos_token_ids))


def test_every_service_serves_health_and_reflection(stack):
    addresses = {"gateway": f"127.0.0.1:{stack.gateway_port}"}
    for kind in ("prefill", "decode"):
        addresses |= {i.instance_id: i.address for i in stack.registry.list_instances(kind)}
    for name, address in addresses.items():
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING, name
            reply = next(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
            services = {s.name for s in reply.list_services_response.service}
            role = name.split("-")[0]
            want = {"gateway": {"splitserve.v1.GenerationService"},
                    "prefill": {"splitserve.v1.PrefillService", "splitserve.v1.KVTransferService"},
                    "decode": {"splitserve.v1.DecodeService"}}[role]
            assert want | {"grpc.health.v1.Health"} <= services, name


def test_backpressure_and_no_instances(stack):
    """A gateway with --max-inflight 1 refuses a second request; one whose registry namespace is
    empty answers UNAVAILABLE. Both start in seconds: the gateway imports no torch."""
    small, empty = free_port(), free_port()
    start = time.monotonic()
    stack.start("gateway-small", stack.gateway_argv(small, extra=("--max-inflight", "1")))
    stack.start("gateway-empty", stack.gateway_argv(empty, namespace="nobody-here"))
    stubs = {}
    for name, port in (("small", small), ("empty", empty)):
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        grpc.channel_ready_future(channel).result(timeout=30)
        stubs[name] = generation_pb2_grpc.GenerationServiceStub(channel)
    print(f"two extra gateways serving after {time.monotonic() - start:.1f} s")
    first = stubs["small"].GenerateStream(long_request("hog", max_tokens=200), timeout=60)
    next(first)
    with pytest.raises(grpc.RpcError) as err:
        list(stubs["small"].GenerateStream(long_request("second"), timeout=10))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "limit of 1 requests" in err.value.details()
    first.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(stubs["empty"].GenerateStream(long_request("lonely"), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details() == "no decode instance is registered"
    stack.wait_idle(timeout_s=2.0)


def test_short_prompts_prefilled_on_the_decode_service(stack, reference):
    port = free_port()
    stack.start("gateway-local", stack.gateway_argv(
        port, extra=("--local-prefill-max-tokens", "64")))
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        grpc.channel_ready_future(channel).result(timeout=30)
        ids = reference.tokenizer.encode("Why is the sky blue?")
        msgs = list(generation_pb2_grpc.GenerationServiceStub(channel).GenerateStream(
            generation_pb2.GenerateStreamRequest(
                prompt_token_ids=generation_pb2.TokenIds(ids=ids),
                params=types_pb2.SamplingParams(max_tokens=8, temperature=0.0)), timeout=60))
    want = generate(reference, [ids], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert [t for m in msgs for t in m.token_ids] == want.output_token_ids
    timings = msgs[-1].timings
    assert timings.prefill_instance == "" and timings.decode_instance.startswith("decode-")
    stack.wait_idle(timeout_s=2.0)


def test_generate_command_streams_the_answer(stack, reference):
    out = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "generate", "--gateway",
         f"127.0.0.1:{stack.gateway_port}", "--no-chat", "--max-tokens", "6",
         "The capital of France is"], capture_output=True, text=True, timeout=120, check=True)
    want = generate(reference, [reference.tokenizer.encode("The capital of France is")],
                              SamplingParams(max_tokens=6, temperature=0.0))[0]
    assert out.stdout == want.text + "\n"
    assert "[length] prompt 5 tokens" in out.stderr



def test_zz_stopping_leaves_redis_and_shared_memory_empty(stack):
    pids = [p.pid for p in stack.procs.values()]
    codes = stack.stop()
    assert set(codes.values()) == {0}, codes
    assert stack.registry.namespace_keys() == []
    assert [f for f in os.listdir("/dev/shm") if any(f"-{pid}-" in f for pid in pids)] == []
