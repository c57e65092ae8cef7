"""Where a result came from: the commit of the code that produced it."""

from __future__ import annotations

import subprocess
from pathlib import Path


def git_commit(short: bool = True, cwd: str | Path | None = None) -> str:
    """The commit HEAD names in the checkout at ``cwd`` (default: the working directory), abbreviated or in full;
    ``unknown`` outside a checkout or without git."""
    cmd = ["git", "rev-parse", *(["--short"] if short else []), "HEAD"]
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"
