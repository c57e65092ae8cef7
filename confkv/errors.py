"""Errors that reach the user.

Everything the user can get wrong (a model that cannot be found, a bad policy value, an empty prompt) raises
``ConfkvError`` with a message that names the thing to fix; the CLI prints it without a traceback and exits non-zero,
and the server maps it to an HTTP 4xx.
"""


class ConfkvError(ValueError):
    """A user-facing error: bad input or configuration, never an internal bug."""


class ModelNotFoundError(ConfkvError):
    """The requested model name or folder cannot be resolved locally (nothing is ever fetched from a hub)."""


class UnsupportedModelError(ConfkvError):
    """The model does something in attention that confkv does not implement; refused at load, never run wrong."""
