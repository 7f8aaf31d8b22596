"""Daemon options generated from config dataclasses: flags, AGORA_* variables, TOML keys.

A dataclass field declared with `option(...)` is an operator option. Its option
name (the field name, or `name=` where the attribute carries a unit, e.g.
`refresh_s` -> `refresh`) gives the flag `--refresh`, the environment variable
`AGORA_REFRESH` and the `--config` TOML key `refresh` (`-` or `_`). Its type
(str, int, float, list[str], `X | None`) says how text converts; `parse=` turns
the text into another value (a manifest name into a Manifest). Validation is the
dataclass's own `__post_init__`. A nested config dataclass contributes its
options flat (`--max-in-flight`, not `--pipeline-max-in-flight`).

Precedence: command line > environment (an empty variable counts as unset) >
`--config` file > field default.
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any

from agora_node.node.errors import UsageError

_WHAT = {int: "an integer", float: "a number", str: "a string", list: "a list of strings"}


def option(
    default: Any = MISSING,
    *,
    help: str,
    name: str | None = None,
    factory: Callable[[], Any] | None = None,
    parse: Callable[[str], Any] | None = None,
    shown: str | None = None,
) -> Any:
    """A dataclass field that is also an operator option (`shown`: the default as help prints it)."""
    metadata = {"help": help, "name": name, "parse": parse, "shown": shown}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Option:
    name: str
    path: tuple[str, ...]
    """Attribute path in the config: ("refresh_s",) or ("pipeline", "max_in_flight")."""
    kind: type
    help: str
    shown: str
    parse: Callable[[str], Any] | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "AGORA_" + self.name.upper()


def options_of(cls: type) -> list[Option]:
    """The options of a config dataclass, nested config dataclasses flattened, in field order."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint) and "help" not in f.metadata:
            found += [dataclasses.replace(o, path=(f.name, *o.path)) for o in options_of(hint)]
        elif "help" in f.metadata:
            m = f.metadata
            found.append(
                Option(
                    name=m["name"] or f.name,
                    path=(f.name,),
                    kind=str if m["parse"] else _kind(hint),
                    help=m["help"],
                    shown=m["shown"] if m["shown"] is not None else _shown(f),
                    parse=m["parse"],
                )
            )
    return found


def flag_of(cls: type, attribute: str) -> str:
    """The flag of a field, for validation messages: flag_of(NodeConfig, "refresh_s") == "--refresh"."""
    return next(o.flag for o in options_of(cls) if o.path[-1] == attribute)


def _kind(hint: Any) -> type:
    if typing.get_origin(hint) is list:
        return list
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        return _kind(args[0])
    if hint not in _WHAT:
        raise TypeError(f"an option cannot have type {hint!r}")
    return hint


def _shown(f: dataclasses.Field) -> str:
    value = f.default if f.default is not MISSING else f.default_factory()
    if isinstance(value, list):
        value = " ".join(value)
    return "" if value in (None, "") else str(value)


def add_arguments(parser: Any, cls: type) -> None:
    """One argparse flag per option; values stay text (converted in `resolve`, one error path)."""
    for opt in options_of(cls):
        text = opt.help + (f" (default: {opt.shown})" if opt.shown else "")
        nargs = "+" if opt.kind is list else None
        parser.add_argument(opt.flag, dest=opt.name, nargs=nargs, default=None, help=text)


def config_file(given: str | None, env: Mapping[str, str]) -> tuple[str | None, str]:
    """The config file a command reads, and where its path came from (for messages): the
    `--config` flag's `given`, else AGORA_CONFIG (as every option, the help says)."""
    if not given and env.get("AGORA_CONFIG"):
        return env["AGORA_CONFIG"], "AGORA_CONFIG"
    return given, "--config"


def read_config_file(path: str, cls: type, name: str = "--config") -> dict[str, Any]:
    """The option values in a TOML file (keys as the long flags, with `_` or `-`); `name`:
    where the path came from, for the messages (`--config`, or `AGORA_CONFIG`)."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"{name} {path}: {' '.join(str(exc).split())}") from None
    values = {key.replace("-", "_"): value for key, value in raw.items()}
    twice = sorted(k for k, n in Counter(k.replace("-", "_") for k in raw).items() if n > 1)
    if twice:  # status-port and status_port both: the last one won, silently
        raise UsageError(f"{name} {path}: given twice (with - and _): {', '.join(twice)}")
    unknown = set(values) - {o.name for o in options_of(cls)}
    if unknown:
        raise UsageError(f"{name} {path}: unknown option(s) {', '.join(sorted(unknown))}")
    return values


def resolve(
    cls: type,
    cli: Mapping[str, Any],
    env: Mapping[str, str],
    file_values: Mapping[str, Any] | None = None,
    file_name: str = "--config",
) -> Any:
    """An instance of `cls`: each option from the command line, else env, else file, else default."""
    file_values = file_values or {}
    values: dict[tuple[str, ...], Any] = {}
    sources: dict[str, str] = {}  # flag -> where its value came from, when not the flag
    for opt in options_of(cls):
        if cli.get(opt.name) is not None:
            values[opt.path] = convert(opt, cli[opt.name], opt.flag)
        elif env.get(opt.env):
            values[opt.path] = convert(opt, env[opt.env], opt.env)
            sources[opt.flag] = opt.env
        elif opt.name in file_values:
            values[opt.path] = convert(opt, file_values[opt.name], f"{file_name}: {opt.name}")
            sources[opt.flag] = f"{opt.name} in {file_name}"
    try:
        return _build(cls, values)
    except UsageError as exc:  # a range check names the flag: say where the value was set
        message = str(exc)
        for flag, where in sources.items():
            if message.startswith((f"{flag} ", f"{flag}:")):
                raise UsageError(f"{message} (set by {where})") from None
        raise


def _build(cls: type, values: dict[tuple[str, ...], Any]) -> Any:
    kwargs: dict[str, Any] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if (f.name,) in values:
            kwargs[f.name] = values[(f.name,)]
            continue
        nested = {p[1:]: v for p, v in values.items() if len(p) > 1 and p[0] == f.name}
        if nested:
            kwargs[f.name] = _build(hints[f.name], nested)
    return cls(**kwargs)


def convert(opt: Option, raw: Any, source: str) -> Any:
    """`raw` (text from a flag or variable, or a TOML value) as the option's type."""
    if opt.kind is list:
        items = raw.split() if isinstance(raw, str) else raw
        if isinstance(items, list) and all(isinstance(v, str) for v in items):
            return list(items)
        raise UsageError(f"{source}: {raw!r} is not {_WHAT[list]}")
    bad = UsageError(f"{source}: {raw!r} is not {_WHAT[opt.kind]}")
    if isinstance(raw, bool) or not isinstance(raw, str | int | float):
        raise bad
    if opt.parse is not None:
        if not isinstance(raw, str):
            raise bad
        try:
            return opt.parse(raw)
        except UsageError as exc:  # its own one line, which does not say where the text was
            raise UsageError(f"{source}: {exc}") from None
    try:
        if opt.kind is int and not isinstance(raw, float):
            return int(raw)
        if opt.kind is float:
            return float(raw)
        if opt.kind is str and not isinstance(raw, float):
            return str(raw)  # a TOML integer is fine for --stage
    except ValueError:
        pass
    raise bad
