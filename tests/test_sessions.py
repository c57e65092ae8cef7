"""Sessions across the three tiers on tiny-random: turns that reuse their history's KV give the text a full
recomputation gives, wherever the session was kept (device, host, a folder, S3 via moto) and whatever went wrong
with the store."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path

import pytest

from confkv import LLM, SamplingParams
from confkv.sessions.store import SessionStore
from confkv.sessions.tiers import SessionOptions

from .conftest import fresh_tiny

TURNS = [
    "Hello! Tell me about the sea.",
    "And what lives in it?",
    "Summarise what you said in one line.",
]
PARAMS = SamplingParams(max_tokens=24, ignore_eos=True)


def _chat(llm: LLM, session: str | None, between=None) -> list:
    """Three turns; each prompt is the whole conversation so far (as an OpenAI client sends it)."""
    messages, outs = [], []
    for i, turn in enumerate(TURNS):
        messages.append({"role": "user", "content": turn})
        (out,) = llm.chat([messages], PARAMS, session_id=session)
        messages.append({"role": "assistant", "content": out.text})
        outs.append(out)
        if between is not None and i < len(TURNS) - 1:
            between(llm, i)
    return outs


@pytest.fixture(scope="module")
def reference():
    return [o.token_ids for o in _chat(LLM("tiny-random", "full", loaded=fresh_tiny()), None)]


def test_device_tier_reuses_history_and_matches_recomputation(reference):
    llm = LLM("tiny-random", "full", loaded=fresh_tiny())
    outs = _chat(llm, "chat-1")
    assert [o.token_ids for o in outs] == reference
    assert outs[0].cached_tokens == 0
    for prev, out in itertools.pairwise(outs):
        assert out.cached_tokens >= prev.prompt_tokens  # at least the previous prompt's KV was reused
        assert out.cached_tokens < out.prompt_tokens  # and the new turn was computed
    stats = llm.engine.stats()
    assert stats["session_hits"]["device"] == 2 and stats["session_tokens_reused"] > 0
    assert stats["sessions"]["device"] == 1 and llm.engine.pool.num_used > 0  # parked on the device


def test_host_tier_after_memory_pressure(reference):
    llm = LLM("tiny-random", "full", loaded=fresh_tiny())
    outs = _chat(llm, "chat-2", between=lambda llm, i: llm.engine.sessions.reclaim(10**6))
    assert [o.token_ids for o in outs] == reference
    stats = llm.engine.stats()
    assert stats["session_hits"]["host"] == 2 and stats["session_hits"]["device"] == 0
    llm.engine.sessions.reclaim(10**6)
    assert llm.engine.stats()["sessions"]["host"] == 1 and llm.engine.pool.num_used == 0


@pytest.mark.parametrize("where", ["folder", "memory"])
def test_store_tier_survives_a_restart(reference, tmp_path, where):
    url = str(tmp_path / "sessions") if where == "folder" else f"memory://confkv-test-{tmp_path.name}"
    options = SessionOptions(store_url=url)

    def offload(llm, i):
        assert llm.engine.flush_sessions() == 1  # what SIGTERM does: every session to the store
        llm.engine.sessions.parked.clear()  # and then the process is gone

    first = LLM("tiny-random", "full", loaded=fresh_tiny(), sessions=options)
    outs = _chat(first, "chat-3", between=offload)
    first.close()
    assert [o.token_ids for o in outs] == reference
    assert all(o.cached_tokens > 0 for o in outs[1:])
    assert all("restore_s" in o.timing for o in outs[1:])
    stats = first.engine.stats()
    assert stats["session_hits"]["store"] == 2 and stats["session_offloads"] == 2
    assert SessionStore(url).list_sessions() == ["chat-3"]


def _settle(llm: LLM, offloads: int, timeout_s: float = 30.0) -> None:
    """Wait until the engine's background writer confirmed ``offloads`` records (housekeeping drains its answers)."""
    deadline = time.monotonic() + timeout_s
    while llm.engine.stats()["session_offloads"] < offloads and time.monotonic() < deadline:
        llm.engine.housekeeping()
        time.sleep(0.01)
    assert llm.engine.stats()["session_offloads"] == offloads


def test_write_through_lets_another_server_resume_without_a_flush(reference, tmp_path):
    """Two servers on one store, turns alternating between them and neither ever flushed (as if each crashed after
    its turn): each turn resumes from the record the other wrote through, and the text is a recomputation's."""
    url = str(tmp_path / "shared")
    options = SessionOptions(store_url=url, write_through=True)
    a = LLM("tiny-random", "full", loaded=fresh_tiny(), sessions=options)
    b = LLM("tiny-random", "full", loaded=fresh_tiny(), sessions=options)
    servers, written = [a, b, a], {id(a): 0, id(b): 0}
    messages, outs = [], []
    for turn, llm in zip(TURNS, servers, strict=True):
        messages.append({"role": "user", "content": turn})
        (out,) = llm.chat([messages], PARAMS, session_id="through")
        written[id(llm)] += 1
        _settle(llm, written[id(llm)])  # the turn's record landed; the session also stays in memory
        assert llm.engine.stats()["sessions"]["device"] == 1
        messages.append({"role": "assistant", "content": out.text})
        outs.append(out)
    assert [o.token_ids for o in outs] == reference
    assert all(o.cached_tokens > 0 for o in outs[1:])
    assert b.engine.stats()["session_hits"]["store"] == 1
    # a's third turn found its own first turn still parked: the stale but consistent prefix is adopted
    assert a.engine.stats()["session_hits"]["device"] == 1
    assert outs[2].cached_tokens < outs[2].prompt_tokens
    a.close()
    b.close()


def test_idle_sessions_move_down_the_tiers(tmp_path):
    options = SessionOptions(store_url=str(tmp_path / "s"), idle_s=0.0, offload_s=0.0)
    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), sessions=options)
    llm.chat([[{"role": "user", "content": TURNS[0]}]], PARAMS, session_id="idle")
    engine = llm.engine
    engine.housekeeping()  # device -> host
    assert engine.stats()["sessions"]["host"] == 1 and engine.pool.num_used == 0
    engine.housekeeping()  # host -> store
    engine.flush_sessions()  # wait for the write
    assert engine.stats()["sessions"]["store"] == 1 and engine.host.used_bytes == 0
    assert SessionStore(str(tmp_path / "s")).exists("idle")
    llm.close()


def test_prompt_that_departs_from_history_keeps_the_common_prefix(reference):
    llm = LLM("tiny-random", "full", loaded=fresh_tiny())
    first = llm.chat([[{"role": "user", "content": TURNS[0]}]], PARAMS, session_id="s")[0]
    other = [{"role": "user", "content": "A different opening altogether."}]
    (out,) = llm.chat([other], PARAMS, session_id="s")
    alone = LLM("tiny-random", "full", loaded=fresh_tiny()).chat([other], PARAMS)[0]
    assert out.token_ids == alone.token_ids
    assert out.cached_tokens < first.prompt_tokens
    assert llm.engine.stats()["session_mismatches"] == 1


def test_store_faults_fall_back_to_recomputation(reference, tmp_path):
    url = str(tmp_path / "faulty")
    options = SessionOptions(store_url=url)
    store = SessionStore(url)

    def corrupt(llm, i):
        llm.engine.flush_sessions()
        llm.engine.sessions.parked.clear()
        path = tmp_path / "faulty" / "chat-4.record"
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2] if i == 0 else data[:-8] + b"garbage!")

    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), sessions=options)
    outs = _chat(llm, "chat-4", between=corrupt)
    assert [o.token_ids for o in outs] == reference  # every request succeeded, by recomputation
    assert all(o.cached_tokens == 0 for o in outs)
    assert llm.engine.stats()["session_faults"]["corrupt"] == 2
    assert store.stats()["faults"]["corrupt"] == 0  # (a fresh store object: the engine's own counted them)
    llm.close()


def test_a_record_from_another_model_is_refused(reference, tmp_path):
    url = str(tmp_path / "foreign")
    other = LLM("tiny-random", "full", loaded=fresh_tiny(seed=7), sessions=SessionOptions(store_url=url))
    other.chat([[{"role": "user", "content": TURNS[0]}]], PARAMS, session_id="chat-5")
    other.engine.flush_sessions()
    other.close()
    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), sessions=SessionOptions(store_url=url))
    outs = _chat(llm, "chat-5")
    assert [o.token_ids for o in outs] == reference
    assert outs[0].cached_tokens == 0 and llm.engine.stats()["session_faults"]["foreign"] == 1
    llm.close()


def test_one_turn_at_a_time_and_delete(tmp_path):
    from confkv.errors import ConfkvError

    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), sessions=SessionOptions(store_url=str(tmp_path / "d")))
    engine = llm.engine
    engine.add_request("a", "hello there", PARAMS, session_id="busy")
    with pytest.raises(ConfkvError, match="already has a request running"):
        engine.add_request("b", "hello again", PARAMS, session_id="busy")
    with pytest.raises(ConfkvError):
        engine.add_request("c", "bad id", PARAMS, session_id="no spaces allowed")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["sessions"]["device"] == 1
    assert engine.delete_session("busy") and engine.stats()["sessions"]["device"] == 0
    assert engine.pool.num_used == 0
    llm.close()


def test_refused_session_requests_leave_no_state():
    from confkv.errors import ConfkvError

    llm = LLM("tiny-random", "full", loaded=fresh_tiny())
    engine = llm.engine
    engine.add_request("a", "hello there", PARAMS, session_id="busy")
    for i in range(3):
        with pytest.raises(ConfkvError):
            engine.add_request(f"x{i}", "hello again", PARAMS, session_id="busy")
        with pytest.raises(ConfkvError):
            engine.add_request(f"y{i}", "hello again", PARAMS, session_id="bad id")
    assert len(engine.manager._seqs) == 1 and list(engine._seqs) == ["a"]


def test_unreachable_store_is_skipped_until_it_answers_again(tmp_path, monkeypatch):
    from confkv.sessions.errors import StoreUnavailable

    llm = LLM("tiny-random", "full", loaded=fresh_tiny(),
              sessions=SessionOptions(store_url=str(tmp_path / "down"), store_backoff_s=30.0))  # fmt: skip
    store = llm.engine.sessions.store

    def down(*a, **k):
        raise StoreUnavailable("store down (test)")

    monkeypatch.setattr(store, "get", down)
    first = llm.chat([[{"role": "user", "content": TURNS[0]}]], PARAMS, session_id="new-1")[0]
    assert first.timing.get("restore_s") is not None  # it waited for the store once
    second = llm.chat([[{"role": "user", "content": TURNS[1]}]], PARAMS, session_id="new-2")[0]
    assert "restore_s" not in second.timing  # then new sessions stop waiting on it
    assert llm.engine.stats()["session_faults"]["unavailable"] == 2
    assert llm.engine.flush_sessions() == 2  # the store takes a write: it is back, the back-off ends early
    third = llm.chat([[{"role": "user", "content": TURNS[2]}]], PARAMS, session_id="new-3")[0]
    assert third.timing.get("restore_s") is not None
    llm.close()


def test_a_record_larger_than_the_host_tier_keeps_its_prefix(reference, tmp_path):
    """A restore puts the record's blocks in the host tier first; when they do not all fit, the ones it drops are
    known as dropped (not left looking like host blocks for the next step to trip on), and a full cache recomputes
    from the first of them."""
    bytes_per_block = LLM("tiny-random", "full", loaded=fresh_tiny()).engine.pool.bytes_per_block

    def offload(llm, i):
        assert llm.engine.flush_sessions() == 1
        llm.engine.sessions.parked.clear()

    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), sessions=SessionOptions(store_url=str(tmp_path / "big")),
              host_cache_memory=3 * bytes_per_block)  # fmt: skip
    outs = _chat(llm, "chat-big", between=offload)
    assert [o.token_ids for o in outs] == reference
    block = llm.engine.pool.block_size
    assert all(o.cached_tokens == 3 * block for o in outs[1:])  # the three blocks the host tier could take
    assert llm.engine.stats()["session_hits"]["store"] == 2
    llm.close()


def _answered(tiers, done, timeout_s: float = 10.0) -> None:
    """Drain the store worker's answers until ``done()`` holds."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, "the session store worker did not answer"
        tiers._drain(block_s=0.05)


def test_a_failed_write_leaves_a_newer_turn_of_the_session_alone(tmp_path, monkeypatch):
    """A write that fails after the session's next turn has parked it again must not forget that turn's KV (nor
    leave its blocks held by nobody)."""
    from confkv.sessions.errors import StoreUnavailable

    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), sessions=SessionOptions(store_url=str(tmp_path / "w")))
    engine, tiers = llm.engine, llm.engine.sessions
    llm.chat([[{"role": "user", "content": TURNS[0]}]], PARAMS, session_id="w")
    release = threading.Event()

    def slow_failing_put(record):
        release.wait(10)
        raise StoreUnavailable("write lost (test)")

    monkeypatch.setattr(tiers.store, "put", slow_failing_put)
    tiers._to_store(tiers.parked["w"])
    tiers._store_down_until = time.monotonic() + 60  # backing off: the next turn does not wait for the store
    llm.chat([[{"role": "user", "content": TURNS[1]}]], PARAMS, session_id="w")
    assert tiers.parked["w"].tier == "device"
    release.set()
    _answered(tiers, lambda: tiers._pending_writes == 0)
    assert tiers.faults["unavailable"] == 2  # the skipped restore and the lost write
    assert tiers.parked["w"].tier == "device" and engine.pool.num_used > 0
    assert engine.delete_session("w") and engine.pool.num_used == 0
    llm.close()


def test_a_delete_that_fails_after_a_write_is_not_undone_by_it(tmp_path, monkeypatch):
    """A write queued before a delete that the store then fails to answer does not replace the deleted record:
    the session is not restored from it, and the delete is sent again."""
    from confkv.sessions.errors import StoreUnavailable

    url = str(tmp_path / "del")
    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), sessions=SessionOptions(store_url=url))
    tiers = llm.engine.sessions
    llm.chat([[{"role": "user", "content": TURNS[0]}]], PARAMS, session_id="gone")
    real_delete = tiers.store.delete

    def fails_once(sid):
        monkeypatch.setattr(tiers.store, "delete", real_delete)
        raise StoreUnavailable("delete lost (test)")

    monkeypatch.setattr(tiers.store, "delete", fails_once)
    tiers._to_store(tiers.parked["gone"])  # the write is queued first
    assert llm.engine.delete_session("gone")  # then the delete, which the store fails to answer
    _answered(tiers, lambda: tiers._pending_writes == 0 and tiers.faults["unavailable"] == 1)
    assert SessionStore(url).exists("gone") and "gone" in tiers._unconfirmed_deletes
    tiers._store_down_until = 0.0
    (out,) = llm.chat([[{"role": "user", "content": TURNS[0]}]], PARAMS, session_id="gone")
    assert out.cached_tokens == 0 and "restore_s" not in out.timing  # not restored from the deleted record
    tiers.request_sweep()
    tiers.housekeeping()  # the sweep sends the delete again
    _answered(tiers, lambda: "gone" not in tiers._unconfirmed_deletes)
    assert not SessionStore(url).exists("gone")
    llm.close()


def test_a_store_call_that_fails_unexpectedly_still_answers_its_request(tmp_path, monkeypatch):
    """A failure other than the store's own faults (a bug, a library's exception) is answered as a fault: the
    request waiting for the restore recomputes instead of waiting for good."""
    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), sessions=SessionOptions(store_url=str(tmp_path / "bug")))
    engine = llm.engine

    def broken(*a, **k):
        raise RuntimeError("not a store fault (test)")

    monkeypatch.setattr(engine.sessions.store, "get", broken)
    engine.add_request("r", "hello there", PARAMS, session_id="never-seen")
    deadline = time.monotonic() + 30
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the request waited for a restore that was never answered"
        engine.step() or engine.sessions.wait_for_restores(0.05)
    assert engine.stats()["session_faults"]["error"] == 1
    llm.close()


def test_the_expiry_sweep_goes_past_an_object_it_cannot_read(tmp_path):
    url = str(tmp_path / "sweep")
    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), sessions=SessionOptions(store_url=url))
    llm.chat([[{"role": "user", "content": TURNS[0]}]], PARAMS, session_id="zzz")
    llm.engine.flush_sessions()
    (tmp_path / "sweep" / "aaa.tokens").write_bytes(b"not a tokens object")  # sorts first
    llm.engine.sessions.worker.submit(("sweep", time.time() + 1))  # everything is older than that
    deadline = time.monotonic() + 30
    while SessionStore(url).exists("zzz"):
        assert time.monotonic() < deadline, "the sweep stopped at the unreadable object"
        time.sleep(0.05)
    llm.close()


def test_offloads_count_what_landed_attempts_and_failures_apart(tmp_path, monkeypatch):
    """Issue 33 (8): ``session_offloads`` rose while the store was down (it counted attempts). It counts records
    the store confirmed; attempts and failures are counted apart."""
    from confkv.sessions.errors import StoreUnavailable

    llm = LLM("tiny-random", "full", loaded=fresh_tiny(), sessions=SessionOptions(store_url=str(tmp_path / "o")))
    tiers = llm.engine.sessions
    real_put = tiers.store.put

    def down(record):
        raise StoreUnavailable("store down (test)")

    for sid in ("a", "b"):
        llm.chat([[{"role": "user", "content": TURNS[0]}]], PARAMS, session_id=sid)
    monkeypatch.setattr(tiers.store, "put", down)
    tiers._to_store(tiers.parked["a"])
    _answered(tiers, lambda: tiers._pending_writes == 0)
    stats = llm.engine.stats()
    assert (stats["session_offloads"], stats["session_offload_attempts"], stats["session_offload_failures"]) == (
        0, 1, 1)  # fmt: skip
    monkeypatch.setattr(tiers.store, "put", real_put)
    tiers._to_store(tiers.parked["b"])
    _answered(tiers, lambda: tiers._pending_writes == 0)
    stats = llm.engine.stats()
    assert (stats["session_offloads"], stats["session_offload_attempts"], stats["session_offload_failures"]) == (
        1, 2, 1)  # fmt: skip
    llm.close()


_NEAR_BOOT = """
import time
from confkv import LLM, SamplingParams
from confkv.sessions.tiers import SessionOptions
from tests.conftest import fresh_tiny
assert time.monotonic() < 120, time.monotonic()
llm = LLM("tiny-random", "full", loaded=fresh_tiny(), sessions=SessionOptions(store_url={url!r}, ttl_s=3600.0))
tiers = llm.engine.sessions
jobs = []
tiers.worker.submit = jobs.append
tiers.housekeeping()
assert not [j for j in jobs if j[0] == "sweep"], "swept before its interval"
tiers.request_sweep()
tiers.housekeeping()
assert [j for j in jobs if j[0] == "sweep"], "a requested sweep did not run on a machine just booted"
"""


def test_timers_do_not_depend_on_the_machines_uptime(tmp_path):
    """Issue 33 (11): a sweep forced by setting its last time to zero never ran on a machine up for less than ten
    minutes (monotonic time counts from boot). Run in a fresh time namespace whose monotonic clock reads a few
    seconds: no sweep before its interval, a requested one at once."""
    import os
    import shutil
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    uptime = int(float(Path("/proc/uptime").read_text().split()[0]))
    code = _NEAR_BOOT.format(url=str(tmp_path / "boot"))
    cmd = ["unshare", "--time", f"--monotonic=-{max(0, uptime - 5)}", "--", sys.executable, "-c", code]
    probe = subprocess.run(["unshare", "--time", "--", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no time namespace here ({probe.stderr.decode().strip() or probe.returncode})")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
