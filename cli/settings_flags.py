"""Command-line flags made from the settings structs' fields, and parsed flags made back into them.

One declaration per option: a field `x: Annotated[T, Flag(help)] = default` of a settings struct
(a frozen dataclass or a msgspec Struct; pdserve/flag.py) is the flag `--x`, and `from_flags`
reads it back into the struct. Field -> flag:
- name: `--x-y` for `x_y`, or `Flag.name`; the parsed value sits at argparse's dest for it
- value: `T` (None stripped from an Optional): int and float convert, a Literal's values (or
  `Flag.choices`) are the choices, `Flag.parse` converts where the type cannot (its ValueError is
  the usage error's message)
- bool: default False: `--x` sets it; default True: `--x / --no-x`; named `--no-x`: clears it
- list[T]: repeatable (`--x A --x B`), required when the field has no default
- default: the field's; None on the command line when `Flag.planned` or the field has none (the
  caller fills the value in: cli/topology.py plans it, or resolve_model finds the model)
- a field without `Flag` whose type is a settings struct: its fields' flags, in a group named
  after the field
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Annotated, Any, Literal, TypeVar, cast, get_args, get_origin, get_type_hints

import msgspec

from pdserve.flag import Flag

S = TypeVar("S")
NO_DEFAULT: Any = dataclasses.MISSING


@dataclasses.dataclass(frozen=True)
class SettingsField:
    name: str
    kind: Any  # the field's type, Annotated stripped
    default: Any  # NO_DEFAULT: none
    flag: Flag | None

    @property
    def option(self) -> str:
        assert self.flag is not None
        return self.flag.name or "--" + self.name.replace("_", "-")

    @property
    def dest(self) -> str:
        return self.option.removeprefix("--").replace("-", "_")

    @property
    def clears(self) -> bool:
        """A `--no-x` flag that turns a default-True bool off."""
        return self.kind is bool and self.option.startswith("--no-")


def is_settings(kind: Any) -> bool:
    return isinstance(kind, type) and (dataclasses.is_dataclass(kind) or issubclass(kind, msgspec.Struct))


def settings_fields(cls: type) -> list[SettingsField]:
    hints = get_type_hints(cls, include_extras=True)
    if dataclasses.is_dataclass(cls):
        raw = [(f.name, f.default, f.default_factory) for f in dataclasses.fields(cls)]
    else:
        raw = [
            (f.name, _missing(f.default), _missing(f.default_factory))
            for f in msgspec.structs.fields(cast(type[msgspec.Struct], cls))
        ]
    out = []
    for name, default, factory in raw:
        kind, flag = hints[name], None
        if get_origin(kind) is Annotated:
            kind, *extras = get_args(kind)
            flag = next((e for e in extras if isinstance(e, Flag)), None)
        if default is NO_DEFAULT and factory is not NO_DEFAULT:
            default = cast(Callable[[], Any], factory)()
        out.append(SettingsField(name, kind, default, flag))
    return out


def flag_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, SettingsField]]:
    """(dotted path, field) of every flag of `cls`, nested structs' included."""
    for f in settings_fields(cls):
        if f.flag is not None:
            yield prefix + f.name, f
        elif is_settings(f.kind):
            yield from flag_fields(f.kind, f"{prefix}{f.name}.")


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    title: str | None = None,
    *,
    only: Collection[str] | None = None,
    skip: Collection[str] = (),
) -> None:
    """`cls`'s flags on `parser` (in group `title`, else nested structs' in a group each);
    `only` / `skip`: dotted field paths."""
    groups: dict[str | None, Any] = {None: parser}
    for path, f in flag_fields(cls):
        if (only is not None and path not in only) or path in skip:
            continue
        group = title or (path.split(".")[0] if "." in path else None)
        if group not in groups:
            groups[group] = parser.add_argument_group(group)
        groups[group].add_argument(f.option, **_argument(f))


def from_flags(cls: type[S], args: argparse.Namespace, given: Mapping[str, Any] | None = None) -> S:
    """`cls` from parsed flags: each flag field from its flag, a nested struct from its own flags.
    `given` (a field name, or a dotted path into a nested struct) wins; a field whose flag this
    parser lacks, or whose planned flag was left out, keeps its default. Values are found by dest,
    so where one parser holds several structs' flags (serve), structs sharing a flag name
    (--max-model-len, --otlp-traces-endpoint) share its value."""
    given = dict(given or {})
    values: dict[str, Any] = {}
    for f in settings_fields(cls):
        if f.name in given:
            values[f.name] = given.pop(f.name)
        elif f.flag is None and is_settings(f.kind):
            inner = {k.split(".", 1)[1]: given.pop(k) for k in list(given) if k.startswith(f.name + ".")}
            values[f.name] = from_flags(f.kind, args, inner)
        elif f.flag is not None and hasattr(args, f.dest):
            value = getattr(args, f.dest)
            if f.clears:
                values[f.name] = not value
            elif value is not None or _optional(f.kind)[1]:
                values[f.name] = value
    if given:
        raise TypeError(f"{cls.__name__} has no fields {sorted(given)}")
    return cast(Any, cls)(**values)


def _argument(f: SettingsField) -> dict[str, Any]:
    """add_argument's keywords for a flag field."""
    assert f.flag is not None
    kind = _optional(f.kind)[0]
    kw: dict[str, Any] = {"help": f.flag.help}
    if f.flag.metavar:
        kw["metavar"] = f.flag.metavar
    if kind is bool:
        if f.clears or f.default is False:
            assert f.default in (True, False)
            return {**kw, "action": "store_true"}
        return {**kw, "action": argparse.BooleanOptionalAction, "default": True}
    if get_origin(kind) is list:
        (kind,) = get_args(kind)
        kw.update(action="append", required=f.default is NO_DEFAULT)
    else:
        kw["default"] = None if f.flag.planned or f.default is NO_DEFAULT else f.default
    if get_origin(kind) is Literal:
        kw["choices"] = get_args(kind)
    elif f.flag.choices is not None:
        kw["choices"] = tuple(f.flag.choices)
    if f.flag.parse is not None:
        kw["type"] = _usage_errors(f.flag.parse)
    elif kind in (int, float):
        kw["type"] = kind
    return kw


def _usage_errors(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` with its ValueError's message as argparse's usage error."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _optional(kind: Any) -> tuple[Any, bool]:
    """(`kind` without None, whether None is allowed)."""
    if get_origin(kind) in (types.UnionType, typing.Union) and type(None) in get_args(kind):
        (rest,) = [a for a in get_args(kind) if a is not type(None)]
        return rest, True
    return kind, False


def _missing(value: Any) -> Any:
    return NO_DEFAULT if value is msgspec.NODEFAULT else value
