"""What the registry's test modules build: a small exported learned policy, and artifacts broken on purpose."""

from __future__ import annotations

from pathlib import Path

import sqlalchemy as sa
import torch

from confkv.config import CachePolicy
from confkv.controllers.learned import MLPPolicy
from confkv.controllers.observation import OBS_DIM
from store.models import PolicyVersion
from store.registry import Registry

RULE = CachePolicy(base_size=32, max_size=128, min_recent=16)


def learned_folder(tmp_path: Path, seed: int = 0, base: CachePolicy = RULE) -> Path:
    """A small exported learned policy (random weights): what ``agents.export`` writes, without training."""
    g = torch.Generator().manual_seed(seed)
    layers = [
        (torch.randn(8, OBS_DIM, generator=g) * 0.3, torch.zeros(8), "tanh"),
        (torch.randn(3, 8, generator=g) * 0.3, torch.zeros(3), "none"),
    ]
    return MLPPolicy(layers=layers, action="knobs").save(tmp_path / f"learned-{seed}", base)


def set_artifact(reg: Registry, name: str, version: int, data: bytes, sha256: str | None = None) -> None:
    """Overwrite a version's stored artifact (and optionally its recorded checksum), as a corruption would."""
    values: dict = {"artifact": data}
    if sha256 is not None:
        values["artifact_sha256"] = sha256
    with reg.engine.begin() as conn:
        pid = conn.execute(sa.text("SELECT id FROM confkv_policies WHERE name = :n"), {"n": name}).scalar_one()
        conn.execute(
            sa.update(PolicyVersion.__table__)
            .where(PolicyVersion.__table__.c.policy_id == pid, PolicyVersion.__table__.c.version == version)
            .values(**values)
        )


def flip_a_byte(data: bytes) -> bytes:
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
