"""The policy registry (``store``) on SQLite and on PostgreSQL: schema migrations, register/promote/rollback/export,
concurrent alias moves, refusal of broken artifacts, the promotion gate, ``registry://`` references in the engine
and hot swap through the watcher.

PostgreSQL tests run against ``$CONFKV_TEST_POSTGRES`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``),
each in a fresh schema that is dropped afterwards; they skip only when no server answers there.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa
import torch
import yaml

from confkv import LLM, SamplingParams
from confkv.cli import main as confkv_main
from confkv.config import CachePolicy, load_policy_file
from confkv.controllers.learned import MLPPolicy
from confkv.controllers.observation import OBS_DIM
from confkv.errors import ConfkvError
from envs.episodes import default_base_policy
from store.artifacts import sha256_hex
from store.db import (
    VERSION_TABLE,
    current_revision,
    default_registry_url,
    dispose_engines,
    get_engine,
    head_revision,
    parse_url,
    upgrade,
)
from store.errors import NotFoundError, RegistryError
from store.models import Base, PolicyVersion
from store.refs import is_registry_ref, parse_ref, resolve_ref
from store.registry import Registry
from store.watcher import PolicyWatcher, wait_until
from tests.conftest import fresh_tiny
from tuner.cli import main as tune_main

PG_BASE = os.environ.get("CONFKV_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
RULE = CachePolicy(base_size=32, max_size=128, min_recent=16)


# ------------------------------------------------------------------------------------------------ fixtures
def _pg_conninfo() -> str:
    return parse_url(PG_BASE).set(drivername="postgresql").render_as_string(hide_password=False)


@pytest.fixture(scope="session")
def pg_server() -> None:
    import psycopg

    try:
        psycopg.connect(_pg_conninfo(), connect_timeout=3).close()
    except Exception as err:
        pytest.skip(f"no PostgreSQL server answers at {PG_BASE} ({err}); set CONFKV_TEST_POSTGRES to one")


@pytest.fixture
def pg_url(pg_server: None):
    import psycopg

    schema = f"confkv_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(_pg_conninfo(), autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    yield f"{PG_BASE}?options=-csearch_path%3D{schema}"
    dispose_engines()
    with psycopg.connect(_pg_conninfo(), autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'registry.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


def learned_folder(tmp_path: Path, seed: int = 0, base: CachePolicy = RULE) -> Path:
    """A small exported learned policy (random weights): what ``agents.export`` writes, without training."""
    g = torch.Generator().manual_seed(seed)
    layers = [
        (torch.randn(8, OBS_DIM, generator=g) * 0.3, torch.zeros(8), "tanh"),
        (torch.randn(3, 8, generator=g) * 0.3, torch.zeros(3), "none"),
    ]
    return MLPPolicy(layers=layers, action="knobs").save(tmp_path / f"learned-{seed}", base)


def set_artifact(reg: Registry, name: str, version: int, data: bytes, sha256: str | None = None) -> None:
    """Overwrite a version's stored artifact (and optionally its recorded checksum), as a corruption would."""
    values: dict = {"artifact": data}
    if sha256 is not None:
        values["artifact_sha256"] = sha256
    with reg.engine.begin() as conn:
        pid = conn.execute(sa.text("SELECT id FROM confkv_policies WHERE name = :n"), {"n": name}).scalar_one()
        conn.execute(
            sa.update(PolicyVersion.__table__)
            .where(PolicyVersion.__table__.c.policy_id == pid, PolicyVersion.__table__.c.version == version)
            .values(**values)
        )


def flip_a_byte(data: bytes) -> bytes:
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]


# ------------------------------------------------------------------------------------------------ schema
def test_schema_migrates_from_empty_and_matches_the_models(url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    engine = get_engine(url, migrate=False)
    assert current_revision(engine) is None
    Registry(url)  # first use migrates
    assert current_revision(engine) == head_revision() == "0002"
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE, "compare_type": False})
        assert compare_metadata(ctx, Base.metadata) == []
    Registry(url)  # at head already: nothing to do


def test_upgrade_from_the_previous_revision_keeps_data_and_backfills_history(url: str) -> None:
    engine = get_engine(url, migrate=False)
    upgrade(engine, "0001")
    assert current_revision(engine) == "0001"
    assert "confkv_alias_history" not in sa.inspect(engine).get_table_names()
    meta = sa.MetaData()
    meta.reflect(engine)
    t = meta.tables
    now = datetime.now(timezone.utc)
    data = yaml.safe_dump({"cache_policy": RULE.model_dump(mode="json", exclude={"learned_path"})}).encode()
    with engine.begin() as conn:  # a registry as revision 0001 left it: two versions, production on version 2
        pid = conn.execute(t["confkv_policies"].insert().values(name="old", created_at=now)).inserted_primary_key[0]
        vids = []
        for v in (1, 2):
            row = dict(policy_id=pid, version=v, kind="rule", parameters={"max_size": 128}, artifact=data,
                       artifact_sha256=sha256_hex(data), created_at=now)  # fmt: skip
            vids.append(conn.execute(t["confkv_policy_versions"].insert().values(**row)).inserted_primary_key[0])
        conn.execute(t["confkv_aliases"].insert().values(policy_id=pid, alias="production", version_id=vids[1],
                                                         updated_at=now, updated_by="ops"))  # fmt: skip
    reg = Registry(url)  # upgrades 0001 -> 0002
    assert current_revision(engine) == "0002"
    assert "ix_confkv_evaluations_version_workload" in {i["name"] for i in sa.inspect(engine).get_indexes(
        "confkv_evaluations")}  # fmt: skip
    assert reg.alias_version("old") == 2 and [v.version for v in reg.versions("old")] == [1, 2]
    [backfill] = reg.history("old")
    assert (backfill.action, backfill.from_version, backfill.to_version, backfill.who) == ("backfill", None, 2, "ops")
    with pytest.raises(NotFoundError, match="no earlier version"):
        reg.rollback("old")
    reg.promote("old", 1)
    assert reg.rollback("old").to_version == 2  # the backfilled version is the rollback target
    assert reg.load("old", 1)[1].max_size == 128


# ------------------------------------------------------------------------------------------------ round trip
def test_register_promote_rollback_export_round_trip(url: str, tmp_path: Path) -> None:
    reg = Registry(url)
    f = tmp_path / "a.yaml"
    f.write_text(yaml.safe_dump({"cache_policy": {"base_size": 32, "max_size": 128, "min_recent": 16}}))
    v1 = reg.register("rt", f, model="tiny-random")
    v2 = reg.register("rt", RULE.replace(scaling_factor=0.9), parent=1)
    v3 = reg.register("rt", learned_folder(tmp_path), parent="rt@2", description="a learned one")
    assert [v.version for v in (v1, v2, v3)] == [1, 2, 3]
    assert (v1.kind, v3.kind, v3.parent, v1.model) == ("rule", "learned", ("rt", 2), "tiny-random")
    assert reg.promote("rt", 1, reason="first").from_version is None
    assert reg.promote("rt", 3, reason="learned").from_version == 1
    assert not reg.promote("rt", 3).changed  # already there: nothing recorded
    reg.promote("rt", 2, alias="staging")
    assert reg.get_version("rt").version == 3 and reg.get_version("rt", "staging").version == 2
    assert reg.get_version("rt", "latest").aliases == ("production",)

    r = resolve_ref("registry://rt", url)  # production by default
    assert (r.name, r.version, r.alias, r.policy.controller) == ("rt", 3, "production", "learned")
    assert r.path is not None and (r.path / "policy.safetensors").is_file() and r.sha256 == v3.sha256
    assert resolve_ref("registry://rt@1", url).policy == RULE

    exported = reg.export("rt", 2, tmp_path / "out" / "v2.yaml")
    assert load_policy_file(exported) == RULE.replace(scaling_factor=0.9)
    folder = reg.export("rt", "production", tmp_path / "out" / "v3")
    assert load_policy_file(folder).controller == "learned"
    assert MLPPolicy.load(folder).layers[0][0].shape == (8, OBS_DIM)
    with pytest.raises(RegistryError, match="exports to a folder"):
        reg.export("rt", 3, tmp_path / "v3.yaml")

    assert (reg.rollback("rt", reason="bad").to_version, reg.alias_version("rt")) == (1, 1)
    with pytest.raises(NotFoundError, match="no earlier version"):
        reg.rollback("rt")
    moves = [(m.action, m.from_version, m.to_version) for m in reg.history("rt", "production")]
    assert moves == [("promote", None, 1), ("promote", 1, 3), ("rollback", 3, 1)]
    assert [m.reason for m in reg.history("rt", "production")] == ["first", "learned", "bad"]


def test_the_cli_round_trip(url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"cache_policy": RULE.model_dump(mode="json", exclude={"learned_path"})}))
    u = ["--registry-url", url]
    assert tune_main(["register", "cli", "--policy-file", str(f), "--model", "tiny-random", *u]) == 0
    assert capsys.readouterr().out.strip() == "1"
    assert tune_main(["register", "cli", "--artifact", str(learned_folder(tmp_path)), "--parent", "1", *u]) == 0
    assert capsys.readouterr().out.strip() == "2"
    assert tune_main(["promote", "cli", "1", "--reason", "first", *u]) == 0
    assert tune_main(["promote", "cli", "2", *u]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["from_version"] == 1
    assert tune_main(["policies", "list", *u]) == 0
    assert "production -> 2" in capsys.readouterr().out
    assert tune_main(["policies", "show", "cli@production", "--json", *u]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["version"] == 2 and doc["lineage"] == ["cli@2", "cli@1"] and len(doc["alias_history"]) == 2
    assert tune_main(["policies", "show", "cli@1", *u]) == 0
    text = capsys.readouterr().out
    assert "parameters:" in text and "max_size: 128" in text and "alias history:" in text and "'first'" in text
    assert tune_main(["rollback", "cli", *u]) == 0
    assert json.loads(capsys.readouterr().out)["to_version"] == 1
    assert tune_main(["export", "cli@production", "--out", str(tmp_path / "e.yaml"), *u]) == 0
    assert load_policy_file(capsys.readouterr().out.strip()) == RULE
    assert tune_main(["export", "registry://cli@2", "--out", str(tmp_path / "e2"), *u]) == 0
    assert load_policy_file(capsys.readouterr().out.strip()).controller == "learned"


# ------------------------------------------------------------------------------------------------ concurrency
def test_concurrent_promotions_leave_one_version_and_both_moves(url: str) -> None:
    reg = Registry(url)
    for round_ in range(3):
        name = f"cc{round_}"
        for i in range(3):
            reg.register(name, RULE.replace(max_size=128 + 16 * i))
        reg.promote(name, 1)
        barrier = threading.Barrier(2)
        errors: list[BaseException] = []

        def move(version: int, name: str = name, barrier: threading.Barrier = barrier, errors: list = errors) -> None:
            try:
                mine = Registry(url)
                barrier.wait()
                mine.promote(name, version, reason=f"thread {version}")
            except BaseException as err:
                errors.append(err)

        threads = [threading.Thread(target=move, args=(v,)) for v in (2, 3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors
        with reg.engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT a.alias FROM confkv_aliases a JOIN confkv_policies p "
                                        "ON p.id = a.policy_id WHERE p.name = :n"), {"n": name}).all()  # fmt: skip
        assert rows == [("production",)]
        moves = reg.history(name, "production")[1:]
        assert sorted(m.to_version for m in moves) == [2, 3]
        assert moves[0].from_version == 1 and moves[1].from_version == moves[0].to_version  # serialised moves
        assert reg.alias_version(name) == moves[1].to_version


def test_concurrent_registrations_get_distinct_version_numbers(url: str) -> None:
    Registry(url)
    barrier = threading.Barrier(4)
    got: list[int] = []

    def register(i: int) -> None:
        mine = Registry(url)
        barrier.wait()
        got.append(mine.register("race", RULE.replace(max_size=128 + i)).version)

    threads = [threading.Thread(target=register, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(got) == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------------------ errors
def test_promoting_a_missing_version_exits_1_with_a_clear_message(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    Registry(url).register("mv", RULE)
    u = ["--registry-url", url]
    assert tune_main(["promote", "mv", "7", *u]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["confkv-tune: error: policy 'mv' has no version 7 (versions 1-1)"]
    assert tune_main(["promote", "nothere", "1", *u]) == 1
    assert "no policy named 'nothere'" in capsys.readouterr().err
    assert tune_main(["rollback", "mv", *u]) == 1
    assert "no alias 'production'" in capsys.readouterr().err
    assert tune_main(["export", "mv@9", "--out", str(tmp_path / "x.yaml"), *u]) == 1
    assert tune_main(["policies", "show", "mv@staging", *u]) == 1
    capsys.readouterr()
    assert tune_main(["register", "bad name", "--policy-file", "x.yaml", *u]) == 2
    assert "invalid policy name" in capsys.readouterr().err
    assert tune_main(["register", "mv", "--artifact", str(tmp_path / "none"), *u]) == 2
    assert tune_main(["promote", "mv", "1", "--alias", "9lives", *u]) == 2
    assert tune_main(["promote", "mv", "1", "--force", *u]) == 2
    assert tune_main(["policies", "list", "--registry-url", "mysql://u@h/db"]) == 2
    assert "unsupported registry URL" in capsys.readouterr().err


def test_the_console_script_exits_1_without_a_traceback(sqlite_url: str) -> None:
    Registry(sqlite_url).register("mv", RULE)
    exe = Path(sys.executable).with_name("confkv-tune")
    proc = subprocess.run([str(exe), "promote", "mv", "3", "--registry-url", sqlite_url], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.strip() == "confkv-tune: error: policy 'mv' has no version 3 (versions 1-1)"


def test_urls_and_references(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CONFKV_REGISTRY_URL", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_registry_url() == f"sqlite:///{tmp_path}/confkv/registry.db"
    monkeypatch.setenv("CONFKV_REGISTRY_URL", "postgresql://u@h/db")
    assert parse_url(default_registry_url()).drivername == "postgresql+psycopg"
    with pytest.raises(RegistryError, match="unsupported"):
        parse_url("mysql://u@h/db")
    assert is_registry_ref("registry://p@production") and not is_registry_ref(Path("registry:/p"))
    assert parse_ref("registry://p") == ("p", "production")
    assert parse_ref("registry://p@4") == ("p", 4) and parse_ref("registry://p@staging") == ("p", "staging")
    for bad in ("registry://", "registry://p@", "registry://a b", "registry://p@x y"):
        with pytest.raises(ConfkvError):
            parse_ref(bad)


# ------------------------------------------------------------------------------------------------ broken artifacts
def test_a_corrupted_artifact_is_refused_and_the_old_policy_stays(url: str, tmp_path: Path) -> None:
    reg = Registry(url)
    reg.register("cor", learned_folder(tmp_path, 0))
    reg.register("cor", learned_folder(tmp_path, 1))
    reg.register("cor", RULE)
    reg.register("cor", RULE.replace(max_size=256))
    reg.promote("cor", 1)
    set_artifact(reg, "cor", 2, flip_a_byte(reg.artifact("cor", 2)[1]))  # fails its checksum
    junk = b"cache_policy: {max_size: -5}\n"
    set_artifact(reg, "cor", 3, junk, sha256_hex(junk))  # checksum right, does not load
    with pytest.raises(ConfkvError, match="checksum mismatch"):
        resolve_ref("registry://cor@2", url)
    with pytest.raises(ConfkvError, match="does not load"):
        resolve_ref("registry://cor@3", url)

    changes, refused = [], []
    w = PolicyWatcher("registry://cor@production", changes.append, refused.append, registry_url=url,
                      current_version=1)  # fmt: skip
    assert w.check_now() is False and not changes and not refused  # nothing moved
    reg.promote("cor", 2)
    assert w.check_now() is False and w.current_version == 1
    assert len(refused) == 1 and "checksum mismatch" in refused[0] and not changes
    assert w.check_now() is False and len(refused) == 1  # refused once, not at every poll
    reg.promote("cor", 3)
    assert w.check_now() is False and len(refused) == 2 and "does not load" in refused[1]
    reg.promote("cor", 4)
    assert w.check_now() is True and [c.version for c in changes] == [4] and changes[0].policy.max_size == 256


def test_an_artifact_kept_at_a_uri_is_checked_too(sqlite_url: str, tmp_path: Path) -> None:
    reg = Registry(sqlite_url)
    info = reg.register("uri", learned_folder(tmp_path), artifact_store=str(tmp_path / "store"))
    assert info.artifact_uri and info.artifact_uri.startswith("file://")
    stored = Path(info.artifact_uri[len("file://") :])
    assert stored.is_file() and resolve_ref("registry://uri@1", sqlite_url).policy.controller == "learned"
    stored.write_bytes(flip_a_byte(stored.read_bytes()))
    with pytest.raises(ConfkvError, match="checksum mismatch"):
        resolve_ref("registry://uri@1", sqlite_url)


def test_a_refused_version_is_checked_again_after_a_move_back(sqlite_url: str) -> None:
    reg = Registry(sqlite_url)
    reg.register("back", RULE)
    reg.register("back", RULE.replace(max_size=256))
    good = reg.artifact("back", 2)[1]
    set_artifact(reg, "back", 2, flip_a_byte(good))
    reg.promote("back", 1)
    changes, refused = [], []
    w = PolicyWatcher("registry://back@production", changes.append, refused.append, registry_url=sqlite_url,
                      current_version=1)  # fmt: skip
    reg.promote("back", 2)
    assert w.check_now() is False and len(refused) == 1
    reg.promote("back", 1)  # rolled back while the artifact is mended
    assert w.check_now() is False and w.refused_version is None
    set_artifact(reg, "back", 2, good)
    reg.promote("back", 2)
    assert w.check_now() is True and [c.version for c in changes] == [2] and len(refused) == 1


def test_an_unreadable_artifact_uri_is_retried_not_refused(sqlite_url: str, tmp_path: Path) -> None:
    """Storage that cannot be reached says nothing against the version: the watcher tries it again."""
    from store.errors import ArtifactUnavailable

    reg = Registry(sqlite_url)
    reg.register("far", RULE)
    info = reg.register("far", RULE.replace(max_size=256), artifact_store=str(tmp_path / "my store"))
    assert "%20" in info.artifact_uri  # a path with a space, written percent-encoded
    assert resolve_ref("registry://far@2", sqlite_url).policy.max_size == 256  # and read back
    reg.promote("far", 1)
    (tmp_path / "my store").rename(tmp_path / "away")
    changes, refused = [], []
    w = PolicyWatcher("registry://far@production", changes.append, refused.append, registry_url=sqlite_url,
                      current_version=1)  # fmt: skip
    reg.promote("far", 2)
    with pytest.raises(ArtifactUnavailable):
        w.check_now()
    assert not refused and w.refused_version is None and w.current_version == 1
    (tmp_path / "away").rename(tmp_path / "my store")
    assert w.check_now() is True and [c.version for c in changes] == [2]


# ------------------------------------------------------------------------------------------------ the gate
def test_the_gate_refuses_a_worse_candidate_and_accepts_a_better_one(
    sqlite_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    base = default_base_policy("tiny-random")
    reg = Registry(sqlite_url)
    # on tiny-random's held-out prose: full (reward 0: no saving, no loss) > the sized dynamic rule > the same
    # rule frozen at its base (scaling_factor 1: saves more, loses far more)
    reg.register("gate", base, model="tiny-random")
    reg.register("gate", base.replace(scaling_factor=1.0), model="tiny-random")
    reg.register("gate", base.replace(controller="full"), model="tiny-random")
    check = ["--check", "prose", "--registry-url", sqlite_url]
    assert tune_main(["promote", "gate", "1", *check]) == 0  # nothing under production yet: recorded, promoted
    assert "production (none)" in capsys.readouterr().out and reg.alias_version("gate") == 1

    assert tune_main(["promote", "gate", "2", *check]) == 1
    out, err = capsys.readouterr()
    assert "candidate v2" in out and "production v1" in out and "kv_fraction" in out
    assert err.startswith("confkv-tune: error: refused: candidate v2 reward") and "--force" in err
    assert reg.alias_version("gate") == 1
    evals = {(e.version, e.workload, e.split): e.reward for e in reg.evaluations("gate")}
    assert evals[(2, "prose", "heldout")] < evals[(1, "prose", "heldout")]

    assert tune_main(["promote", "gate", "3", *check]) == 0
    assert reg.alias_version("gate") == 3
    assert tune_main(["promote", "gate", "2", *check, "--force", "--reason", "testing"]) == 0
    assert reg.alias_version("gate") == 2
    last = reg.history("gate")[-1]
    assert last.reason.startswith("testing; gate on prose/heldout: refused") and last.reason.endswith("(forced)")


# ------------------------------------------------------------------------------------------------ the engine
def _generate_json(capsys: pytest.CaptureFixture[str], policy_file: str) -> dict:
    code = confkv_main(["generate", "--model", "tiny-random", "--policy-file", policy_file, "--prompt",
                        "the quick brown fox jumps over the lazy dog " * 12, "--max-tokens", "24", "--ignore-eos",
                        "--json"])  # fmt: skip
    assert code == 0
    return json.loads(capsys.readouterr().out)


def test_export_then_generate_matches_the_registry_reference(
    sqlite_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CONFKV_REGISTRY_URL", sqlite_url)
    reg = Registry(sqlite_url)
    reg.register("ex", RULE.replace(max_size=64))
    reg.register("exl", learned_folder(tmp_path, 3, RULE.replace(max_size=64)))
    for name in ("ex", "exl"):
        reg.promote(name, 1)
        assert tune_main(["export", f"{name}@production", "--out", str(tmp_path / f"{name}-out")]) == 0
        exported = capsys.readouterr().out.strip()
        from_file = _generate_json(capsys, exported)
        from_ref = _generate_json(capsys, f"registry://{name}@production")
        assert from_file["token_ids"] == from_ref["token_ids"] and len(from_ref["token_ids"]) == 24
        assert from_file["kv"] == from_ref["kv"] and from_ref["kv"]["evicted_blocks"] > 0  # the policy mattered


def _budgets(llm: LLM, ids: list[str]) -> dict[str, float]:
    return {rid: llm.engine.sequence(rid).ctrl.budget for rid in ids if llm.engine.sequence(rid) is not None}


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_hot_swap_through_the_watcher_mid_batch(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> None:
    url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    reg = Registry(url)
    # both versions keep every token of these requests (base_size >= prompt + output): full-equivalent outputs.
    # v1's budget rises while the random model is unsure; v2 (scaling_factor 1) holds whatever budget it inherits.
    v1 = CachePolicy(controller="dynamic", base_size=128, max_size=512, min_recent=16)
    reg.register("hs", v1)
    reg.register("hs", v1.replace(scaling_factor=1.0, entropy_threshold=3.0))
    reg.register("hs", v1.replace(max_size=256))
    set_artifact(reg, "hs", 3, flip_a_byte(reg.artifact("hs", 3)[1]))
    reg.promote("hs", 1)
    # PostgreSQL: a 60 s poll interval, so only LISTEN/NOTIFY can deliver the move within the test's wait
    interval = 0.05 if backend == "sqlite" else 60.0
    llm = LLM("tiny-random", policy_file="registry://hs@production", registry_url=url, loaded=fresh_tiny(),
              policy_watch_interval_s=interval, max_batch_size=4)  # fmt: skip
    assert llm.policy_watcher is not None
    watcher = llm.policy_watcher.watcher
    assert llm.engine.policy_info["version"] == "1" and llm.policy == v1
    if backend == "postgresql":
        assert wait_until(lambda: watcher.listening, 10)
    prompts = ["The registry swaps policies while requests run. " * 3, "Short prompt.", "Count: one two three four"]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ids = [f"hs-{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts, strict=True):
        llm.engine.add_request(rid, p, params)
    outputs: dict[str, list[int]] = {}
    steps = 0
    while llm.engine.has_unfinished_requests():
        if steps == 10:  # mid-run: every request is decoding
            before = _budgets(llm, ids)
            assert len(before) == 3 and all(b > v1.base_size for b in before.values())
            reg.promote("hs", 2, reason="hot swap test")
            assert wait_until(lambda: watcher.changes == 1, 10), "the watcher did not see the move"
        for out in llm.engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.output.token_ids)
        if steps == 10:
            assert llm.engine.stats()["policy_swaps"] == 1
            assert _budgets(llm, ids) == before  # carried over, and held still by v2: not reset to base_size
        steps += 1
    assert llm.engine.policy_info == {"name": "hs@2 (production)", "version": "2", "source": "registry://hs@production"}
    assert llm.policy.scaling_factor == 1.0

    reference = LLM("tiny-random", "full", loaded=fresh_tiny(), max_batch_size=4).generate(prompts, params)
    assert [outputs[rid] for rid in ids] == [list(r.token_ids) for r in reference]

    reg.promote("hs", 3)  # corrupted: refused and counted, version 2 stays
    assert wait_until(lambda: llm.engine.stats()["policy_swaps_refused"] == 1, 10)
    assert llm.engine.policy_info["version"] == "2" and llm.policy.max_size == 512
    assert len(llm.generate("still serving", SamplingParams(max_tokens=4))[0].token_ids) == 4
    llm.close()
    assert not watcher.running


# ------------------------------------------------------------------------------------------------ training
def test_train_registers_its_result_and_tags_the_run(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import mlflow

    monkeypatch.chdir(tmp_path)
    u = ["--registry-url", sqlite_url]
    code = tune_main(["train", "--algo", "optuna", "--trials", "2", "--model", "tiny-random", "--workload", "prose",
                      "--out", "run", *u])  # fmt: skip
    assert code == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["registry"]["ref"] == "registry://tiny-random-prose@1"
    reg = Registry(sqlite_url)
    v = reg.get_version("tiny-random-prose", 1)
    assert v.aliases == () and v.mlflow_run_id == summary["run_id"] and v.model == "tiny-random"
    assert v.optuna_study and v.optuna_trial in (0, 1)
    [ev] = reg.evaluations("tiny-random-prose")
    assert (ev.workload, ev.split) == ("prose", "train") and ev.reward == pytest.approx(summary["train"]["reward"])
    mlflow.set_tracking_uri("sqlite:///mlflow.db")
    tags = mlflow.get_run(summary["run_id"]).data.tags
    assert tags["confkv.registry.version"] == "1" and tags["confkv.registry.policy"] == "tiny-random-prose"

    # the same run registered again by id keeps its lineage
    assert tune_main(["register", "from-run", "--run", summary["run_id"], *u]) == 0
    assert capsys.readouterr().out.strip() == "1"
    w = reg.get_version("from-run", 1)
    assert (w.mlflow_run_id, w.model, w.optuna_study, w.optuna_trial) == (
        v.mlflow_run_id, "tiny-random", v.optuna_study, v.optuna_trial)  # fmt: skip
    assert w.sha256 == v.sha256
