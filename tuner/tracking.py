"""MLflow runs for ``confkv-tune``: parameters, metrics per episode or trial, the exported policy as artifact.

The tracking URI defaults to a SQLite file in the working directory (``sqlite:///mlflow.db``) with artifacts
under ``./mlartifacts``; review with ``mlflow ui --backend-store-uri sqlite:///mlflow.db``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
EXPERIMENT = "confkv-tune"


def _quiet() -> None:
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)


@contextmanager
def mlflow_run(tracking_uri: str | None, run_name: str, params: dict[str, Any]) -> Iterator[Any]:
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
    with mlflow.start_run(run_name=run_name) as run:
        mlflow.log_params({k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in params.items()})
        yield run


def log_metrics(metrics: dict[str, Any], step: int | None = None) -> None:
    import mlflow

    clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and v is not None}
    if clean:
        mlflow.log_metrics(clean, step=step)


def log_artifacts(folder: str | Path, artifact_path: str | None = None) -> None:
    import mlflow

    mlflow.log_artifacts(str(folder), artifact_path=artifact_path)


def log_artifact_file(path: str | Path) -> None:
    import mlflow

    mlflow.log_artifact(str(path))


def download_policy(run_id: str, out: str | Path, tracking_uri: str | None) -> Path:
    _quiet()
    import mlflow

    mlflow.set_tracking_uri(tracking_uri or DEFAULT_TRACKING_URI)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path="policy", dst_path=str(out))
    return Path(path)


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
