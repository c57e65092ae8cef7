"""Errors that reach the user.

Everything the user can get wrong (a model that cannot be found, a bad policy value, an empty prompt) raises
``ConfkvError`` with a message that names the thing to fix; the CLI prints it without a traceback and exits non-zero,
and the server maps it to an HTTP 4xx. ``param`` names the request field or setting at fault (OpenAI's ``param``), so
the server never has to guess it from the message text.
"""

from __future__ import annotations


class ConfkvError(ValueError):
    """A user-facing error: bad input or configuration, never an internal bug."""

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFoundError(ConfkvError):
    """The requested model name or folder cannot be resolved locally (nothing is ever fetched from a hub)."""


class UnsupportedModelError(ConfkvError):
    """The model does something in attention that confkv does not implement; refused at load, never run wrong."""


class SessionBusy(ConfkvError):
    """A turn for a session that already has a request running: a second turn cannot extend a conversation whose
    previous answer is not written yet, so the client sends one turn at a time (the server answers 409)."""
