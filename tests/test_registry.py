"""The policy registry (``store``) on SQLite and on PostgreSQL: schema migrations, register/promote/rollback/export,
concurrent alias moves and the errors of its command line. How versions are used (refused broken artifacts, the
promotion gate, ``registry://`` references in the engine, hot swap, training's registration) is in
``test_registry_in_use``.

PostgreSQL tests run against ``$CONFKV_TEST_POSTGRES`` (default ``postgresql+psycopg://postgres@127.0.0.1:5432/test``),
each in a fresh schema that is dropped afterwards; they skip only when no server answers there.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml

from confkv.config import load_policy_file
from confkv.controllers.learned import MLPPolicy
from confkv.controllers.observation import OBS_DIM
from confkv.errors import ConfkvError
from store.artifacts import sha256_hex
from store.db import (
    VERSION_TABLE,
    current_revision,
    default_registry_url,
    get_engine,
    head_revision,
    parse_url,
    upgrade,
)
from store.errors import NotFoundError, RegistryError
from store.models import Base
from store.refs import is_registry_ref, parse_ref, resolve_ref
from store.registry import Registry
from tests.registry_helpers import RULE, learned_folder
from tuner.cli import main as tune_main


# ------------------------------------------------------------------------------------------------ schema
def test_schema_migrates_from_empty_and_matches_the_models(registry_url: str) -> None:
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    engine = get_engine(registry_url, migrate=False)
    assert current_revision(engine) is None
    Registry(registry_url)  # first use migrates
    assert current_revision(engine) == head_revision() == "0002"
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE, "compare_type": False})
        assert compare_metadata(ctx, Base.metadata) == []
    Registry(registry_url)  # at head already: nothing to do


def test_upgrade_from_the_previous_revision_keeps_data_and_backfills_history(registry_url: str) -> None:
    engine = get_engine(registry_url, migrate=False)
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
    reg = Registry(registry_url)  # upgrades 0001 -> 0002
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
def test_register_promote_rollback_export_round_trip(registry_url: str, tmp_path: Path) -> None:
    reg = Registry(registry_url)
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

    r = resolve_ref("registry://rt", registry_url)  # production by default
    assert (r.name, r.version, r.alias, r.policy.controller) == ("rt", 3, "production", "learned")
    assert r.path is not None and (r.path / "policy.safetensors").is_file() and r.sha256 == v3.sha256
    assert resolve_ref("registry://rt@1", registry_url).policy == RULE

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


def test_the_cli_round_trip(registry_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"cache_policy": RULE.model_dump(mode="json", exclude={"learned_path"})}))
    u = ["--registry-url", registry_url]
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
def test_concurrent_promotions_leave_one_version_and_both_moves(registry_url: str) -> None:
    reg = Registry(registry_url)
    for round_ in range(3):
        name = f"cc{round_}"
        for i in range(3):
            reg.register(name, RULE.replace(max_size=128 + 16 * i))
        reg.promote(name, 1)
        barrier = threading.Barrier(2)
        errors: list[BaseException] = []

        def move(version: int, name: str = name, barrier: threading.Barrier = barrier, errors: list = errors) -> None:
            try:
                mine = Registry(registry_url)
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


def test_concurrent_registrations_get_distinct_version_numbers(registry_url: str) -> None:
    Registry(registry_url)
    barrier = threading.Barrier(4)
    got: list[int] = []

    def register(i: int) -> None:
        mine = Registry(registry_url)
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
    registry_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    Registry(registry_url).register("mv", RULE)
    u = ["--registry-url", registry_url]
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
