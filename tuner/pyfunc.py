"""An exported learned policy as an MLflow model: ``mlflow.pyfunc.load_model(uri).predict(observations)`` gives
the knobs the network sets, so the policy can be inspected or served without confkv's engine.

The model's one artifact is the exported policy folder itself (``policy.json``, ``policy.safetensors``,
``policy.yaml``: what ``confkv generate --policy-file`` loads), so the MLflow model and the engine run the very same
weights and knob map (``confkv.controllers.learned.MLPPolicy``). Its signature names the observation entries of
the layout the network reads (``obs_names``: 14 for layout 1, 20 for layout 2, each in [0, 1]) as inputs and the
knobs (or ``budget_action``: 0 contract, 1 hold, 2 expand) as outputs. ``train`` logs it beside the policy folder
when the result is a learned policy, with the registry version it became in the model's metadata and tags
(``confkv.registry.ref``), and the model's URI as a run tag (``confkv.pyfunc_model_uri``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlflow.pyfunc
import numpy as np
import pandas as pd
from mlflow.models.signature import ModelSignature
from mlflow.types.schema import ColSpec, Schema

from confkv.config import load_policy_file
from confkv.controllers.learned import MLPPolicy
from confkv.controllers.observation import OBS_VERSION, obs_names
from confkv.errors import ConfkvError

MODEL_NAME = "policy_model"


class LearnedPolicyModel(mlflow.pyfunc.PythonModel):
    """``predict``: one row of observations in, one row of knobs out (the network's deterministic action)."""

    def load_context(self, context: Any) -> None:
        folder = context.artifacts["policy"]
        self.mlp = MLPPolicy.load(folder)
        self.space = self.mlp.resolved_space(load_policy_file(folder)) if self.mlp.action == "knobs" else None

    # no type hints here: MLflow reads predict's hints as a schema of its own, while the signature logged with the
    # model (``signature``) is the schema
    def predict(self, context, model_input, params=None):  # type: ignore[no-untyped-def]
        obs = observations(model_input, self.mlp.obs_version)
        if self.space is None:
            return pd.DataFrame({"budget_action": [int(self.mlp.act(o)) for o in obs]})
        return pd.DataFrame([self.space.knobs(self.mlp.act(o)) for o in obs], columns=list(self.space.names))


def observations(model_input: Any, version: int = OBS_VERSION) -> np.ndarray:
    """Rows of observations of layout ``version`` from a DataFrame with its named columns (``obs_names``) or an
    ``(n, width)`` array."""
    names = obs_names(version)
    if isinstance(model_input, pd.DataFrame):
        missing = [n for n in names if n not in model_input.columns]
        if missing:
            raise ConfkvError(f"the observations lack column(s) {', '.join(missing)}")
        model_input = model_input[list(names)].to_numpy()
    obs = np.array(model_input, dtype=np.float32)  # a copy: MLflow may hand over a read-only array
    if obs.ndim == 1:
        obs = obs[None]
    if obs.ndim != 2 or obs.shape[1] != len(names):
        raise ConfkvError(f"observations are rows of {len(names)} values (got shape {obs.shape})")
    return obs


def signature(folder: str | Path) -> ModelSignature:
    """Observation entries in, the policy's knobs (or its budget action) out."""
    mlp = MLPPolicy.load(folder)
    inputs = Schema([ColSpec("float", name) for name in obs_names(mlp.obs_version)])
    if mlp.action == "budget":
        return ModelSignature(inputs, Schema([ColSpec("long", "budget_action")]))
    space = mlp.resolved_space(load_policy_file(folder))
    return ModelSignature(inputs, Schema([ColSpec("double", name) for name in space.names]))


def log_policy_model(folder: str | Path, registry_ref: str | None = None) -> str:
    """Log the exported learned policy in ``folder`` as a pyfunc model of the active MLflow run; returns its URI."""
    from confkv.cli_args import package_version

    link = {"confkv.registry.ref": registry_ref} if registry_ref else {}
    names = obs_names(MLPPolicy.load(folder).obs_version)
    example = pd.DataFrame([np.full(len(names), 0.5, dtype=np.float32)], columns=list(names))
    info = mlflow.pyfunc.log_model(
        name=MODEL_NAME, python_model=LearnedPolicyModel(), artifacts={"policy": str(folder)},
        signature=signature(folder), input_example=example, metadata=link or None, tags=link or None,
        pip_requirements=[f"confkv=={package_version()}", "torch", "safetensors", "numpy", "pandas"],
    )  # fmt: skip
    mlflow.set_tag("confkv.pyfunc_model_uri", info.model_uri)
    return info.model_uri
