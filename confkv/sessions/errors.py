"""What can go wrong between a session and its object store, as four kinds the caller treats alike.

Every one of these means "the stored KV cannot be used": the caller falls back to recomputing the session from its
token ids (which it keeps in memory) and counts the fault by ``kind``. None of them is the user's fault, so they do
not derive from ``ConfkvError`` (which the server maps to HTTP 4xx): a request never fails because the store did.
"""

from __future__ import annotations


class SessionStoreError(Exception):
    """Base of every store fault. ``kind`` is the label the metrics count it under."""

    kind: str = "error"

    def __init__(self, message: str, *, session_id: str | None = None) -> None:
        super().__init__(message)
        self.session_id = session_id


class StoreUnavailable(SessionStoreError):
    """The store could not be reached or did not answer within ``timeout_s`` (refused, timed out, transport error).

    Transient by nature: the next call tries again, so a store that comes back is used again without a restart.
    """

    kind = "unavailable"


class CorruptRecord(SessionStoreError):
    """The bytes are not a record: truncated, a checksum that does not match, or undecodable."""

    kind = "corrupt"


class ForeignRecord(SessionStoreError):
    """A sound record that is not for us: another model fingerprint, block size, KV dtype, format version, or session.

    Its KV would be wrong here (another model's keys, another block geometry), so it must never be restored.
    """

    kind = "foreign"


class RecordMissing(SessionStoreError):
    """No record under that session id (never written, deleted, or expired). Not a fault: a miss."""

    kind = "missing"
