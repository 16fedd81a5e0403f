"""What every tool-call parser shares: a model's output text -> the text outside its calls and
the calls, for a whole output or for one still being generated.

A parser says where a call region may start (`find_start`) and what one holds (`read_region`);
`scan` walks the text. Scanning a prefix of an output never says more than scanning the whole
would: content and each call's arguments only grow, a call is listed once its name is known.
So a stream can send the difference between two scans (stream.py), and what it sent adds up
to what `parse` finds in the whole output. Whitespace next to a call is markup, not content.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pdserve.gateway.tools.request import Function


@dataclass(frozen=True)
class CallSoFar:
    name: str
    arguments: str  # JSON text (the raw arguments so far while the call is being written)


@dataclass(frozen=True)
class Parsed:
    content: str  # the text outside the calls
    calls: list[CallSoFar] = field(default_factory=list)


@dataclass(frozen=True)
class Region:
    """What a call region holds: `calls`; `text` when it turned out to be no call (it is
    content); `open` when that is not known yet (only while the output is unfinished)."""

    verdict: Literal["calls", "text", "open"]
    calls: list[CallSoFar] = field(default_factory=list)
    end: int | None = None  # where the text after the region starts; None: it runs to the end


class ToolParser(ABC):
    name: ClassVar[str]  # --tool-call-parser's value (vLLM's names)
    # the format's markers: where a tokenizer holds one as a special token, the detokenizer keeps
    # it in the text of a request with tools (gateway/detokenizer.py), so `auto` can see it
    markers: ClassVar[tuple[str, ...]] = ()

    @abstractmethod
    def find_start(self, text: str, pos: int) -> int | None:
        """Where the next call region starts at or after `pos`, None if none does (yet)."""

    @abstractmethod
    def held_back(self, tail: str, at_start: bool) -> int:
        """How many characters at the end of `tail` (text after the last region; `at_start`:
        nothing precedes it) may still become the start of a region: withheld while generating."""

    @abstractmethod
    def read_region(self, text: str, start: int, final: bool) -> Region:
        """The region starting at `start`; `final`: the output is complete."""

    @abstractmethod
    def grammar(self, functions: list[Function], parallel: bool) -> str:
        """An llguidance Lark grammar of one call (or several, if `parallel`) of one of
        `functions` in this parser's format, each call's arguments bound to its JSON schema."""

    def parse(self, text: str) -> Parsed:
        """A whole output."""
        return self.scan(text, final=True)

    def scan(self, text: str, final: bool) -> Parsed:
        """The output so far (`final`: all of it)."""
        content: list[str] = []
        calls: list[CallSoFar] = []
        pos, after_call = 0, False
        while True:
            start = self.find_start(text, pos)
            if start is None:
                tail = text[pos:]
                if not final:
                    tail = tail[: len(tail) - self.held_back(tail, pos == 0)].rstrip()
                content.append(tail.lstrip() if after_call else tail)
                break
            region = self.read_region(text, start, final)
            if region.verdict == "text":  # no call after all: it is content like the text before it
                end = len(text) if region.end is None else region.end
                piece = text[pos:end]
                piece = piece.lstrip() if after_call else piece
                if region.end is None:
                    content.append(piece if final else piece.rstrip())
                    break
                content.append(piece)
                pos, after_call = end, False
                continue
            before = text[pos:start].rstrip()
            content.append(before.lstrip() if after_call else before)
            if region.verdict == "open":
                break
            calls.extend(region.calls)
            if region.end is None:
                break
            pos, after_call = region.end, True
        return Parsed("".join(content), calls)


def suffix_prefix_len(tail: str, marker: str) -> int:
    """Length of the longest end of `tail` that is a proper beginning of `marker`."""
    for k in range(min(len(tail), len(marker) - 1), 0, -1):
        if marker.startswith(tail[-k:]):
            return k
    return 0
