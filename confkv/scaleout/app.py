"""The Ray Serve application of ``confkv serve --replicas N`` (and of ``deploy/ray/app.py``): the replica class
with the deployment options the flags make, the session-affinity router and 429 backpressure, bound to the flags."""

from __future__ import annotations

import argparse

from ray import serve
from ray.serve import Application
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from confkv.scaleout.options import APP_NAME, FALLBACK_REPLICAS, ScaleOut, replica_args
from confkv.scaleout.replica import ConfkvReplica
from confkv.scaleout.router import SessionAffinityRouter


def build_application(args: argparse.Namespace, scale: ScaleOut, app_name: str = APP_NAME) -> Application:
    """``confkv serve``'s parsed flags (``args``) and the deployment's (``scale``) as a Ray Serve application."""
    deployment = serve.deployment(ConfkvReplica).options(
        name="ConfkvReplica",
        request_router_config=RequestRouterConfig(
            request_router_class=SessionAffinityRouter,
            request_router_kwargs={"num_fallback_replicas": FALLBACK_REPLICAS},
        ),
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=scale.retry_after_s),
        **scale.deployment_options(),
    )
    return deployment.bind(replica_args(args), app_name)
