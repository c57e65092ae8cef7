"""MLflow runs for ``confkv-tune``: parameters, metrics per episode or trial, the exported policy as artifact.

Every command that measures something is a run of the one experiment ``confkv-tune``: ``train`` (learning curves,
the best trial's parameters as tags), ``eval`` and ``compare`` (held-out figures, one run per invocation, tagged
``confkv.kind``). Every run is tagged with the git commit of the code that made it (``mlflow.source.git.commit``,
plus ``confkv.git_dirty`` when the working tree had uncommitted changes to tracked files).

The tracking URI defaults to a SQLite file in the working directory (``sqlite:///mlflow.db``) with artifacts
under ``./mlartifacts``; review with ``mlflow ui --backend-store-uri sqlite:///mlflow.db``.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from confkv.errors import ConfkvError

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
EXPERIMENT = "confkv-tune"


def _quiet() -> None:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


@functools.cache
def git_commit() -> dict[str, str]:
    """The commit the running code comes from, and whether tracked files differ from it ({} outside a checkout)."""
    from confkv.bench.provenance import git_commit as head_commit

    root = Path(__file__).resolve().parents[1]
    commit = head_commit(short=False, cwd=root)
    if commit == "unknown":
        return {}
    try:
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, "dirty": "true" if dirty.stdout.strip() else "false"}


def metric_key(name: str) -> str:
    """A name MLflow accepts as (part of) a metric key: letters, digits, ``_ - . /`` and spaces."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]+", "_", name)


def check_tracking_uri(uri: str | None) -> None:
    """Refuse a tracking URI whose scheme no MLflow tracking store (plugins included) takes, before a command loads
    its model: MLflow itself only fails when the run starts, with a traceback. Anything MLflow knows passes (paths,
    ``file:``, ``sqlite:``, ``postgresql:``, ``http(s):``, ``databricks``...); whether the store is reachable is
    found out when the run starts."""
    if uri is None:
        return
    _quiet()
    from mlflow.exceptions import MlflowException

    try:
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry as registry
    except ImportError:  # a private name: if MLflow moves it, the run itself reports the URI (see tuner.cli.main)
        return
    try:
        registry.get_store_builder(uri)
    except MlflowException:
        known = ", ".join(s for s in getattr(registry, "_registry", {}) if s) or "file, sqlite, http, https"
        raise ConfkvError(f"--tracking-uri {uri!r} is not a URI MLflow can track to; give a folder path or a URI "
                          f"of one of the schemes {known}") from None  # fmt: skip


@contextmanager
def mlflow_run(
    tracking_uri: str | None, run_name: str, params: dict[str, Any], tags: dict[str, Any] | None = None
) -> Iterator[Any]:
    """An MLflow run of the ``confkv-tune`` experiment with ``params``, ``tags`` and the git commit as tags.

    The run ends FINISHED, FAILED on an exception (MLflow's own rule) or KILLED when the block is interrupted
    (Ctrl-C, or SIGTERM turned into ``KeyboardInterrupt`` by ``tuner.interrupt``): a stopped run never stays
    RUNNING in the tracking store."""
    _quiet()
    import mlflow

    _quiet()  # mlflow sets its own logger level on import
    mlflow.set_tracking_uri(tracking_uri or DEFAULT_TRACKING_URI)
    if mlflow.get_experiment_by_name(EXPERIMENT) is None:
        location = None
        if (tracking_uri or DEFAULT_TRACKING_URI).startswith("sqlite:"):
            location = Path("mlartifacts").resolve().as_uri()
        mlflow.create_experiment(EXPERIMENT, artifact_location=location)
    mlflow.set_experiment(EXPERIMENT)
    git = git_commit()
    all_tags = {**({"mlflow.source.git.commit": git["commit"], "confkv.git_commit": git["commit"],
                    "confkv.git_dirty": git["dirty"]} if git else {}), **(tags or {})}  # fmt: skip
    with mlflow.start_run(run_name=run_name, tags={k: str(v) for k, v in all_tags.items()}) as run:
        try:
            mlflow.log_params({k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in params.items()})
            yield run
        except KeyboardInterrupt:
            mlflow.end_run(status="KILLED")  # start_run's exit then finds no active run and leaves it so
            raise


def log_metrics(metrics: dict[str, Any], step: int | None = None) -> None:
    """Log the numeric values of ``metrics`` (others, and None, are skipped)."""
    import mlflow

    clean = {
        metric_key(k): float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }
    if clean:
        mlflow.log_metrics(clean, step=step)


def log_artifacts(folder: str | Path, artifact_path: str | None = None) -> None:
    import mlflow

    mlflow.log_artifacts(str(folder), artifact_path=artifact_path)


def log_artifact_file(path: str | Path) -> None:
    import mlflow

    mlflow.log_artifact(str(path))


def log_dict(doc: Any, name: str) -> None:
    """A JSON artifact (per-episode rows of an evaluation)."""
    import mlflow

    mlflow.log_dict(doc, name)


def download_policy(run_id: str, out: str | Path, tracking_uri: str | None) -> Path:
    """Write a run's exported policy to ``out`` and return what to load: the folder ``out`` itself (its
    ``policy.yaml``, and a learned policy's network beside it), or ``out`` as a file when it names a
    ``.yaml``/``.yml`` file and the policy is a rule one, as ``export`` from the registry does: either way
    ``confkv generate --policy-file OUT`` loads it. A learned policy is a folder, so a file name for it is refused
    rather than becoming a folder named like a file."""
    _quiet()
    import mlflow

    from confkv.config import load_policy_file

    mlflow.set_tracking_uri(tracking_uri or DEFAULT_TRACKING_URI)
    out = Path(out)
    if out.suffix in (".yaml", ".yml"):
        if out.is_dir():
            raise ConfkvError(f"--out {out} is an existing folder, not a YAML file")
        with tempfile.TemporaryDirectory(prefix="confkv-export-") as tmp:
            folder = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="policy", dst_path=tmp))
            policy = load_policy_file(folder)
            if policy.controller == "learned" or policy.learned_path is not None:
                raise ConfkvError(f"run {run_id} holds a learned policy: it exports to a folder, not to {out}")
            out.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / "policy.yaml", out)
        return out
    if out.exists() and not out.is_dir():
        raise ConfkvError(f"--out {out} is an existing file; give a folder (or a .yaml name for a rule policy)")
    with tempfile.TemporaryDirectory(prefix="confkv-export-") as tmp:
        folder = Path(mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="policy", dst_path=tmp))
        return copy_policy_folder(folder, out)


def copy_policy_folder(folder: Path, out: Path) -> Path:
    """The files of an exported policy folder copied into ``out`` (created), so ``out/policy.yaml`` is the policy
    and a learned policy's relative ``learned_path`` still finds its network; returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(folder, out, dirs_exist_ok=True)
    return out


def get_run(run_id: str, tracking_uri: str | None) -> Any:
    """An MLflow run (its params and tags carry the model and the Optuna study a policy came from)."""
    _quiet()
    import mlflow

    mlflow.set_tracking_uri(tracking_uri or DEFAULT_TRACKING_URI)
    return mlflow.get_run(run_id)


def set_tags(tags: dict[str, Any]) -> None:
    """Tag the active run (``confkv-tune train`` records the registry version it created)."""
    import mlflow

    mlflow.set_tags({k: str(v) for k, v in tags.items()})
