"""Sessions: a conversation's KV state kept across requests, down to object storage.

``record`` is the versioned, checksummed, compressed encoding of one session; ``store`` keeps records in a local
folder, S3 or memory through fsspec, with faults that fall back to recomputation instead of failing a request.
"""

from confkv.sessions.errors import CorruptRecord, ForeignRecord, RecordMissing, SessionStoreError, StoreUnavailable
from confkv.sessions.record import (
    FORMAT_VERSION,
    BlockKV,
    SessionRecord,
    SessionTokens,
    decode,
    decode_tokens,
    dtype_name,
    encode,
    encode_tokens,
    model_fingerprint,
    read_header,
)
from confkv.sessions.store import FAULT_KINDS, SessionStore, check_session_id, default_url

__all__ = [
    "FAULT_KINDS",
    "FORMAT_VERSION",
    "BlockKV",
    "CorruptRecord",
    "ForeignRecord",
    "RecordMissing",
    "SessionRecord",
    "SessionStore",
    "SessionStoreError",
    "SessionTokens",
    "StoreUnavailable",
    "check_session_id",
    "decode",
    "decode_tokens",
    "default_url",
    "dtype_name",
    "encode",
    "encode_tokens",
    "model_fingerprint",
    "read_header",
]
