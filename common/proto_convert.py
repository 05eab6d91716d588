"""Conversions between splitserve.v1 messages and the engine's Python types (no torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.sampling_params import SamplingParams
from protos.splitserve.v1 import types_pb2

if TYPE_CHECKING:
    from common.sampler import TokenLogprobs

_OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                    "repetition_penalty", "frequency_penalty", "presence_penalty",
                    "skip_special_tokens", "logprobs")

FINISH_TO_PB = {
    None: types_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": types_pb2.FINISH_REASON_STOP,
    "length": types_pb2.FINISH_REASON_LENGTH,
    "abort": types_pb2.FINISH_REASON_ABORT,
}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}


def params_from_pb(pb: types_pb2.SamplingParams, **overrides: object) -> SamplingParams:
    """SamplingParams from the message (unset optional fields keep the defaults); raises
    InvalidRequestError for out-of-range values."""
    values: dict[str, object] = {f: getattr(pb, f) for f in _OPTIONAL_FIELDS if pb.HasField(f)}
    values.update(stop=list(pb.stop), stop_token_ids=list(pb.stop_token_ids),
                  ignore_eos=pb.ignore_eos, min_tokens=pb.min_tokens,
                  include_stop_str_in_output=pb.include_stop_str_in_output)
    values.update(overrides)
    return SamplingParams(**values)  # type: ignore[arg-type]


def params_to_pb(params: SamplingParams) -> types_pb2.SamplingParams:
    pb = types_pb2.SamplingParams(
        stop=params.stop, stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens, include_stop_str_in_output=params.include_stop_str_in_output)
    for f in _OPTIONAL_FIELDS:
        value = getattr(params, f)
        if value is not None:
            setattr(pb, f, value)
    return pb


def ms(seconds: float | None) -> float:
    return 0.0 if seconds is None else seconds * 1000.0


def logprobs_to_pb(lp: TokenLogprobs) -> types_pb2.TokenLogprobs:
    return types_pb2.TokenLogprobs(
        token_id=lp.token_id, logprob=lp.logprob,
        top=[types_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])
