"""Name tables the policy layer fills: block scorers and budget rules (controllers), each registered by name.

The policy layer sits above the configuration, yet a policy must be refused where it is read when it names a scorer
or controller that does not exist. So the tables live here, at the ground: each scorer or controller class adds
itself with ``@SCORERS.register`` / ``@CONTROLLERS.register`` when its module is imported, ``confkv.config``
validates names against the tables, and the factories look classes up in them without importing any subclass.
Importing the ``confkv`` package imports every built-in one (``confkv.scorers`` and ``confkv.controllers``).
"""

from __future__ import annotations

from typing import Any, TypeVar

T = TypeVar("T", bound=type)


class Registry(dict[str, Any]):
    """Classes by their ``name`` attribute, in registration order."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, cls: T) -> T:
        """Class decorator: make ``cls`` available under ``cls.name``."""
        name = cls.name  # type: ignore[attr-defined]
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self[name] = cls
        return cls

    def names(self) -> tuple[str, ...]:
        return tuple(self)

    def lookup(self, name: str) -> Any:
        """The class registered as ``name``; a ``ValueError`` that lists the known names otherwise."""
        try:
            return self[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {', '.join(self)}") from None


SCORERS = Registry("scorer")
CONTROLLERS = Registry("controller")
