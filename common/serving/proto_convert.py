"""Conversions between splitserve.v1 messages and the engine's Python types (no torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.engine.core.sampling_params import SamplingParams, StructuredOutput
from common.errors import InvalidRequestError
from protos.splitserve.v1 import types_pb2

if TYPE_CHECKING:
    from common.engine.sampler import TokenLogprobs

_OPTIONAL_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed",
                    "repetition_penalty", "frequency_penalty", "presence_penalty",
                    "skip_special_tokens", "logprobs", "n", "prompt_logprobs")

FINISH_TO_PB = {
    None: types_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": types_pb2.FINISH_REASON_STOP,
    "length": types_pb2.FINISH_REASON_LENGTH,
    "abort": types_pb2.FINISH_REASON_ABORT,
    "grammar": types_pb2.FINISH_REASON_GRAMMAR,
}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}


def params_from_pb(pb: types_pb2.SamplingParams, **overrides: object) -> SamplingParams:
    """SamplingParams from the message (unset optional fields keep the defaults); raises
    InvalidRequestError for out-of-range values."""
    values: dict[str, object] = {f: getattr(pb, f) for f in _OPTIONAL_FIELDS if pb.HasField(f)}
    values.update(stop=list(pb.stop), stop_token_ids=list(pb.stop_token_ids),
                  ignore_eos=pb.ignore_eos, min_tokens=pb.min_tokens,
                  include_stop_str_in_output=pb.include_stop_str_in_output)
    values["structured"] = structured_from_pb(pb)
    values.update(overrides)
    return SamplingParams(**values)  # type: ignore[arg-type]


# StructuredOutput.kind <-> the field of the SamplingParams `structured` oneof.
_STRUCTURED_FIELDS = {"json": "json_schema", "json_object": "json_object", "regex": "regex",
                      "choice": "choice", "grammar": "grammar"}
_STRUCTURED_KINDS = {v: k for k, v in _STRUCTURED_FIELDS.items()}


def structured_from_pb(pb: types_pb2.SamplingParams) -> StructuredOutput | None:
    """The oneof `structured` as a StructuredOutput (None when unset; json_object false is
    unset too); InvalidRequestError for an empty one."""
    name = pb.WhichOneof("structured")
    if name is None or (name == "json_object" and not pb.json_object):
        return None
    kind = _STRUCTURED_KINDS[name]
    if kind == "choice":
        return StructuredOutput(kind, choices=tuple(pb.choice.values))
    return StructuredOutput(kind, "" if kind == "json_object" else getattr(pb, name))


def structured_to_pb(structured: StructuredOutput, pb: types_pb2.SamplingParams) -> None:
    """Set the oneof `structured` of pb from a StructuredOutput."""
    if structured.kind == "choice":
        pb.choice.values.extend(structured.choices)
    elif structured.kind == "json_object":
        pb.json_object = True
    else:
        setattr(pb, _STRUCTURED_FIELDS[structured.kind], structured.value)


def params_to_pb(params: SamplingParams) -> types_pb2.SamplingParams:
    """The message for validated settings; InvalidRequestError for a value its wire type cannot
    carry (a max_tokens of 2**32 or more, a negative top_k below int32, ...: HTTP clients)."""
    pb = types_pb2.SamplingParams(
        ignore_eos=params.ignore_eos, include_stop_str_in_output=params.include_stop_str_in_output)
    values = {"stop": params.stop, "stop_token_ids": params.stop_token_ids,
              "min_tokens": params.min_tokens}
    values.update((f, getattr(params, f)) for f in _OPTIONAL_FIELDS
                  if getattr(params, f) is not None)
    for name, value in values.items():
        try:
            if isinstance(value, list):
                getattr(pb, name).extend(value)
            else:
                setattr(pb, name, value)
        except (ValueError, TypeError) as e:
            shown = "" if isinstance(value, list) else f" ({value})"
            raise InvalidRequestError(f"{name} is out of range{shown}") from e
    if params.structured is not None:
        structured_to_pb(params.structured, pb)
    return pb


def ms(seconds: float | None) -> float:
    return 0.0 if seconds is None else seconds * 1000.0


def logprobs_to_pb(lp: TokenLogprobs) -> types_pb2.TokenLogprobs:
    return types_pb2.TokenLogprobs(
        token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
        top=[types_pb2.TopLogprob(token_id=t, logprob=v) for t, v in lp.top])


def prompt_logprobs_to_pb(lps: list[TokenLogprobs | None] | None) -> list[types_pb2.TokenLogprobs]:
    """An engine's prompt_logprobs (None for the first prompt token) as the messages of the
    tokens after the first."""
    return [logprobs_to_pb(lp) for lp in lps or () if lp is not None]
