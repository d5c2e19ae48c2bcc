"""Options declared once: frozen dataclasses whose fields are command-line flags.

Each concern (the model, the scheduler's batch limits, the executor, the gateway, ...)
is a frozen dataclass beside the code that owns it; each field is an `option(...)` that
carries its help, its choices and how its text is parsed. From a dataclass the same
three things follow everywhere:

- `add_options(parser, classes)`: their flags, `--field-name` (a bool that defaults to True
  is `--no-field-name`, one that defaults to False `--field-name`);
- `from_args(cls, args)`: the dataclass from a parsed Namespace;
- `to_argv(config)`: the flags that give that dataclass back, defaults left out, so that
  a stage's parser built from the same class parses them to the same config.

A field whose default is a dataclass (`group(cls)`) nests that group: its flags are
the group's own, flat on the command line. A field marked `stage_only` names one
process (a replica's name, a tensor-parallel rank): a stage takes it, while `serve`
sets it per process itself. `serve_only` is the opposite: `serve` takes it and
decides from it, a stage does not. A field with `forward=False` never goes on a
command line (the API key travels in the environment).
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import MISSING, Field, field, fields, replace
from typing import Any


def option(default: Any = None, help: str | None = None, *, choices: tuple | list | None = None,
           parse: Callable[[str], Any] | None = None, flag: str | None = None, serve_flag: str | None = None,
           default_factory: Callable[[], Any] | None = None, stage_only: bool = False, serve_only: bool = False,
           forward: bool = True, nargs: str | None = None) -> Any:
    """A dataclass field that is also a flag (see the module doc). `parse` turns the flag's
    text into the value (default: the type of the default, else str); `serve_flag` is its
    name on `serve` where a stage's own would be unclear there (--threads: whose?); `nargs` ("*", "+")
    makes it a list of values, each parsed (its default a tuple)."""
    meta = {"help": help, "choices": choices, "parse": parse, "flag": flag, "serve_flag": serve_flag,
            "stage_only": stage_only, "serve_only": serve_only, "forward": forward, "nargs": nargs}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def group(cls: type) -> Any:
    """A field that nests the option group `cls` (its flags flat among the others')."""
    return field(default_factory=cls, metadata={"group": cls})


def default_of(f: Field) -> Any:
    return f.default_factory() if f.default is MISSING else f.default


def flag_of(f: Field) -> str:
    if f.metadata.get("flag"):
        return f.metadata["flag"]
    name = f.name.replace("_", "-")
    return f"--no-{name}" if default_of(f) is True else f"--{name}"


def _groups(cls: type) -> list[Field]:
    return [f for f in fields(cls) if "group" in f.metadata]


def _options(cls: type, serve: bool) -> list[Field]:
    """cls's own flags (nested groups left out), those of `serve` or those of a stage."""
    skip = "stage_only" if serve else "serve_only"
    return [f for f in fields(cls) if "group" not in f.metadata and not f.metadata.get(skip)]


def option_classes(classes: tuple[type, ...] | list[type]) -> list[type]:
    """classes and the groups they nest, each once, in order."""
    out: list[type] = []
    for cls in classes:
        for c in (cls, *option_classes([f.metadata["group"] for f in _groups(cls)])):
            if c not in out:
                out.append(c)
    return out


def add_options(parser: argparse.ArgumentParser, classes: tuple[type, ...] | list[type], *,
                serve: bool = False) -> None:
    """The flags of classes (and of the groups they nest, once each), for `serve` or for a
    stage; one argument group per class, titled by its docstring's first line."""
    for cls in option_classes(classes):
        own = _options(cls, serve)
        if not own:
            continue
        section = parser.add_argument_group((cls.__doc__ or cls.__name__).strip().splitlines()[0])
        for f in own:
            meta, default = f.metadata, default_of(f)
            name = (serve and meta["serve_flag"]) or flag_of(f)
            if isinstance(default, bool):
                section.add_argument(name, dest=f.name, default=default, help=meta["help"],
                                     action="store_false" if default else "store_true")
                continue
            parse = meta["parse"] or (type(default) if default is not None and not meta.get("nargs") else str)
            section.add_argument(name, dest=f.name, default=default, type=parse, choices=meta["choices"],
                                 help=meta["help"], **({"nargs": meta["nargs"]} if meta.get("nargs") else {}))


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """The config of class cls from parsed args; a flag missing from them keeps its default
    (a `serve` Namespace has no stage-only fields, a stage's none of `serve`'s)."""
    values = {f.name: getattr(args, f.name, default_of(f)) for f in fields(cls) if "group" not in f.metadata}
    values |= {f.name: tuple(values[f.name]) for f in fields(cls) if f.metadata.get("nargs")}
    values |= {f.name: from_args(f.metadata["group"], args) for f in _groups(cls)}
    return cls(**values)


def to_argv(config: Any) -> list[str]:
    """The flags that give `config` back to a stage's parser built from its class, defaults left out."""
    out: list[str] = []
    for f in _options(type(config), serve=False):
        value = getattr(config, f.name)
        if not f.metadata["forward"] or value == default_of(f) or (f.metadata.get("nargs") and not value):
            continue
        if f.metadata.get("nargs"):
            out += [flag_of(f), *map(str, value)]
            continue
        out += [flag_of(f)] if isinstance(value, bool) else [flag_of(f), str(value)]
    for f in _groups(type(config)):
        out += to_argv(getattr(config, f.name))
    return out


def with_values(config: Any, **values: Any) -> Any:
    """config with some fields replaced, a nested group's fields named as its own."""
    names = {f.name for f in fields(config) if "group" not in f.metadata}
    unknown = set(values) - names - {f.name for c in option_classes([type(config)]) for f in fields(c)}
    if unknown:
        raise TypeError(f"{type(config).__name__} has no option {', '.join(sorted(unknown))}")
    nested = {f.name: with_values(getattr(config, f.name), **{
        k: v for k, v in values.items() if k in {g.name for g in fields(f.metadata["group"])}})
        for f in _groups(type(config))}
    return replace(config, **{k: v for k, v in values.items() if k in names}, **nested)


_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}


def parse_size(text: str | int) -> int:
    """Bytes from '1073741824', '512MiB', '2GiB', '1.5G' (units: k, M, G and Ki, Mi, Gi; B optional)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kKmMgG]i?)?[bB]?\s*", text)
    if not m:
        raise ValueError(f"not a size: {text!r}")
    number, unit = m.group(1), _UNITS[(m.group(2) or "").lower()]
    return int(number) * unit if number.isdigit() else int(float(number) * unit)


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value
