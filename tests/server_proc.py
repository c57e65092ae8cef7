"""Start ``confkv serve`` as a real process on a free loopback port, for the server tests.

The server is asked for port 0 and prints the port it got (``confkv: listening on http://HOST:PORT``), so two test
modules never race for a port. Its stderr is drained by a thread into ``log`` (a full pipe would stall it). Unless
a test names a ``--session-store``, the server gets ``none``: no test writes sessions into the user's cache folder.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parents[1]
_LISTEN = re.compile(r"confkv: listening on (http://[^\s]+)")


class ServerProcess:
    def __init__(self, *args: str, timeout: float = 120.0, env: dict[str, str] | None = None) -> None:
        if "--session-store" not in args:  # keep the tests' sessions out of the user's cache folder
            args = (*args, "--session-store", "none")
        cmd = [sys.executable, "-m", "confkv.cli", "serve", "--host", "127.0.0.1", "--port", "0", *args]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=full_env
        )
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(timeout) or self.url is None:
            self.kill()
            raise RuntimeError("server did not start:\n" + self.log)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError("server never became healthy:\n" + self.log)

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
        """One request with the standard library; returns (status, parsed JSON or text)."""
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

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            m = _LISTEN.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    @property
    def base_url(self) -> str:
        assert self.url is not None
        return self.url + "/v1"

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> int | None:
        """SIGTERM and wait; SIGKILL if it does not go."""
        if self.proc.poll() is None:
            self.terminate()
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode
