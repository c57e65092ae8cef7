"""The tuner's plots: an RL run's learning curve, an Optuna study's trials, and a comparison's policies."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def learning_curve(
    out: Path, title: str, episodes: list[tuple[float, float]], evals: list[tuple[float, float]], default: float
) -> None:
    """Episode rewards (dots), their running mean over 20, the deterministic policy's evaluations (line) and the
    default rule's reward on the same episodes (dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4))
    if episodes:
        xs, ys = map(np.array, zip(*episodes, strict=True))
        ax.scatter(xs, ys, s=6, alpha=0.3, label="episode reward")
        k = min(20, len(ys))
        ax.plot(xs[k - 1 :], np.convolve(ys, np.ones(k) / k, mode="valid"), lw=1.5, label=f"mean of {k} episodes")
    if evals:
        ex, ey = zip(*evals, strict=True)
        ax.plot(ex, ey, marker="o", lw=2, label="deterministic policy, all training episodes")
    ax.axhline(default, ls="--", c="gray", label="default rule")
    ax.set_xlabel("timestep (segments)")
    ax.set_ylabel("reward per episode")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "reward_curve.png", dpi=110)
    plt.close(fig)


def optuna_trials_plot(path: Path, xs: list[float], ys: list[float], study_name: str) -> None:
    """Every trial's resident KV fraction against its KL to full, coloured by trial order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 4))
    ax.scatter(xs, ys, c=range(len(xs)), cmap="viridis")
    ax.set_xlabel("resident KV fraction")
    ax.set_ylabel("mean KL to full (nats)")
    ax.set_title(f"Optuna trials ({study_name})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare_plot(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    """Each compared policy at its resident KV fraction and KL to full."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    for r in rows:
        ax.scatter(r["kv_fraction"], r["kl_mean"], s=40)
        ax.annotate(r["policy"], (r["kv_fraction"], r["kl_mean"]), textcoords="offset points", xytext=(4, 4))
    ax.set_xlabel("resident KV fraction (lower saves more)")
    ax.set_ylabel("mean KL to full (lower is better)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
