"""`splitserve generate`: send one prompt to a gateway and stream the answer to stdout."""

from __future__ import annotations

import argparse
import sys

import grpc

from common.serving.auth import AuthConfig, bearer_metadata
from common.serving.tls import TlsConfig, sync_channel
from protos.splitserve.v1 import generation_pb2, generation_pb2_grpc, types_pb2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt (a user message with --chat)")
    parser.add_argument("--gateway", default="127.0.0.1:50051", help="gateway address host:port")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="send the prompt as a user message through the chat template")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--timeout-s", type=float, default=300.0, help="request deadline")
    parser.add_argument("--stats", action=argparse.BooleanOptionalAction, default=True,
                        help="print usage and per-stage timings to stderr at the end")
    TlsConfig.add_cli_args(parser)  # --tls-ca: dial a gateway that serves TLS
    AuthConfig.add_cli_args(parser)  # the key to send


def build_request(args: argparse.Namespace) -> generation_pb2.GenerateStreamRequest:
    params = types_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                      top_p=args.top_p, stop=args.stop)
    if args.seed is not None:
        params.seed = args.seed
    if not args.chat:
        return generation_pb2.GenerateStreamRequest(prompt=args.prompt, params=params)
    messages = [generation_pb2.ChatMessage(role="system", content=args.system)] if args.system else []
    messages.append(generation_pb2.ChatMessage(role="user", content=args.prompt))
    return generation_pb2.GenerateStreamRequest(
        messages=generation_pb2.ChatMessages(messages=messages), params=params)


def run(args: argparse.Namespace) -> int:
    metadata = bearer_metadata(AuthConfig.from_cli_args(args).client_key())
    with sync_channel(args.gateway, TlsConfig.from_cli_args(args)) as channel:
        stub = generation_pb2_grpc.GenerationServiceStub(channel)
        try:
            for msg in stub.GenerateStream(build_request(args), timeout=args.timeout_s,
                                           metadata=metadata):
                sys.stdout.write(msg.text)
                sys.stdout.flush()
                if msg.finish_reason:
                    final = msg
        except grpc.RpcError as e:
            print(f"\nerror: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print()
    if args.stats:
        u, t = final.usage, final.timings
        reason = types_pb2.FinishReason.Name(final.finish_reason).removeprefix("FINISH_REASON_")
        print(f"[{reason.lower()}] prompt {u.prompt_tokens} tokens ({u.num_cached_tokens} cached), "
              f"output {u.completion_tokens}; ttft {t.ttft_ms:.1f} ms, total {t.total_ms:.1f} ms "
              f"(prefill {t.prefill_compute_ms:.1f} ms on {t.prefill_instance or '-'}, handoff "
              f"{t.handoff_ms:.1f} ms, decode on {t.decode_instance or '-'})", file=sys.stderr)
    return 0
