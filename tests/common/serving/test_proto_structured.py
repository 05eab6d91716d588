"""The SamplingParams `structured` oneof <-> StructuredOutput (common/serving/proto_convert.py)."""

from __future__ import annotations

import pytest

from common.engine.core.sampling_params import SamplingParams, StructuredOutput
from common.errors import InvalidRequestError
from common.serving.proto_convert import FINISH_FROM_PB, params_from_pb, params_to_pb
from protos.splitserve.v1 import types_pb2


@pytest.mark.parametrize(("spec", "field"), [
    (StructuredOutput("json", '{"type": "object"}'), "json_schema"),
    (StructuredOutput("json_object"), "json_object"),
    (StructuredOutput("regex", "[0-9]+"), "regex"),
    (StructuredOutput("choice", choices=("a", "b c")), "choice"),
    (StructuredOutput("grammar", 'root ::= "x"'), "grammar"),
])
def test_round_trip(spec, field):
    pb = params_to_pb(SamplingParams(max_tokens=3, structured=spec))
    assert pb.WhichOneof("structured") == field
    back = params_from_pb(pb)
    assert back.structured == spec and back.speculative is False
    # the prefill service's overrides keep it
    assert params_from_pb(pb, max_tokens=1, ignore_eos=True).structured == spec


def test_unset_and_refused():
    assert params_from_pb(types_pb2.SamplingParams()).structured is None
    assert params_from_pb(types_pb2.SamplingParams(json_object=False)).structured is None
    with pytest.raises(InvalidRequestError, match="at least one string"):
        params_from_pb(types_pb2.SamplingParams(choice=types_pb2.Choices()))
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        params_from_pb(types_pb2.SamplingParams(json_schema="{"))
    assert FINISH_FROM_PB[types_pb2.FINISH_REASON_GRAMMAR] == "grammar"
