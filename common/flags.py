"""Frozen config dataclasses as command-line flags: one flag per leaf field, help next to it.

A config is a frozen dataclass whose fields are either leaves, declared with `opt(default,
"help")`, or groups, declared with `group(SubConfig)`. A group's leaves become flags of their own
`--help` section, named after the leaf (`--block-size`) unless the leaf names its flag
(`opt(..., flag="model")`). Flag names are unique across a config's tree, so a config can also be
built from flat keyword arguments (`build(EngineConfig, block_size=32)`) and turned back into
flags (`to_argv`), which is how `splitserve up` hands its settings to the services it starts.

    EngineConfig                          flags
    ├── model: ModelSettings    ────────  "engine: model"      --model, --dtype, ...
    ├── cache: CacheConfig      ────────  "engine: KV cache"   --block-size, ...
    └── ...

Defaults live only in the field declarations. Imports no torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from collections.abc import Iterator
from typing import Any, TypeVar, get_type_hints

T = TypeVar("T")


def opt(default: Any, help: str, *, flag: str | None = None) -> Any:
    """A leaf field: its default and its `--help` line (and its flag, when not the field name)."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag})


def group(cls: type, title: str | None = None) -> Any:
    """A field holding a nested config; its leaves appear under `title` in `--help`."""
    return dataclasses.field(default_factory=cls, metadata={"group": cls, "title": title})


@dataclasses.dataclass(frozen=True, slots=True)
class Leaf:
    path: tuple[str, ...]   # attribute names from the root config down to the field
    dest: str               # argparse destination (the flag without dashes, "_" for "-")
    default: Any
    kind: type              # int, float, str or bool
    help: str
    title: str              # the --help section it belongs to

    @property
    def flag(self) -> str:
        return "--" + self.dest.replace("_", "-")


def _kind(annotation: Any) -> type:
    """int, float, bool or str: the annotation with `| None` taken off."""
    options = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return options[0] if options[0] in (int, float, bool, str) else str


def leaves(cls: type, title: str, _path: tuple[str, ...] = ()) -> Iterator[Leaf]:
    """Every leaf of `cls`'s tree, depth first in declaration order."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if "group" in f.metadata:
            sub_title = f.metadata["title"] or f.name.replace("_", " ")
            yield from leaves(f.metadata["group"], f"{title}: {sub_title}", (*_path, f.name))
        elif "help" in f.metadata:
            default = f.default
            yield Leaf((*_path, f.name), f.metadata["flag"] or f.name, default,
                       bool if isinstance(default, bool) else _kind(hints[f.name]),
                       f.metadata["help"], title)
        else:
            raise TypeError(f"{cls.__name__}.{f.name}: declare it with opt() or group()")


def add_args(cls: type, parser: argparse.ArgumentParser, title: str) -> None:
    """One flag per leaf of `cls`, grouped by section."""
    sections: dict[str, argparse._ArgumentGroup] = {}
    seen: set[str] = set()
    for leaf in leaves(cls, title):
        if leaf.dest in seen:
            raise TypeError(f"{cls.__name__}: two fields use the flag {leaf.flag}")
        seen.add(leaf.dest)
        section = sections.get(leaf.title) or parser.add_argument_group(leaf.title)
        sections[leaf.title] = section
        if leaf.kind is bool:
            section.add_argument(leaf.flag, dest=leaf.dest, default=leaf.default,
                                 action=argparse.BooleanOptionalAction, help=leaf.help)
        else:
            section.add_argument(leaf.flag, dest=leaf.dest, default=leaf.default,
                                 type=leaf.kind, help=leaf.help)


def build(cls: type[T], **flat: Any) -> T:
    """A config from flat keyword arguments named like its flags (`block_size=32`); the others
    keep their defaults. An unknown name is a TypeError."""
    known = {leaf.dest for leaf in leaves(cls, "")}
    unknown = set(flat) - known
    if unknown:
        raise TypeError(f"{cls.__name__} has no setting {', '.join(sorted(unknown))}")
    return _build(cls, flat)


def _build(cls: type[T], values: dict[str, Any]) -> T:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if "group" in f.metadata:
            kwargs[f.name] = _build(f.metadata["group"], values)
        else:
            dest = f.metadata["flag"] or f.name
            if dest in values:
                kwargs[f.name] = values[dest]
    return cls(**kwargs)


def from_args(cls: type[T], args: argparse.Namespace, **overrides: Any) -> T:
    """The config that `args` (parsed from add_args' flags) describe; `overrides` by flag name."""
    values = {leaf.dest: getattr(args, leaf.dest) for leaf in leaves(cls, "")
              if hasattr(args, leaf.dest)}
    values.update(overrides)
    return build(cls, **values)


def flat(config: Any) -> dict[str, Any]:
    """Flag name -> value of every leaf of `config`."""
    out = {}
    for leaf in leaves(type(config), ""):
        value = config
        for name in leaf.path:
            value = getattr(value, name)
        out[leaf.dest] = value
    return out


def to_argv(config: Any, skip: tuple[str, ...] = (),
            skip_groups: tuple[str, ...] = ()) -> list[str]:
    """The flags that rebuild `config`. Leaves equal to their defaults are left out, and so are
    the flags named in `skip` (`"model"`) and the leaves of the groups in `skip_groups`
    (`"speculative"`, by attribute name on the root config)."""
    argv: list[str] = []
    values = flat(config)
    for leaf in leaves(type(config), ""):
        value = values[leaf.dest]
        in_skipped_group = len(leaf.path) > 1 and leaf.path[0] in skip_groups
        if leaf.dest in skip or in_skipped_group or value == leaf.default:
            continue
        if isinstance(value, bool):
            argv.append(leaf.flag if value else "--no-" + leaf.flag[2:])
        else:
            argv += [leaf.flag, str(value)]
    return argv


def leaf(cls: type, dest: str) -> Leaf:
    """The leaf of `cls`'s tree behind the flag `dest` (for scripts that reuse a default or a
    help text)."""
    found = next((lf for lf in leaves(cls, "") if lf.dest == dest), None)
    if found is None:
        raise KeyError(f"{cls.__name__} has no setting {dest!r}")
    return found
