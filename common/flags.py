"""Flags from a frozen config dataclass: one `--field-name` per field, help from its HELP dict.

Services build their configs this way (the same rules as common.engine.config.EngineConfig), so every
setting is a flag and a field, and a service's flags can be rebuilt from its config (`to_argv`).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_dataclass_args(cls: type, parser: argparse.ArgumentParser, group_name: str,
                       skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group(group_name)
    defaults = cls()
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            group.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction,
                               default=default, help=cls.HELP[f.name])
        else:
            kind = {"int": int, "float": float}.get(str(f.type).replace(" | None", ""), str)
            group.add_argument(_flag(f.name), type=kind, default=default, help=cls.HELP[f.name])


def from_dataclass_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)  # type: ignore[arg-type]
              if hasattr(args, f.name)}
    values.update(overrides)
    return cls(**values)


def to_argv(config: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """The flags that rebuild `config` (fields equal to their defaults, and `skip`, left out)."""
    defaults = type(config)()
    argv: list[str] = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in skip or value == getattr(defaults, f.name):
            continue
        if isinstance(value, bool):
            argv.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        else:
            argv += [_flag(f.name), str(value)]
    return argv
