"""Every command's flags keep their spelling, default, action and type (cli_flags.txt lists them:
a flag added, renamed or given a new default must be written there on purpose)."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from common.engine.config import DEFAULT_CACHE_DIR
from splitserve.cli import COMMANDS

EXPECTED = Path(__file__).with_name("cli_flags.txt")


def current_flags() -> list[str]:
    lines = []
    for name in COMMANDS:
        parser = argparse.ArgumentParser()
        importlib.import_module(f"splitserve.commands.{name.replace('-', '_')}").add_arguments(parser)
        for act in parser._actions:
            if act.option_strings and act.dest != "help":
                kind = getattr(act.type, "__name__", act.type)
                lines.append(f"{name} {sorted(act.option_strings, key=len)[-1]} "
                             f"{act.default!r} {type(act).__name__} {kind}")
    return sorted(line.replace(repr(str(DEFAULT_CACHE_DIR)), "'<cache dir>'") for line in lines)


def test_flags_are_unchanged() -> None:
    expected = EXPECTED.read_text().splitlines()
    current = current_flags()
    assert [f for f in current if f not in expected] == [], "new or changed flags"
    assert [f for f in expected if f not in current] == [], "removed or changed flags"


def test_engine_flags_are_grouped_in_help() -> None:
    parser = argparse.ArgumentParser()
    importlib.import_module("splitserve.commands.decode").add_arguments(parser)
    titles = {g.title for g in parser._action_groups}
    assert {"engine: model", "engine: KV cache", "engine: scheduler",
            "engine: speculative decoding", "engine: CUDA graphs", "decode service: server",
            "decode service: registry", "decode service: SLO", "TLS"} <= titles
