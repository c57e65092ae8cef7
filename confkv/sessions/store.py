"""The object-storage tier for sessions: one store URL, any fsspec backend, faults that never fail a request.

``SessionStore(url)`` keeps two objects per session under its root:

* ``<session_id>.tokens``: the tokens-only object (``record.encode_tokens``): a few KiB, written FIRST, so that a
  put that fails half-way still leaves what recomputation needs;
* ``<session_id>.record``: the full record (``record.encode``), written second.

Backends (``fsspec.core.url_to_fs``):

* a local folder, ``/path`` or ``file:///path`` (``default_url()``: ``$CONFKV_CACHE/sessions``, else
  ``~/.cache/confkv/sessions``, the same cache root as the models);
* ``s3://bucket/prefix`` through ``s3fs``, for any S3-compatible service; endpoint, credentials and region come from
  the usual environment (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
  ``AWS_DEFAULT_REGION``, resolved by botocore) or from ``storage_options`` (``endpoint_url``, ``key``,
  ``secret``, ``client_kwargs={"region_name": ...}``), which win;
* ``memory://prefix`` for tests (fsspec's memory filesystem is one dict per process: give each test its own prefix).

Atomicity, so that no reader ever sees half a record: a local write goes to a hidden temp file in the same folder,
is fsynced, and is renamed over the final name with ``os.replace`` (atomic on POSIX; the folder is fsynced too, so
the rename survives a crash); an S3 object becomes visible only when its PUT completes, so the final key is written
in one ``pipe_file``, as one PUT up to S3's 5 GiB limit (a multipart upload cut off by the deadline would leave its
parts in the bucket: s3fs aborts one on an error, not on a cancellation); the memory filesystem commits a new file
with one dict assignment.

Faults. Every transport failure (connection refused, DNS, TLS, HTTP 5xx, permission, a missing bucket on write) raises
``StoreUnavailable``. On S3, botocore's connect and read (idle socket) timeouts are ``timeout_s`` with one attempt, and
s3fs retries twice, so a refused connection fails in well under a second and a hung endpoint (one that accepts and never
answers) after about ``timeout_s``. Every call also runs under an overall deadline (``asyncio.wait_for`` through
fsspec's ``sync(..., timeout=)``) of ``timeout_s`` plus the bytes it moves over ``min_bytes_per_s``: a live transfer of
a 100 MB record is not cut off at 5 s, and an endpoint that trickles bytes to dodge the idle timeout is still cut off.
The backend's client is built once, before the first call and outside its deadline: building it is local work (CPU time
for botocore's service model) that a loaded machine can stretch past a short ``timeout_s``, and it is not the
store being silent. A read first asks for the object's size (one HEAD request) to set that deadline. A local folder has
no deadline (a local disk does not hang; a hard-mounted NFS folder could, and is not supported as the local store).
Bytes that are not a sound record raise ``CorruptRecord``; a sound record for another model, block size, dtype, format
version or session raises ``ForeignRecord``; an absent one raises ``RecordMissing`` (a miss, not a fault). There is no
"down" state: each call tries the backend again, so a store that comes back is used again without a restart.

Counters (``stats()``) are monotonic, for the server's ``/metrics``. Each fault is logged once, here, and the
caller should not log it again: corrupt and foreign records at WARNING each time (each one is a distinct bad
object); unavailability at WARNING when the store goes from answering to not answering, at DEBUG while it stays
down, and at INFO when it answers again, so an outage is two lines, not one per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

import fsspec
from fsspec.asyn import AsyncFileSystem, sync
from fsspec.implementations.local import LocalFileSystem

from confkv.config import cache_root
from confkv.errors import ConfkvError
from confkv.sessions.errors import CorruptRecord, ForeignRecord, RecordMissing, SessionStoreError, StoreUnavailable
from confkv.sessions.record import DEFAULT_LEVEL, SessionRecord, SessionTokens, decode, decode_tokens, encode
from confkv.sessions.record import encode_tokens as encode_tokens_object

log = logging.getLogger(__name__)

#: Session ids become object names: letters, digits, ``.``, ``_``, ``-``, not starting with a dot (temp files do).
SESSION_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
TOKENS_SUFFIX = ".tokens"
RECORD_SUFFIX = ".record"
#: fault kinds counted in ``stats()["faults"]`` (a missing record is a miss, counted in ``misses``).
FAULT_KINDS: tuple[str, ...] = ("unavailable", "corrupt", "foreign", "error")
#: s3fs sends one PUT below twice its chunk size, up to S3's 5 GiB limit for one: every record is one PUT.
S3_SINGLE_PUT_BYTES = 5 * 2**30
_COUNTERS: tuple[str, ...] = (
    "puts", "gets", "token_gets", "misses", "deletes", "bytes_written", "bytes_read", "tokens_repaired",
)  # fmt: skip
_Obj = TypeVar("_Obj", SessionRecord, SessionTokens)


def default_url(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """``<cache root>/sessions`` (``confkv.config.cache_root``)."""
    return str(cache_root(cache_dir).expanduser() / "sessions")


def check_session_id(session_id: str) -> str:
    """``session_id`` if it can name an object, else ``ConfkvError`` (a user error: the server answers 400)."""
    if not isinstance(session_id, str) or not SESSION_ID_RE.fullmatch(session_id):
        raise ConfkvError(
            f"session_id {session_id!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit",
            param="session_id",
        )
    return session_id


class SessionStore:
    """Session records in object storage (see the module docstring). Thread-safe: calls may come from any thread.

    ``put``/``get`` encode and decode in the calling thread (about one zstd pass over the KV): call them off the
    engine thread.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        storage_options: Mapping[str, Any] | None = None,
        timeout_s: float = 5.0,
        min_bytes_per_s: float = 8 << 20,
        level: int = DEFAULT_LEVEL,
    ) -> None:
        """``url``: a folder, ``file://``, ``s3://bucket/prefix`` or ``memory://prefix``. ``storage_options`` go to
        the fsspec backend (for S3: ``endpoint_url``, ``key``, ``secret``, ``client_kwargs``, ``config_kwargs``).
        ``timeout_s``: how long a remote store may stay silent; ``min_bytes_per_s``: the slowest transfer accepted
        (see the module docstring). ``level``: zstd level. A bad URL or a missing backend package raises
        ``ConfkvError``; nothing is contacted here, so a store that is down at start-up does not stop the server."""
        self.url = str(url)
        self.timeout_s = float(timeout_s)
        self.min_bytes_per_s = float(min_bytes_per_s)
        self.level = level
        protocol = fsspec.core.split_protocol(self.url)[0] or "file"
        options = _options(protocol, dict(storage_options or {}), self.timeout_s)
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url, **options)
        except (ImportError, ValueError, TypeError) as err:
            raise ConfkvError(f"session store {self.url!r}: {err}") from err
        self._put_options: dict[str, Any] = {}
        if protocol in ("s3", "s3a"):
            # s3fs retries transport errors 5 times with backoff on top of botocore's own retries; the deadline
            # bounds it anyway, but a refused connection should fail fast rather than spend the whole timeout.
            self.fs.retries = 2
            self._put_options = {"chunksize": S3_SINGLE_PUT_BYTES}
        self.root = root.rstrip("/")
        self._local = isinstance(self.fs, LocalFileSystem)
        self._remote = isinstance(self.fs, AsyncFileSystem)  # s3fs (and any other async backend): deadlines apply
        self._lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._faults: dict[str, int] = dict.fromkeys(FAULT_KINDS, 0)
        self._down = False  # only for logging transitions: never gates a call
        self._client_ready = not self._remote

    def __repr__(self) -> str:
        return f"SessionStore({self.url!r}, timeout_s={self.timeout_s:g})"

    # ------------------------------------------------------------------------------------------------ public API

    def put(self, record: SessionRecord) -> int:
        """Write the tokens object, then the full record; return the bytes written (both objects).

        If the second write fails, the tokens object is already there (newer than any older record, which stays
        readable and consistent in itself). ``ValueError`` for an inconsistent record (a bug, not counted).
        """
        sid = check_session_id(record.session_id)
        with self._counting_faults(sid):
            written = self._write(self._key(sid, TOKENS_SUFFIX), encode_tokens_object(record, level=self.level))
            written += self._write(self._key(sid, RECORD_SUFFIX), encode(record, level=self.level))
        self._bump(puts=1)
        return written

    def get(self, session_id: str, *, expect: Mapping[str, Any]) -> SessionRecord:
        """The verified record of ``session_id``; ``expect`` names what it must be for (``model_fingerprint``,
        ``block_size``, ``dtype``; see ``record.decode``). Raises ``RecordMissing``, ``StoreUnavailable``,
        ``CorruptRecord`` or ``ForeignRecord``."""
        sid = check_session_id(session_id)
        with self._counting_faults(sid):
            record = self._load(sid, RECORD_SUFFIX, decode, expect)
        self._bump(gets=1)
        self._check_tokens(sid, record)
        return record

    def _check_tokens(self, sid: str, record: SessionRecord) -> None:
        """The tokens object beside a sound record is what expiry reads and what recomputation falls back on, so an
        unreadable one (corrupt, another session's) or a missing one is counted as a corrupt fault and written again
        from the record (a few KiB). A readable one that disagrees with the record is left alone: ``put`` writes the
        tokens first, so that is a put in flight or one whose second write failed, and the tokens are the newer.
        A missing one counts only while the record is still there: ``delete`` removes the record first, so otherwise
        it is a delete in flight. A store that does not answer now is left for the next read."""
        try:
            self._load(sid, TOKENS_SUFFIX, decode_tokens, None)
            return
        except StoreUnavailable:
            return
        except RecordMissing:
            try:
                self._op("info", self._key(sid, RECORD_SUFFIX))
            except (FileNotFoundError, StoreUnavailable):
                return
        except SessionStoreError:
            pass
        self._fault(CorruptRecord("the tokens object beside the record is unreadable or missing; written again"), sid)
        self._bump(tokens_repaired=1)
        try:
            self._write(self._key(sid, TOKENS_SUFFIX), encode_tokens_object(record, level=self.level))
        except SessionStoreError as err:
            log.warning("session store %s: could not rewrite the tokens of %s: %s", self.url, sid, err)

    def read_tokens(self, session_id: str, *, expect: Mapping[str, Any] | None = None) -> SessionTokens | None:
        """The tokens-only object (ids, fingerprint, ``updated_at`` for expiry), or None when there is none.

        Raises ``StoreUnavailable``, ``CorruptRecord`` or ``ForeignRecord`` (with ``expect``, e.g. only the
        ``model_fingerprint``: token ids mean nothing under another tokenizer).
        """
        sid = check_session_id(session_id)
        try:
            with self._counting_faults(sid):
                tokens = self._load(sid, TOKENS_SUFFIX, decode_tokens, expect)
        except RecordMissing:  # counted as a miss
            return None
        self._bump(token_gets=1)
        return tokens

    def get_tokens(self, session_id: str, *, expect: Mapping[str, Any] | None = None) -> list[int] | None:
        """The session's token ids alone (what recomputation needs), or None; see ``read_tokens``."""
        tokens = self.read_tokens(session_id, expect=expect)
        return None if tokens is None else tokens.token_ids

    def delete(self, session_id: str) -> bool:
        """Remove both objects; True if the session existed. Deleting an absent session is not an error."""
        sid = check_session_id(session_id)
        with self._counting_faults(sid):
            existed = self._exists(sid)
            for suffix in (RECORD_SUFFIX, TOKENS_SUFFIX):  # the KV first: it is the bulk, and the tokens suffice alone
                with contextlib.suppress(FileNotFoundError):
                    self._op("rm_file", self._key(sid, suffix))
        if existed:
            self._bump(deletes=1)
        return existed

    def exists(self, session_id: str) -> bool:
        """Whether either object of the session is stored. Raises ``StoreUnavailable``."""
        sid = check_session_id(session_id)
        with self._counting_faults(sid):
            return self._exists(sid)

    def list_sessions(self) -> list[str]:
        """Ids of the sessions stored under the root, sorted. Raises ``StoreUnavailable``."""
        try:
            with self._counting_faults(None):
                names = self._op("ls", self.root, detail=False)
        except FileNotFoundError:
            return []
        ids = set()
        for name in names:
            base = str(name).rstrip("/").rsplit("/", 1)[-1]
            for suffix in (TOKENS_SUFFIX, RECORD_SUFFIX):
                if base.endswith(suffix) and SESSION_ID_RE.fullmatch(base[: -len(suffix)]):
                    ids.add(base[: -len(suffix)])
        return sorted(ids)

    def stats(self) -> dict[str, Any]:
        """A snapshot of the monotonic counters: ``puts``, ``gets``, ``token_gets``, ``misses``, ``deletes``,
        ``bytes_written``, ``bytes_read``, ``faults`` ({kind: count} for ``FAULT_KINDS``), and ``reachable`` (a gauge:
        whether the last call got an answer)."""
        with self._lock:
            return {**self._counts, "faults": dict(self._faults), "reachable": not self._down}

    # ------------------------------------------------------------------------------------------------ internals

    def _key(self, session_id: str, suffix: str) -> str:
        return f"{self.root}/{session_id}{suffix}"

    @contextlib.contextmanager
    def _counting_faults(self, sid: str | None) -> Iterator[None]:
        """Count and log a ``SessionStoreError`` raised in the block (``_fault``), then let it go on to the caller."""
        try:
            yield
        except SessionStoreError as err:
            self._fault(err, sid)
            raise

    def _load(self, sid: str, suffix: str, decoder: Callable[..., _Obj], expect: Mapping[str, Any] | None) -> _Obj:
        """Read and decode one of ``sid``'s objects; ``ForeignRecord`` when it is another session's."""
        obj = decoder(self._read(self._key(sid, suffix), sid), expect=expect)
        if obj.session_id != sid:
            what = f"the record under {sid!r} is" if suffix == RECORD_SUFFIX else f"the tokens under {sid!r} are"
            raise ForeignRecord(f"{what} session {obj.session_id!r}'s", session_id=sid)
        return obj

    def _exists(self, sid: str) -> bool:
        for suffix in (TOKENS_SUFFIX, RECORD_SUFFIX):
            try:
                self._op("info", self._key(sid, suffix))
                return True
            except FileNotFoundError:
                continue
        return False

    def _read(self, path: str, sid: str) -> bytes:
        try:
            size = int(self._op("info", path).get("size") or 0) if self._remote else 0
            data = self._op("cat_file", path, nbytes=size)
        except FileNotFoundError:
            raise RecordMissing(f"no {path.rsplit('.', 1)[-1]} object for session {sid!r}", session_id=sid) from None
        self._bump(bytes_read=len(data))
        return data

    def _write(self, path: str, data: bytes) -> int:
        try:
            if self._local:
                self._op("atomic_write", path, data)
            else:
                self._op("pipe_file", path, data, nbytes=len(data), **self._put_options)
        except FileNotFoundError as err:  # a missing bucket: the store cannot take writes
            raise StoreUnavailable(f"cannot write {path}: {err}") from err
        self._bump(bytes_written=len(data))
        return len(data)

    def _op(self, name: str, path: str, *args: Any, nbytes: int = 0, **kwargs: Any) -> Any:
        """One backend call, under a deadline that allows ``nbytes`` to move. ``FileNotFoundError`` passes through
        (the store answered: "no"); every other failure becomes ``StoreUnavailable``."""
        fs = self.fs
        self._build_client()
        deadline = self.timeout_s + nbytes / self.min_bytes_per_s
        try:
            if name == "atomic_write":
                result = _atomic_local_write(path, *args)
            elif self._remote:
                result = sync(fs.loop, getattr(fs, f"_{name}"), path, *args, timeout=deadline, **kwargs)
            else:
                result = getattr(fs, name)(path, *args, **kwargs)
        except FileNotFoundError:
            self._answered()
            raise
        except (TimeoutError, asyncio.TimeoutError) as err:  # fsspec's FSTimeoutError is an asyncio.TimeoutError
            raise StoreUnavailable(f"{name} {path}: not done within {deadline:.3g} s") from err
        except Exception as err:  # any transport error: botocore, aiohttp, OSError, HTTP status
            raise StoreUnavailable(f"{name} {path}: {type(err).__name__}: {err}") from err
        self._answered()
        return result

    def _build_client(self) -> None:
        """Build an async backend's client (s3fs: ``set_session``) under a deadline of its own. It is bounded too,
        since botocore's default credential chain may ask an instance-metadata endpoint."""
        if self._client_ready:
            return
        connect = getattr(self.fs, "set_session", None)
        if connect is not None:
            limit = max(10.0, 2 * self.timeout_s)
            try:
                sync(self.fs.loop, connect, timeout=limit)
            except (TimeoutError, asyncio.TimeoutError) as err:
                raise StoreUnavailable(f"{self.url}: client not built within {limit:.3g} s") from err
            except Exception as err:
                raise StoreUnavailable(f"{self.url}: cannot build the client: {type(err).__name__}: {err}") from err
        self._client_ready = True

    def _answered(self) -> None:
        with self._lock:
            was_down, self._down = self._down, False
        if was_down:
            log.info("session store %s answers again", self.url)

    def _fault(self, err: SessionStoreError, sid: str | None) -> None:
        """Count and log ``err`` (once, here); the public method then re-raises it."""
        if err.session_id is None:
            err.session_id = sid
        if isinstance(err, RecordMissing):
            self._bump(misses=1)
            return
        with self._lock:
            self._faults[err.kind] = self._faults.get(err.kind, 0) + 1
            first = not self._down if isinstance(err, StoreUnavailable) else True
            if isinstance(err, StoreUnavailable):
                self._down = True
        level = logging.WARNING if first else logging.DEBUG
        log.log(level, "session store %s: %s (session %s): %s", self.url, err.kind, sid, err)

    def _bump(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] += delta


def _options(protocol: str, user: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Backend options: for S3, timeouts and retries bounded by ``timeout_s``, and no caches that could hide an
    object written by another server; the user's options win, ``config_kwargs`` merged key by key."""
    if protocol not in ("s3", "s3a"):
        return user
    config = {"connect_timeout": timeout_s, "read_timeout": timeout_s, "retries": {"max_attempts": 1}}
    merged: dict[str, Any] = {"skip_instance_cache": True, "use_listings_cache": False, **user}
    merged["config_kwargs"] = {**config, **user.get("config_kwargs", {})}
    return merged


def _atomic_local_write(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader sees the old file or the new one, never a part: a hidden temp file
    in the same folder (same filesystem, so the rename is atomic), fsync, ``os.replace``, fsync of the folder."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
