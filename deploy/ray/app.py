"""The Ray Serve application file of confkv, for an existing Ray cluster: ``serve run deploy/ray/serve.yaml`` (or
``serve deploy``) from the repository root, on a cluster whose nodes have ``confkv[ray]`` installed.

``build`` takes the config's ``args: {argv: [...]}``, the flags of ``confkv serve --replicas N`` (every serve flag:
model, policy, session store, API key, limits; and the deployment's: replicas, CPU/GPU share, queue, autoscaling),
and returns the same application ``confkv serve --replicas N`` runs. ``--host``/``--port`` are the cluster's
(``http_options`` in the config), not these flags'.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from confkv.cli_args import build_parser
from confkv.scaleout.app import build_application
from confkv.scaleout.options import scaleout_from_args


def build(args: dict[str, Any]) -> Application:
    """The application for ``args["argv"]`` (``confkv serve`` flags; ``--replicas`` defaults to 1)."""
    ns = build_parser().parse_args(["serve", *[str(a) for a in args.get("argv", [])]])
    if ns.replicas is None:
        ns.replicas = 1
    return build_application(ns, scaleout_from_args(ns))
