"""What the Ray Serve hop costs by itself: a request that does no engine work (``GET /v1/models``, and ``/health``,
which under ``--replicas`` asks the replicas' hub) timed on a plain ``confkv serve`` and on ``confkv serve
--replicas 1``, one request at a time. Beside ``serve_load.py``'s streamed requests, it separates the proxy and
router path from the engine's share of the added time. ``--servers`` adds Ray Serve applications with no confkv
code (``ray_bare.py``: a FastAPI ingress, and a plain function deployment), so that the hop's cost splits into Ray
Serve's own and the confkv replica's; Ray's settings (``RAY_SERVE_*``) are taken from the environment.

    python benchmarks/ray_hop.py --model tiny-random --requests 300
    python benchmarks/ray_hop.py --servers plain,replica,fastapi,function --requests 300
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request

import numpy as np


def wait_until_up(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return True
        except OSError:
            time.sleep(0.5)
    return False


def time_gets(url: str, n: int, warmup: int = 20) -> list[float]:
    for _ in range(warmup):
        urllib.request.urlopen(url).read()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        urllib.request.urlopen(url).read()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--port", type=int, default=8711)
    ap.add_argument("--servers", default="plain,replica",
                    help="comma-separated, of: plain (confkv serve), replica (confkv serve --replicas 1), fastapi and "
                    "function (Ray Serve with no confkv code, ray_bare.py)")  # fmt: skip
    args = ap.parse_args()
    confkv = os.path.join(os.path.dirname(sys.executable), "confkv")
    bare = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ray_bare.py")]
    known = {
        "plain": ("confkv serve", lambda port: [confkv, "serve", "--model", args.model, "--port", str(port),
                                                 "--log-level", "warning"]),
        "replica": ("--replicas 1", lambda port: [confkv, "serve", "--model", args.model, "--port", str(port),
                                                   "--log-level", "warning", "--replicas", "1", "--replica-cpus", "1"]),
        "fastapi": ("Ray Serve, FastAPI ingress, no confkv", lambda port: [*bare, "--kind", "fastapi", "--port",
                                                                           str(port)]),
        "function": ("Ray Serve, function deployment", lambda port: [*bare, "--kind", "function", "--port", str(port)]),
    }  # fmt: skip
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    if unknown := [n for n in names if n not in known]:
        ap.error(f"unknown server(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    print("| server | path | p50 ms | p99 ms |\n|---|---|---:|---:|")
    for i, name in enumerate(names):
        label, make_cmd = known[name]
        port = args.port + i
        cmd = make_cmd(port)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            if not wait_until_up(f"http://127.0.0.1:{port}/v1/models", 180):
                print(f"{label}: did not start within 180 s", file=sys.stderr)
                return 1
            for path in ("/v1/models", "/health"):
                ms = time_gets(f"http://127.0.0.1:{port}{path}", args.requests)
                print(f"| {label} | `{path}` | {np.percentile(ms, 50):.2f} | {np.percentile(ms, 99):.2f} |", flush=True)
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
