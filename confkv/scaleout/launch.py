"""``confkv serve --replicas N``: start (or join) a Ray cluster, run the application on Ray Serve's HTTP proxy on
``--host``/``--port``, print the usual listening line, and wait for SIGTERM or Ctrl-C.

On the signal the application is deleted, which stops its replicas gracefully (each finishes its running requests
within ``--shutdown-grace`` and writes its sessions to the store), then the hub, Serve and the Ray cluster this
command started are stopped, and the process exits 0. A cluster joined with ``--ray-address`` is left running.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

from confkv.errors import ConfkvError
from confkv.scaleout.options import APP_NAME, ScaleOut, scaleout_from_args


def ray_missing() -> ConfkvError:
    return ConfkvError("--replicas needs Ray Serve: pip install 'confkv[ray]' (or 'ray[serve]')")


def start(args: argparse.Namespace, scale: ScaleOut, *, num_cpus: float | None = None) -> str:
    """Start or join the cluster and run the application; returns the endpoint's URL (replicas healthy)."""
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ray_missing() from None
    from confkv.scaleout.app import build_application
    from confkv.server.launcher import free_port

    port = args.port or free_port()  # Ray's proxy cannot be asked for port 0
    if not ray.is_initialized():
        if scale.ray_address:
            ray.init(address=scale.ray_address, log_to_driver=False)
        else:
            ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": args.host, "port": port})
    serve.run(build_application(args, scale), name=APP_NAME, route_prefix="/")
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"http://{host}:{port}"


def stop(scale: ScaleOut) -> None:
    """Delete the application (replicas drain and write their sessions), the hub, and what this process started."""
    import ray
    from ray import serve

    from confkv.scaleout.hub import remove_hub

    serve.delete(APP_NAME)
    remove_hub(APP_NAME)
    if not scale.ray_address:
        serve.shutdown()
        ray.shutdown()


def serve_replicas(args: argparse.Namespace) -> int:
    """Run until SIGTERM / Ctrl-C; the exit status."""
    from confkv.server.settings import settings_from_args

    scale = scaleout_from_args(args)
    settings = settings_from_args(args)  # a bad flag is one line here, not a replica failing over and over
    if settings.session_store is not None and settings.session_store.strip().lower() == "none":
        print("confkv: warning: --session-store none: a session lives only on its replica and is lost with it",
              file=sys.stderr)  # fmt: skip
    url = start(args, scale)
    print(f"confkv: listening on {url} ({scale.replicas} replicas on Ray Serve)", file=sys.stderr, flush=True)
    done = threading.Event()

    def on_signal(signum: int, _: Any) -> None:
        done.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    while not done.wait(1.0):
        pass
    print("confkv: stopping the replicas (they finish their requests and write their sessions)", file=sys.stderr,
          flush=True)  # fmt: skip
    stop(scale)
    return 0
