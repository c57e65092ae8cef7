"""``confkv serve`` as a real process for the server tests: ``confkv.server.launcher.ServerProcess`` with the tests'
defaults.

The server runs from the repository root with unbuffered output, on a free loopback port (it asks for port 0 and
prints the one it got, so two test modules never race for a port). Unless a test names a ``--session-store``, the
server gets ``none``: no test writes sessions into the user's cache folder.
"""

from __future__ import annotations

from pathlib import Path

from confkv.server import launcher
from confkv.server.launcher import serve_command

REPO = Path(__file__).resolve().parents[1]


class ServerProcess(launcher.ServerProcess):
    def __init__(self, *args: str, timeout: float = 120.0, env: dict[str, str] | None = None) -> None:
        if "--session-store" not in args:  # keep the tests' sessions out of the user's cache folder
            args = (*args, "--session-store", "none")
        env = {"PYTHONUNBUFFERED": "1", **(env or {})}
        super().__init__(serve_command(*args), env=env, cwd=REPO, start_timeout=timeout)
