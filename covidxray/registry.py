"""Name -> entry tables for what a config or the command line picks by name: sources, models, tasks, export formats.

Contract: a name is registered once (a second registration is a programming
error and raises at import time, instead of silently replacing the first);
`get` of an unknown name raises a UserError that lists the known ones; every
entry carries a one-line description, which `covidxray sources|models|tasks|
formats` print and the CLI's help texts are built from.
Imports nothing but covidxray.errors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from covidxray.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str, error: type[UserError] = UserError):
        """`kind` names an entry in messages ("source", "model"); `error` is what an unknown name raises."""
        self.kind, self.error = kind, error
        self._entries: dict[str, tuple[T, str]] = {}

    def add(self, name: str, entry: T, description: str) -> T:
        if not name:
            raise ValueError(f"a {self.kind} needs a name")
        if name in self._entries:
            raise ValueError(
                f"{self.kind} {name!r} is registered twice (by {self._entries[name][0]!r} and {entry!r}): pick another name"
            )
        self._entries[name] = (entry, " ".join(description.split()))
        return entry

    def register(self, name: str, description: str) -> Callable[[T], T]:
        """Decorator form of `add`."""
        return lambda entry: self.add(name, entry, description)

    def get(self, name: str) -> T:
        try:
            return self._entries[name][0]
        except KeyError:
            raise self.error(f"unknown {self.kind} {name!r}; available: {', '.join(self.names())}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def describe(self, name: str) -> str:
        return self._entries[name][1]

    def listing(self) -> list[str]:
        """One line per entry, `name  description`, sorted by name."""
        width = max((len(n) for n in self._entries), default=0)
        return [f"{name:{width}s}  {self.describe(name)}" for name in self.names()]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)


def first_line(text: str | None) -> str:
    """A docstring's summary line, the usual description of a registered class or function."""
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""
