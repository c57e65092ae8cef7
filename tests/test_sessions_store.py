"""The object store holding session records, on memory://, a local folder and a real S3 API.

The S3 API is moto's standalone server (``moto.server.ThreadedMotoServer``) on a free loopback port, reached through
s3fs over HTTP exactly as a production S3-compatible service would be. Moto keeps its objects in this process, so a
server stopped and started again on the same port still holds them: an outage, not a wipe. The record format itself
is tested in test_session_record.py.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from confkv.errors import ConfkvError
from confkv.sessions import (
    BlockKV,
    CorruptRecord,
    ForeignRecord,
    RecordMissing,
    SessionRecord,
    SessionStore,
    StoreUnavailable,
    decode,
    encode,
    read_header,
)
from tests.session_records import EXPECT, FP, assert_same, make_record

# ------------------------------------------------------------------------------------------------ S3 through moto


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Moto:
    """A moto S3 server on a loopback port that can be stopped and started again on the same port."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self.port = _free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._new = lambda: ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server = self._new()
        self.server.start()

    def stop(self) -> None:
        self.server.stop()

    def restart(self) -> None:
        self.server = self._new()
        self.server.start()

    def bucket(self) -> str:
        import boto3

        name = f"sessions-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1").create_bucket(Bucket=name)
        return name

    def options(self) -> dict[str, object]:
        return {"endpoint_url": self.endpoint, "key": "testing", "secret": "testing"}


@pytest.fixture(autouse=True)
def _no_real_aws(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Fake credentials and no AWS config files: nothing here can reach a real account."""
    for name in ("AWS_ENDPOINT_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))


@pytest.fixture
def moto() -> Iterator[Moto]:
    server = Moto()
    yield server
    server.stop()


@pytest.fixture(params=["memory", "local", "s3"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., SessionStore]]:
    """A factory of stores on one backend: each test gets a fresh root (memory:// is one dict per process)."""
    backend = request.param
    server = Moto() if backend == "s3" else None
    root = {
        "memory": f"memory://sessions-{uuid.uuid4().hex}",
        "local": f"file://{tmp_path / 'sessions'}",
        "s3": f"s3://{server.bucket()}/prefix" if server else "",
    }[backend]

    def factory(**kwargs: object) -> SessionStore:
        options = server.options() if server else None
        return SessionStore(root, storage_options=options, **kwargs)

    yield factory
    if server:
        server.stop()


def test_round_trip_on_each_backend(make_store: Callable[..., SessionStore]) -> None:
    store = make_store()
    rec = make_record("chat-1", n_tokens=200)
    assert store.list_sessions() == [] and not store.exists("chat-1")
    written = store.put(rec)
    assert written > 0
    assert store.exists("chat-1") and store.list_sessions() == ["chat-1"]
    assert_same(rec, store.get("chat-1", expect=EXPECT))
    assert store.get_tokens("chat-1") == rec.token_ids
    # a second store object on the same URL (another server process, say) reads the same record
    assert_same(rec, make_store().get("chat-1", expect=EXPECT))
    rec.token_ids.extend([1, 2, 3])
    rec.updated_at += 10
    store.put(rec)  # an overwrite: the newest wins
    assert store.get("chat-1", expect=EXPECT).token_ids == rec.token_ids
    with pytest.raises(RecordMissing):
        store.get("nobody", expect=EXPECT)
    assert store.get_tokens("nobody") is None
    assert store.delete("chat-1") is True and store.delete("chat-1") is False
    assert not store.exists("chat-1") and store.list_sessions() == []
    stats = store.stats()
    assert stats["puts"] == 2 and stats["gets"] == 2 and stats["token_gets"] == 1 and stats["misses"] == 2
    assert stats["deletes"] == 1 and stats["bytes_written"] >= 2 * written and stats["bytes_read"] > written
    assert stats["faults"] == {"unavailable": 0, "corrupt": 0, "foreign": 0, "error": 0} and stats["reachable"]


def test_foreign_records_through_the_store(make_store: Callable[..., SessionStore]) -> None:
    store = make_store()
    store.put(make_record("s", fingerprint="a" * 64))
    with pytest.raises(ForeignRecord, match="model_fingerprint"):
        store.get("s", expect=EXPECT)
    with pytest.raises(ForeignRecord):
        store.get_tokens("s", expect={"model_fingerprint": FP})
    # a record copied under another session's name is not that session's
    store.fs.pipe_file(f"{store.root}/t.record", store.fs.cat_file(f"{store.root}/s.record"))
    with pytest.raises(ForeignRecord, match="session 's'"):
        store.get("t", expect={})
    assert store.stats()["faults"]["foreign"] == 3


def test_bad_session_ids_are_user_errors(tmp_path: Path) -> None:
    store = SessionStore(tmp_path)
    for bad in ("", "../etc", ".hidden", "a/b", "x" * 200, "tab\t"):
        with pytest.raises(ConfkvError):
            store.get(bad, expect=EXPECT)


def test_local_store_on_disk_faults(tmp_path: Path) -> None:
    store = SessionStore(str(tmp_path / "s"))
    store.put(make_record("a"))
    path = tmp_path / "s" / "a.record"
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 2])
    with pytest.raises(CorruptRecord, match="truncated"):
        store.get("a", expect=EXPECT)
    flipped = bytearray(good)
    flipped[-10] ^= 1
    path.write_bytes(bytes(flipped))
    with pytest.raises(CorruptRecord, match="checksum"):
        store.get("a", expect=EXPECT)
    assert store.get_tokens("a") is not None  # recomputation still has what it needs
    assert store.stats()["faults"]["corrupt"] == 2
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["a.record", "a.tokens"]  # no temp file left


def test_tokens_are_written_first(make_store: Callable[..., SessionStore], monkeypatch: pytest.MonkeyPatch) -> None:
    """When the record's write fails, the tokens object of the same put is already stored."""
    store = make_store()
    old = make_record("s", n_tokens=50)
    store.put(old)
    new = make_record("s", n_tokens=90, seed=1)
    real = store._op

    def failing(name: str, path: str, *args: object, **kwargs: object) -> object:
        if path.endswith(".record") and name in ("pipe_file", "atomic_write"):
            raise StoreUnavailable("injected: connection reset")
        return real(name, path, *args, **kwargs)

    monkeypatch.setattr(store, "_op", failing)
    with pytest.raises(StoreUnavailable):
        store.put(new)
    monkeypatch.undo()
    assert store.get_tokens("s") == new.token_ids
    assert_same(old, store.get("s", expect=EXPECT))  # the older record is still whole
    assert store.stats()["faults"]["unavailable"] == 1


def test_s3_outage_times_out_and_the_same_store_recovers(moto: Moto, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="confkv.sessions.store")
    timeout = 1.0
    store = SessionStore(f"s3://{moto.bucket()}/p", storage_options=moto.options(), timeout_s=timeout)
    rec = make_record("s")
    store.put(rec)
    moto.stop()  # connection refused from now on
    for call in (lambda: store.get("s", expect=EXPECT), lambda: store.put(rec), store.list_sessions):
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            call()
        assert time.monotonic() - t0 < timeout + 1.5
    assert store.stats()["faults"]["unavailable"] == 3 and not store.stats()["reachable"]
    assert sum("unavailable" in r.getMessage() for r in caplog.records if r.levelname == "WARNING") == 1
    moto.restart()  # same port, objects kept: the outage is over
    assert_same(rec, store.get("s", expect=EXPECT))
    store.put(make_record("s2"))
    assert store.list_sessions() == ["s", "s2"] and store.stats()["reachable"]
    assert any("answers again" in r.getMessage() for r in caplog.records)


def test_hung_endpoint_costs_at_most_the_timeout() -> None:
    """A port that accepts connections and never answers: botocore's read timeout and the call deadline fire."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)  # the kernel completes handshakes; nobody ever reads or answers
        endpoint = f"http://127.0.0.1:{hung.getsockname()[1]}"
        store = SessionStore("s3://b/p", storage_options={"endpoint_url": endpoint}, timeout_s=0.5)
        with pytest.raises(StoreUnavailable):  # builds the client first: local CPU work, outside the deadline
            store.get("s", expect=EXPECT)
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            store.get("s", expect=EXPECT)
        elapsed = time.monotonic() - t0
    assert 0.4 < elapsed < 2.0, elapsed


def test_trickling_endpoint_is_cut_off_by_the_overall_deadline() -> None:
    """An endpoint that sends a byte every 0.1 s never trips the idle timeout; the size-based deadline
    (timeout_s + size / min_bytes_per_s) still ends the call, instead of the 20 s the body would take."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Trickle(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _headers(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "200")
            self.send_header("ETag", '"x"')
            self.send_header("Last-Modified", "Wed, 01 Jan 2025 00:00:00 GMT")
            self.end_headers()

        def do_HEAD(self) -> None:
            self._headers()

        def do_GET(self) -> None:
            self._headers()
            try:
                for _ in range(200):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        store = SessionStore("s3://b/p", storage_options={"endpoint_url": endpoint}, timeout_s=0.5, min_bytes_per_s=400)
        store.exists("s")  # a HEAD, answered at once; it builds the client (local CPU work) before the clock starts
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="not done within 1 s"):
            store.get("s", expect=EXPECT)
        assert time.monotonic() - t0 < 5.0  # the HEAD and the 1 s deadline, with room for a loaded machine
    finally:
        server.shutdown()
        server.server_close()


def test_s3_endpoint_and_credentials_from_the_environment(moto: Moto, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.endpoint)
    store = SessionStore(f"s3://{moto.bucket()}/env")  # no storage_options at all
    store.put(make_record("e"))
    assert_same(make_record("e"), store.get("e", expect=EXPECT))


def test_concurrent_sessions_from_threads(make_store: Callable[..., SessionStore]) -> None:
    store = make_store()
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for turn in range(3):
                rec = make_record(f"t{n}", n_tokens=40 + 16 * turn, seed=100 * n + turn)
                store.put(rec)
                assert_same(rec, store.get(f"t{n}", expect=EXPECT))
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert store.list_sessions() == [f"t{n}" for n in range(6)]
    assert store.stats()["puts"] == 18 and store.stats()["gets"] == 18


@pytest.mark.parametrize("backend", ["local", "memory"])
def test_a_reader_never_sees_half_a_record(backend: str, tmp_path: Path) -> None:
    """A writer rewrites a ~4 MiB record in turn with two versions; a reader polling meanwhile always gets a whole
    one (never CorruptRecord), and sees both versions."""
    url = str(tmp_path / "s") if backend == "local" else f"memory://atomic-{uuid.uuid4().hex}"
    writer, reader = SessionStore(url, level=1), SessionStore(url)
    versions = [make_record("big", n_tokens=1024, layers=4, heads=4, dim=32, seed=s) for s in (1, 2)]
    expected = {tuple(r.token_ids[:8]): r for r in versions}
    writer.put(versions[0])
    stop = threading.Event()

    def write() -> None:
        n = 0
        while not stop.is_set():
            writer.put(versions[n % 2])
            n += 1

    thread = threading.Thread(target=write)
    thread.start()
    seen: set[tuple[int, ...]] = set()
    reads = 0
    try:
        deadline = time.monotonic() + 1.5  # poll this long, and on until both versions were seen (5 s at most)
        while time.monotonic() < deadline or (len(seen) < 2 and time.monotonic() < deadline + 5):
            rec = reader.get("big", expect=EXPECT)
            key = tuple(rec.token_ids[:8])
            assert_same(expected[key], rec)
            seen.add(key)
            reads += 1
    finally:
        stop.set()
        thread.join()
    assert len(seen) == 2 and reads >= 10
    assert reader.stats()["faults"]["corrupt"] == 0


def test_real_kv_compresses() -> None:
    """KV from a forward pass of the tiny model over text (benchmarks/session_codec.py measures it in full)."""
    from confkv.model_loader import tiny_random_model, tiny_random_tokenizer

    model, tok = tiny_random_model(0), tiny_random_tokenizer()
    ids = tok((Path(__file__).resolve().parents[1] / "README.md").read_text()[:4000])["input_ids"][:512]
    with torch.no_grad():
        layers = model(torch.tensor([ids]), use_cache=True).past_key_values.layers
    k = torch.stack([layer.keys[0] for layer in layers]).transpose(1, 2)  # [L, T, H, D]
    v = torch.stack([layer.values[0] for layer in layers]).transpose(1, 2)
    blocks = {i: BlockKV(k[:, i * 16 : (i + 1) * 16], v[:, i * 16 : (i + 1) * 16], torch.zeros(16)) for i in range(32)}
    rec = SessionRecord("real", FP, 16, "float32", ids, 512, blocks)
    header = read_header(encode(rec))
    assert header["raw_bytes"] / header["payload_bytes"] > 1.25  # measured 1.42 at 1,024 tokens
    assert_same(rec, decode(encode(rec), expect=EXPECT))


def test_an_s3_record_is_one_put(moto: Moto, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every record goes up as one PUT (s3fs switches to a multipart upload past twice its chunk size; one cut off
    by the deadline is cancelled, which s3fs does not abort, and its parts stay in the bucket)."""
    from confkv.sessions.store import S3_SINGLE_PUT_BYTES

    store = SessionStore(f"s3://{moto.bucket()}/one", storage_options=moto.options())
    real, seen = store.fs._pipe_file, []

    async def recording(path: str, data: bytes, **kwargs: object) -> object:
        seen.append(kwargs.get("chunksize"))
        return await real(path, data, **kwargs)

    monkeypatch.setattr(store.fs, "_pipe_file", recording)
    store.put(make_record("one-put"))
    assert seen and set(seen) == {S3_SINGLE_PUT_BYTES} and 2 * S3_SINGLE_PUT_BYTES > 5 * 2**30
    assert store.exists("one-put")


def test_a_damaged_tokens_object_is_found_counted_and_rewritten(tmp_path: Path) -> None:
    """Issue 33 (9): corrupting a session's ``.tokens`` object (its record intact) went unnoticed: nothing read it
    at a restore, and expiry, which reads only it, skipped the session for good. A restore now checks it against the
    record, counts a corrupt object and writes it again; expiry reads past a damaged one."""
    store = SessionStore(str(tmp_path / "s"))
    record = make_record("tok")
    store.put(record)
    path = tmp_path / "s" / "tok.tokens"
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptRecord):
        store.read_tokens("tok")
    assert store.get("tok", expect=EXPECT).token_ids == record.token_ids  # the record itself is sound
    assert store.stats()["tokens_repaired"] == 1 and store.stats()["faults"]["corrupt"] == 2
    assert store.read_tokens("tok").token_ids == record.token_ids  # written again from the record
    store.get("tok", expect=EXPECT)
    assert store.stats()["tokens_repaired"] == 1  # a sound one is left alone


def test_expiry_reads_past_a_damaged_tokens_object(tmp_path: Path) -> None:
    from confkv.sessions.worker import StoreWorker

    store = SessionStore(str(tmp_path / "s"))
    store.put(make_record("old"))
    (tmp_path / "s" / "old.tokens").write_bytes(b"not a tokens object")
    store.put(make_record("both", seed=1))
    (tmp_path / "s" / "both.tokens").write_bytes(b"garbage")
    for p in (tmp_path / "s").iterdir():
        if p.name.startswith("both.") and not p.name.endswith(".tokens"):
            p.write_bytes(b"garbage too")
    worker = StoreWorker(store, lambda sid: False)
    try:
        worker.submit(("sweep", time.time() + 60))  # every session is older than that
        deadline = time.monotonic() + 20
        while store.list_sessions():
            assert time.monotonic() < deadline, f"the sweep left {store.list_sessions()}"
            time.sleep(0.05)
    finally:
        worker.stop()
