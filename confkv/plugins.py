"""Name tables the policy layer fills: block scorers and budget rules (controllers), each registered by name.

The policy layer sits above the configuration, yet a policy must be refused where it is read when it names a scorer
or controller that does not exist. So the tables live here, at the ground: each scorer or controller class adds
itself with ``@SCORERS.register`` / ``@CONTROLLERS.register`` when its module is imported, ``confkv.config``
validates names against the tables, and the factories look classes up in them without importing any subclass.

A table loads the package that registers the built-in ones (``confkv.scorers``, ``confkv.controllers``) the first
time it is read, by name, as an entry-point group would: whatever is imported first, a policy read anywhere is
checked against every built-in name, and this module depends on nothing above it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

T = TypeVar("T", bound=type)


class Registry(Mapping[str, Any]):
    """Classes by their ``name`` attribute, in registration order."""

    def __init__(self, kind: str, builtins: str) -> None:
        self.kind = kind
        self._builtins = builtins  # the package whose import registers the built-in classes
        self._classes: dict[str, Any] = {}
        self._loaded = False

    def register(self, cls: T) -> T:
        """Class decorator: make ``cls`` available under ``cls.name``."""
        name = cls.name  # type: ignore[attr-defined]
        if name in self._classes:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._classes[name] = cls
        return cls

    def _load(self) -> dict[str, Any]:
        if not self._loaded:
            self._loaded = True  # first: the package's own imports read the table while it registers
            importlib.import_module(self._builtins)
        return self._classes

    def __getitem__(self, name: str) -> Any:
        return self._load()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())

    def names(self) -> tuple[str, ...]:
        return tuple(self)

    def lookup(self, name: str) -> Any:
        """The class registered as ``name``; a ``ValueError`` that lists the known names otherwise."""
        try:
            return self[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {', '.join(self)}") from None


SCORERS = Registry("scorer", "confkv.scorers")
CONTROLLERS = Registry("controller", "confkv.controllers")
