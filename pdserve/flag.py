"""`Flag`: the mark that makes a settings field a command-line flag, next to the field; and the
parsers of flag text that a type alone does not give (sizes, positive numbers).

    lease_ttl_s: Annotated[float, Flag("seconds a KV lease stays valid", name="--lease-ttl")] = 30.0

The flag's name, type, choices and default come from the field (cli/settings_flags.py makes the
argparse flag and turns the parsed flags back into the struct); `Flag` adds what the field
cannot say. It imports nothing, so every layer's settings may use it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Flag:
    help: str | None = None
    name: str | None = None  # the flag when not --field-name (a bool's "--no-X" turns the field off)
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None  # text -> value where the type alone cannot (sizes, JSON)
    choices: Sequence[str] | None = None  # for a str field (a Literal field's choices are its values)
    # the command line's default is None: the caller plans the value (cli/topology.py) when not given
    planned: bool = False


def parse_size(text: str) -> int:
    """'512MiB', '2GiB', '1G', '100000' -> bytes."""
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"must be > 0 (got {text})")
    return value
