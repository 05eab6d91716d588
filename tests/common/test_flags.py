"""common.flags: config trees as flags, flat construction, round trips back to flags."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from common.engine.config import EngineConfig
from common.flags import add_args, build, flat, from_args, group, leaf, leaves, opt, to_argv
from gateway.config import GatewayConfig
from prefill_service.config import PrefillServiceConfig


@dataclasses.dataclass(frozen=True, slots=True)
class Inner:
    size: int = opt(4, "how big")
    on: bool = opt(True, "whether")


@dataclasses.dataclass(frozen=True, slots=True)
class Outer:
    name: str | None = opt(None, "what", flag="label")
    ratio: float = opt(0.5, "how much")
    inner: Inner = group(Inner, "inner things")


def parse(cls: type, argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_args(cls, parser, "outer")
    return parser.parse_args(argv)


def test_leaves_carry_flag_type_default_and_section() -> None:
    got = [(lf.flag, lf.kind, lf.default, lf.title, lf.path) for lf in leaves(Outer, "outer")]
    assert got == [("--label", str, None, "outer", ("name",)),
                   ("--ratio", float, 0.5, "outer", ("ratio",)),
                   ("--size", int, 4, "outer: inner things", ("inner", "size")),
                   ("--on", bool, True, "outer: inner things", ("inner", "on"))]


def test_flags_build_the_nested_config_and_round_trip() -> None:
    config = from_args(Outer, parse(Outer, ["--label", "x", "--size", "9", "--no-on"]))
    assert config == Outer(name="x", inner=Inner(size=9, on=False))
    assert to_argv(config) == ["--label", "x", "--size", "9", "--no-on"]
    assert from_args(Outer, parse(Outer, to_argv(config))) == config
    assert to_argv(config, skip=("label",), skip_groups=("inner",)) == []
    assert flat(config) == {"label": "x", "ratio": 0.5, "size": 9, "on": False}


def test_build_from_flat_names_and_unknown_names() -> None:
    assert build(Outer, size=2, label="y") == Outer(name="y", inner=Inner(size=2))
    with pytest.raises(TypeError, match="no setting sise"):
        build(Outer, sise=2)
    with pytest.raises(KeyError):
        leaf(Outer, "nothing")


def test_help_lists_each_group_as_its_own_section() -> None:
    parser = argparse.ArgumentParser()
    add_args(Outer, parser, "outer")
    titles = [g.title for g in parser._action_groups]
    assert "outer" in titles and "outer: inner things" in titles
    assert "how big" in parser.format_help()


def test_two_fields_with_one_flag_are_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Clash:
        label: str = opt("a", "one")
        inner: Outer = group(Outer)

    with pytest.raises(TypeError, match="--label"):
        add_args(Clash, argparse.ArgumentParser(), "clash")


def test_a_field_without_opt_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Bare:
        size: int = 3

    with pytest.raises(TypeError, match="opt"):
        list(leaves(Bare, "bare"))


def test_real_configs_validate_in_their_groups() -> None:
    engine = build(EngineConfig, model="dummy:tiny-llama", block_size=32, speculative_method="ngram")
    assert engine.cache.block_size == 32 and engine.speculative.method == "ngram"
    assert engine.model_name == "dummy:tiny-llama"
    with pytest.raises(ValueError, match="block_size"):
        build(EngineConfig, block_size=3)
    with pytest.raises(ValueError, match="--speculative-model"):
        build(EngineConfig, speculative_method="draft")
    gateway = build(GatewayConfig, prefix_token_weight=2.0, registry_url="redis://h:1/0")
    assert gateway.router.prefix_token_weight == 2.0 and gateway.registry.url == "redis://h:1/0"
    with pytest.raises(ValueError, match="--max-retries"):
        build(GatewayConfig, max_retries=-1)
    prefill = build(PrefillServiceConfig, host="0.0.0.0", slo_ttft_ms=250.0)
    assert prefill.server.host == "0.0.0.0" and prefill.slo.objective.ttft_s == 0.25


@pytest.mark.parametrize("spec, served, want", [
    ("SmolLM2-135M-Instruct", None, "SmolLM2-135M-Instruct"), ("dummy:tiny-llama", None,
    "dummy:tiny-llama"), ("/models/llama/", None, "llama"), ("weights/m.gguf", None, "m"),
    ("m.gguf", None, "m"), ("/models/llama", "mine", "mine")])
def test_engine_and_gateway_name_the_model_alike(spec: str, served: str | None, want: str) -> None:
    engine = build(EngineConfig, model=spec, served_model_name=served)
    gateway = build(GatewayConfig, model=spec, served_model_name=served)
    assert engine.model_name == gateway.model_name == want
