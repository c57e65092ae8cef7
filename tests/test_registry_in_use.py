"""Registry versions in use, on SQLite and PostgreSQL: broken artifacts refused while the old policy stays, the
promotion gate, ``registry://`` references in the engine, hot swap through the watcher mid-batch, and a training run
registering its result (the database fixtures are in ``conftest``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from confkv import LLM, SamplingParams
from confkv.cli import main as confkv_main
from confkv.config import CachePolicy
from confkv.errors import ConfkvError
from envs.episodes import default_base_policy
from store.artifacts import sha256_hex
from store.refs import resolve_ref
from store.registry import Registry
from store.watcher import PolicyWatcher, wait_until
from tests.conftest import fresh_tiny
from tests.registry_helpers import RULE, flip_a_byte, learned_folder, set_artifact
from tuner.cli import main as tune_main


# ------------------------------------------------------------------------------------------------ broken artifacts
def test_a_corrupted_artifact_is_refused_and_the_old_policy_stays(registry_url: str, tmp_path: Path) -> None:
    reg = Registry(registry_url)
    reg.register("cor", learned_folder(tmp_path, 0))
    reg.register("cor", learned_folder(tmp_path, 1))
    reg.register("cor", RULE)
    reg.register("cor", RULE.replace(max_size=256))
    reg.promote("cor", 1)
    set_artifact(reg, "cor", 2, flip_a_byte(reg.artifact("cor", 2)[1]))  # fails its checksum
    junk = b"cache_policy: {max_size: -5}\n"
    set_artifact(reg, "cor", 3, junk, sha256_hex(junk))  # checksum right, does not load
    with pytest.raises(ConfkvError, match="checksum mismatch"):
        resolve_ref("registry://cor@2", registry_url)
    with pytest.raises(ConfkvError, match="does not load"):
        resolve_ref("registry://cor@3", registry_url)

    changes, refused = [], []
    w = PolicyWatcher("registry://cor@production", changes.append, refused.append, registry_url=registry_url,
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
    registry_url = request.getfixturevalue("sqlite_url" if backend == "sqlite" else "pg_url")
    reg = Registry(registry_url)
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
    llm = LLM("tiny-random", policy_file="registry://hs@production", registry_url=registry_url, loaded=fresh_tiny(),
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
