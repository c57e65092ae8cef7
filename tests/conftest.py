"""Shared fixtures: the tiny random Llama (fast, exact) and, for tests marked slow, the real SmolLM2-135M; the policy
registry's databases (SQLite, and the PostgreSQL CI runs)."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch

from confkv.model_loader import LoadedModel, load_model
from store.db import dispose_engines, parse_url

CPU = torch.device("cpu")


def fresh_tiny(seed: int = 0) -> LoadedModel:
    """A new tiny-random model: the engine switches a model's attention to confkv, so each user gets its own."""
    return load_model("tiny-random", device=CPU, seed=seed)


@pytest.fixture(autouse=True, scope="session")
def _registry_in_a_temporary_folder(tmp_path_factory: pytest.TempPathFactory):
    """``confkv-tune train`` registers its result: keep every test out of the user's own policy registry."""
    mp = pytest.MonkeyPatch()
    mp.setenv("CONFKV_REGISTRY_URL", f"sqlite:///{tmp_path_factory.mktemp('registry') / 'registry.db'}")
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def _no_progress_lines():
    """Long commands write progress lines to stderr when it is not a terminal (``confkv.progress``), as under
    pytest: off here, so the tests that read stderr see what the command says; ``test_progress.py`` turns them on."""
    mp = pytest.MonkeyPatch()
    mp.setenv("CONFKV_PROGRESS", "off")
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def _no_user_calibration(tmp_path_factory: pytest.TempPathFactory):
    """The default policy takes a model's calibrated thresholds when ``confkv calibrate`` wrote them: keep a
    calibration in the user's cache from changing what the tests measure (an empty folder instead)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("CONFKV_CALIBRATION", str(tmp_path_factory.mktemp("calibration")))
    yield
    mp.undo()


@pytest.fixture
def tiny() -> LoadedModel:
    return fresh_tiny()


@pytest.fixture(scope="session")
def tiny_reference() -> LoadedModel:
    """An untouched tiny-random model (same weights as ``tiny``) for Hugging Face reference outputs."""
    return fresh_tiny()


@pytest.fixture(scope="session")
def smollm2_reference() -> LoadedModel:
    return load_model("smollm2-135m", device=CPU)


@pytest.fixture
def smollm2() -> LoadedModel:
    return load_model("smollm2-135m", device=CPU)


def hf_greedy(loaded: LoadedModel, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by Hugging Face ``generate`` (the reference every policy is measured against), on the
    model's device."""
    ids = torch.tensor([prompt_ids], device=loaded.model.device)
    with torch.no_grad():
        out = loaded.model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=loaded.tokenizer.pad_token_id or 0,
            eos_token_id=None,
        )
    return out[0, len(prompt_ids) :].tolist()


def hf_logprobs(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """Log-probability of each token after the first under Hugging Face's own forward pass, in fp32, on the CPU."""
    with torch.no_grad():
        logits = loaded.model(torch.tensor([ids], device=loaded.model.device)).logits[0, :-1].float()
    logp = torch.log_softmax(logits, dim=-1).cpu()
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.fixture(scope="module")
def data():
    """The tuner's mixed training episodes on tiny-random (one build per test module)."""
    from envs.episodes import build_episodes

    return build_episodes("tiny-random", workload="mixed", split="train")


# ------------------------------------------------------------------- registry databases (SQLite and PostgreSQL)
#: PostgreSQL tests run against this server, each in a fresh schema dropped afterwards; they skip when none answers.
PG_BASE = os.environ.get("CONFKV_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


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
def registry_url(request: pytest.FixtureRequest) -> str:
    """Each registry test once on the embedded SQLite default and once on the PostgreSQL that CI runs."""
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")
