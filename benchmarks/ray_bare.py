"""A Ray Serve application with no confkv code in it, for ``ray_hop.py``: what Ray Serve's proxy and router cost by
themselves, beside what a confkv replica adds. ``--kind fastapi``: a FastAPI app behind ``serve.ingress`` that
answers ``GET /v1/models`` and ``/health`` with a constant (what a confkv replica is, less confkv); ``--kind
function``: a plain deployment whose ``__call__`` answers every path the same (no FastAPI, no ASGI app in the
replica). One replica with 1 CPU, as ``confkv serve --replicas 1 --replica-cpus 1``; runs until SIGTERM.

    python benchmarks/ray_bare.py --kind fastapi --port 8712
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import Any

MODELS = {"object": "list", "data": [{"id": "bare", "object": "model", "owned_by": "nobody"}]}


def application(kind: str) -> Any:
    from fastapi import FastAPI
    from ray import serve

    if kind == "fastapi":
        app = FastAPI()

        @app.get("/v1/models")
        def models() -> dict[str, Any]:
            return MODELS

        @app.get("/health")
        def health() -> dict[str, str]:
            return {"status": "ok"}

        @serve.deployment(ray_actor_options={"num_cpus": 1})
        @serve.ingress(app)
        class BareFastAPI:
            pass

        return BareFastAPI.bind()

    @serve.deployment(ray_actor_options={"num_cpus": 1})
    class BareFunction:
        async def __call__(self, request: Any) -> dict[str, Any]:
            return MODELS

    return BareFunction.bind()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=["fastapi", "function"], required=True)
    ap.add_argument("--port", type=int, default=8712)
    args = ap.parse_args()
    import ray
    from ray import serve

    ray.init(include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(application(args.kind), name="bare", route_prefix="/")
    print(f"listening on http://127.0.0.1:{args.port} ({args.kind})", file=sys.stderr, flush=True)
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    while not done.wait(1.0):
        pass
    serve.shutdown()
    ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
