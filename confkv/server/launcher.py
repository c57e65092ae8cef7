"""Run ``confkv serve`` (or another server that answers ``GET /health``) as a child process: start it, wait until it
serves, talk to it, stop it. Used by the server tests and the serving benchmarks, and as handy in a user's script:

    from confkv.server.launcher import ServerProcess, serve_command

    with ServerProcess(serve_command("--model", "tiny-random", "--policy", "dynamic")) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")
        ...
        status, text = server.request("GET", "/metrics")

``serve_command`` asks for port 0 on loopback, so two servers never race for a port: ``confkv serve`` prints the port
it got (``confkv: listening on http://HOST:PORT``) and ``ServerProcess`` takes its URL from that line; a server that
prints no such line (``transformers serve``) is given its ``url`` instead. The child's stderr is drained by a thread
into ``lines`` (a full pipe would stall it); ``log`` is what a failure shows. Start-up is bounded: ``RuntimeError``
when the process exits first or ``/health`` has not answered 200 within ``start_timeout`` seconds (the process is
then killed). ``stop()`` sends SIGTERM, on which ``confkv serve`` drains its running requests and writes its sessions
to the store, and kills the process if it is still there after ``stop_timeout`` seconds. Imports nothing heavy.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

#: The line ``confkv serve`` prints to stderr once it listens (``confkv.server.main``).
LISTEN_RE = re.compile(r"confkv: listening on (http://\S+)")


def serve_command(*args: str) -> list[str]:
    """``confkv serve ARGS`` under this interpreter, on loopback and port 0 (``--host``/``--port`` in ARGS win)."""
    return [sys.executable, "-m", "confkv.cli", "serve", "--host", "127.0.0.1", "--port", "0", *args]


def free_port() -> int:
    """A loopback port that is free now, for a server that cannot be asked for port 0."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server child process, ready (``/health`` answered 200) once constructed; a context manager that stops it."""

    def __init__(
        self,
        cmd: Sequence[str],
        *,
        env: Mapping[str, str | None] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        url: str | None = None,
        name: str = "confkv serve",
        start_timeout: float = 120.0,
        stop_timeout: float = 30.0,
    ) -> None:
        """Start ``cmd`` and wait for it. ``env``: changes to this process's environment (None removes a variable);
        ``url``: the server's base URL when it prints no listening line; ``name``: what error messages call it."""
        self.name = name
        self.url = url
        self.stop_timeout = stop_timeout
        self.lines: list[str] = []
        changes = dict(env or {})
        full_env = {k: v for k, v in os.environ.items() if k not in changes}
        full_env.update({k: v for k, v in changes.items() if v is not None})
        self.proc = subprocess.Popen(
            list(cmd), cwd=cwd, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        deadline = time.monotonic() + start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._reader.join(5)  # the whole log, for the message
                raise RuntimeError(f"{name} exited with {self.proc.returncode}:\n{self.log[-4000:]}")
            if self.url is not None and self._healthy():
                return
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"{name} did not become healthy in {start_timeout:.0f}s:\n{self.log[-4000:]}")

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def log(self) -> str:
        """The server's stderr so far."""
        return "".join(self.lines)

    @property
    def base_url(self) -> str:
        """The OpenAI API's base URL (``.../v1``)."""
        assert self.url is not None
        return self.url + "/v1"

    def connection(self, timeout: float = 30.0) -> http.client.HTTPConnection:
        assert self.url is not None
        u = urlsplit(self.url)
        return http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        raw: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> tuple[int, Any]:
        """One request with the standard library (``body`` sent as JSON, ``raw`` as it is): (status, the response
        parsed as JSON, else its text). A connection failure raises ``OSError``."""
        conn = self.connection(timeout)
        try:
            data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            text = resp.read().decode()
        finally:
            conn.close()
        try:
            return resp.status, json.loads(text)
        except json.JSONDecodeError:
            return resp.status, text

    def terminate(self) -> None:
        """SIGTERM, without waiting."""
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> int | None:
        """SIGTERM and wait up to ``stop_timeout`` seconds, then SIGKILL; the exit status."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                return self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def _healthy(self) -> bool:
        try:
            return self.request("GET", "/health", timeout=2)[0] == 200
        except (OSError, http.client.HTTPException):
            return False

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = LISTEN_RE.search(line)
            if m and self.url is None:
                self.url = m.group(1)
