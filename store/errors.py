"""Registry errors. All are ``ConfkvError`` (user-facing, no traceback); two kinds get their own exit status.

``confkv-tune`` exits with 1 when the registry refuses an operation on valid input (``NotFoundError``: the named
policy, version or alias does not exist; ``PromotionRefused``: the gate found the candidate worse, or the alias
moved while it was checked) and with 2 for malformed input, like every other confkv command.
"""

from __future__ import annotations

from confkv.errors import ConfkvError


class RegistryError(ConfkvError):
    """Anything the registry cannot do: an unreachable database, a bad name, a broken artifact."""


class NotFoundError(RegistryError):
    """A policy, version or alias that the registry does not hold."""


class PromotionRefused(RegistryError):
    """A promotion that the gate (or a concurrent move of the same alias) refused."""


class ArtifactError(RegistryError):
    """A version whose artifact fails its checksum or does not load as a policy."""


class ArtifactUnavailable(ArtifactError):
    """An artifact that could not be read at its URI (storage unreachable, credentials, a missing object): the
    version may be fine, so a watcher tries it again rather than refusing it for good."""
